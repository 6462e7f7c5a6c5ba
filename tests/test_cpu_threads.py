"""--threads and its default: torch's thread count minus the cores other processes keep busy."""

import os
import re

import numpy as np
import pytest
import torch

from blockdraft import cpu_threads
from blockdraft.cpu_threads import THREADS_ENV, auto_threads, busy_cpus, set_threads


@pytest.fixture
def restore_threads(monkeypatch):
    """torch's count restored after the test, no $BLOCKDRAFT_THREADS, and the process-wide choice
    state fresh (nothing chosen yet, nothing pending; torch's default: the count now)."""
    before = torch.get_num_threads()
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr(cpu_threads, "_chosen", False)
    monkeypatch.setattr(cpu_threads, "_auto_pending", False)
    monkeypatch.setattr(cpu_threads, "_torch_default", before)
    yield
    torch.set_num_threads(before)


def _busy_machine(monkeypatch, busy: float = 1.3) -> None:
    """Two cores, `busy` of them taken by other processes, torch at 2 threads (its default here):
    the automatic choice takes 1 and says so."""
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "_torch_default", 2)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda available, cpus=None: busy)


def _no_load_sample(*args, **kwargs):
    pytest.fail("the load must not be read")


NOTICE = "CPU thread for the model's math, not 2"


def test_auto_threads_leaves_the_busy_cores_to_their_jobs():
    assert auto_threads(2, 2, 1.2) == 1  # another job holds a core: one thread
    assert auto_threads(2, 2, 0.3) == 2  # light background load: torch's default
    assert auto_threads(2, 2, 3.5) == 1  # never below one
    assert auto_threads(8, 8, 3.4) == 5  # the free cores, rounded
    assert auto_threads(4, 4, 1.5) == 3 and auto_threads(4, 4, 2.5) == 2  # half a free core counts as one
    assert auto_threads(4, 8, 0.0) == 4  # never above torch's own choice
    assert auto_threads(2, 2, None) == 2  # unknown load: torch's default


def test_busy_cpus_reads_the_non_idle_share_while_it_sleeps():
    readings = iter([(100, 1000), (150, 1100)])  # (idle, total) jiffies: half the time busy
    assert busy_cpus(2, interval_s=0, read=lambda cpus: next(readings)) == pytest.approx(1.0)
    same = iter([(100, 1000), (100, 1000)])  # no tick between the readings
    assert busy_cpus(2, interval_s=0, read=lambda cpus: next(same)) is None

    def unreadable(cpus):
        raise OSError("no /proc/stat")

    assert busy_cpus(2, interval_s=0, read=unreadable) is None


def test_cpu_times_come_from_this_process_cpus(tmp_path, monkeypatch):
    """A container that sees the host's /proc/stat reads the lines of its own CPUs: here CPU 1 is
    busy and CPU 3 idle while the host total says little."""
    import builtins

    stat = ("cpu  1000 0 0 9000 0 0 0 0 0 0\n"
            "cpu0 0 0 0 2500 0 0 0 0 0 0\ncpu1 500 0 0 0 0 0 0 0 0 0\n"
            "cpu2 0 0 0 2500 0 0 0 0 0 0\ncpu3 0 0 0 500 0 0 0 0 0 0\nintr 1 2 3\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: __import__("io").StringIO(stat)
                        if path == "/proc/stat" else real_open(path, *a, **k))
    assert cpu_threads._read_cpu_times([1, 3]) == (500, 1000)  # idle+iowait, total of cpu1 + cpu3
    assert cpu_threads._read_cpu_times(None) == (9000, 10000)  # the first line: all CPUs
    assert cpu_threads._read_cpu_times([1, 7]) == (9000, 10000)  # a CPU without a line: all CPUs


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux /proc/stat")
def test_busy_cpus_on_this_machine():
    cpus = sorted(os.sched_getaffinity(0))
    assert 0.0 <= busy_cpus(len(cpus), interval_s=0.05, cpus=cpus) <= len(cpus)


def test_default_takes_fewer_threads_on_a_busy_machine_and_says_so(restore_threads, monkeypatch, capsys):
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda available, cpus=None: 1.3)
    set_threads(None)
    assert torch.get_num_threads() == 1
    assert ("1 CPU thread for the model's math, not 2: 2 cores available to this process, other processes keep "
            "about 1.3 of them busy") in capsys.readouterr().err
    torch.set_num_threads(2)
    set_threads(None, auto=False)  # a GPU run: torch's default, the load not read
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda available, cpus=None: 0.2)
    set_threads(None)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""  # idle: nothing changed, nothing said


def test_flag_and_environment_win_over_the_automatic_choice(restore_threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda *a, **k: pytest.fail("the load must not be read"))
    set_threads(3)
    assert torch.get_num_threads() == 3
    monkeypatch.setenv(THREADS_ENV, "2")
    set_threads(None)
    assert torch.get_num_threads() == 2
    set_threads(1)  # the flag over the environment
    assert torch.get_num_threads() == 1
    for bad in ("0", "two", "-1", "\u00b2"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=rf"\$BLOCKDRAFT_THREADS must be an integer >= 1 \(CPU threads\), got '{bad}'"):
            set_threads(None)
    with pytest.raises(ValueError, match="--threads must be an integer >= 1, got 0"):
        set_threads(0)


def test_a_count_above_the_cores_is_kept_and_said_to_cost(restore_threads, monkeypatch, capsys):
    """--threads / LLM(threads) / $BLOCKDRAFT_THREADS beyond the cores this process may use: applied
    as asked (the user's choice), with one line saying what it costs; at most the cores: silent."""
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda *a, **k: pytest.fail("the load must not be read"))
    set_threads(2)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
    set_threads(8)
    assert torch.get_num_threads() == 8
    assert capsys.readouterr().err == (
        "blockdraft: 8 CPU threads asked for, more than the 2 cores available to this process: the threads take "
        "turns on the cores, which stalls torch's math (--threads 2 or fewer is faster)\n")


def test_fetch_does_not_read_the_load_and_gpu_commands_keep_torch_default(monkeypatch):
    """`fetch` runs no model: no thread choice at all; a command on CUDA keeps torch's default."""
    from blockdraft import cli

    calls = []
    monkeypatch.setattr(cli, "command_threads", lambda threads, auto=True: calls.append((threads, auto)))
    cli.main(["fetch", "--list"])
    assert calls == []
    assert cli._runs_on_cuda(type("A", (), {"device": "cuda"})()) is True
    assert cli._runs_on_cuda(type("A", (), {"device": "cpu"})()) is False
    assert cli._runs_on_cuda(object()) is False  # no --device (demo): the CPU


def test_engine_threads_explicit_environment_gpu_and_user_set(restore_threads, monkeypatch, capsys):
    """LLM(threads=...): an explicit count always; None: $BLOCKDRAFT_THREADS, else the automatic
    choice on the CPU only, never over a count the user set, and once per process."""
    from blockdraft.cpu_threads import engine_threads

    _busy_machine(monkeypatch)
    monkeypatch.setattr(cpu_threads, "busy_cpus", _no_load_sample)
    engine_threads(1, "cuda")  # explicit: applied on any device, without reading the load
    assert torch.get_num_threads() == 1
    monkeypatch.setattr(cpu_threads, "_chosen", False)
    torch.set_num_threads(2)
    engine_threads(None, "cuda")  # a GPU engine: torch's default
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
    monkeypatch.setenv(THREADS_ENV, "1")
    engine_threads(None, "cuda")  # the variable is the user's explicit choice, on any device
    assert torch.get_num_threads() == 1
    monkeypatch.delenv(THREADS_ENV)
    monkeypatch.setattr(cpu_threads, "_chosen", False)
    torch.set_num_threads(3)  # the user's own torch.set_num_threads: not torch's default (2), kept
    engine_threads(None, "cpu")
    assert torch.get_num_threads() == 3 and capsys.readouterr().err == ""
    monkeypatch.setenv(THREADS_ENV, "abc")  # kept count, but a typo in the variable is still an error
    with pytest.raises(ValueError, match=r"\$BLOCKDRAFT_THREADS must be an integer >= 1 \(CPU threads\), got 'abc'"):
        engine_threads(None, "cpu")
    monkeypatch.delenv(THREADS_ENV)
    engine_threads(np.int64(1), "cpu")  # a numpy integer is an integer
    assert torch.get_num_threads() == 1
    for bad in (0, -1, True, 1.5, "2", np.float64(2.0)):
        with pytest.raises(ValueError, match=rf"threads must be None or an integer >= 1 \(CPU threads\), got {re.escape(repr(bad))}"):
            engine_threads(bad, "cpu")


def test_engine_threads_automatic_choice_once(restore_threads, monkeypatch, capsys):
    from blockdraft.cpu_threads import engine_threads

    _busy_machine(monkeypatch)
    engine_threads(None, "cpu")
    assert torch.get_num_threads() == 1 and NOTICE in capsys.readouterr().err
    monkeypatch.setattr(cpu_threads, "busy_cpus", _no_load_sample)
    torch.set_num_threads(2)  # back to torch's default, as if the load had left it there
    engine_threads(None, "cpu")  # a second engine keeps the process's choice: no second sample
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""


def test_llm_applies_threads_before_its_model_work(restore_threads, monkeypatch, capsys, llama_target):
    from blockdraft.llm import LLM

    with pytest.raises(ValueError, match="threads must be None or an integer >= 1 \\(CPU threads\\), got 0"):
        LLM(model="no-such-model", threads=0)  # checked with the other settings, before the model is looked up
    _busy_machine(monkeypatch)
    LLM(target=llama_target, num_kv_blocks=16, kv_block_size=4)
    assert torch.get_num_threads() == 1 and NOTICE in capsys.readouterr().err
    LLM(target=llama_target, num_kv_blocks=16, kv_block_size=4, threads=2)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""


def test_command_defers_the_automatic_choice_to_the_first_model_build(restore_threads, monkeypatch, capsys):
    """A command's automatic choice (and its notice) comes at its first model build, after its
    flags are checked; --threads N is applied at once; a choice never made is dropped."""
    from blockdraft.cpu_threads import command_threads
    from blockdraft.models import build_model
    from tests.conftest import tiny_config

    _busy_machine(monkeypatch)
    with command_threads(None):
        assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""
        build_model(tiny_config())
        assert torch.get_num_threads() == 1 and NOTICE in capsys.readouterr().err
    monkeypatch.setattr(cpu_threads, "_chosen", False)
    monkeypatch.setattr(cpu_threads, "busy_cpus", _no_load_sample)
    with command_threads(None):
        pass  # e.g. a bad flag: no model built
    assert cpu_threads._auto_pending is False
    with command_threads(2):
        assert torch.get_num_threads() == 2


@pytest.mark.parametrize("bad", [["--top-p", "2"], ["--model", "no-such-model"],
                                 ["--structured-outputs", '{"regex": "("}']])
def test_cli_argument_error_comes_without_the_thread_notice(bad, restore_threads, monkeypatch, capsys):
    """A flag error (in the command: top_p, a regex that does not parse; in the engine's checks
    before the weights load: the model) is reported alone: no thread notice, no load sample,
    torch's count untouched."""
    from blockdraft import cli

    _busy_machine(monkeypatch)
    assert cli.main(["generate", "hi", "--device", "cpu", "--no-draft", *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "CPU thread" not in err
    assert torch.get_num_threads() == 2 and cpu_threads._auto_pending is False


def test_cli_error_found_after_the_model_loads_is_one_last_line(restore_threads, monkeypatch, capsys, tmp_path):
    """A prompt longer than --max-model-len needs the tokenizer, so the thread notice (made at the
    model build) comes first; the error still ends stderr as one `error:` line, exit 2."""
    from blockdraft import cli
    from tests.server.tiny_model import write_tiny_model

    model = write_tiny_model(tmp_path / "model")
    _busy_machine(monkeypatch)
    assert cli.main(["generate", " ".join(["w05x"] * 30), "--raw", "--model", str(model), "--device", "cpu",
                     "--no-draft", "--max-model-len", "20"]) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 2 and NOTICE in lines[0], err
    assert re.fullmatch(r"error: prompt has 30 tokens but the engine's context is 20 tokens \(.*\)", lines[1]), err
