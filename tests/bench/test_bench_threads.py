"""`--threads` on the `python -m blockdraft.bench.spec_k` / `cpu_vs_hf` / `prefix_cache` scripts (the `blockdraft`
commands' flag, from blockdraft.cli): parsed, applied to torch before any model work, refused
below 1, and passed on to cpu_vs_hf's measured children. No model runs here."""

from __future__ import annotations

import json

import pytest
import torch

import blockdraft.drafters
from blockdraft.bench import cpu_vs_hf, prefix_cache, spec_k


class _Stop(Exception):
    """Raised where the benchmark would start loading models."""


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _stop(*args, **kwargs):
    raise _Stop


@pytest.mark.parametrize("main", [spec_k.main, prefix_cache.main])
def test_bench_sets_threads_before_any_model_work(main, monkeypatch, restore_threads):
    monkeypatch.setattr(blockdraft.drafters, "resolve_draft", _stop)  # the first step after the flags
    torch.set_num_threads(2)
    with pytest.raises(_Stop):
        main(["--threads", "1"])
    assert torch.get_num_threads() == 1


@pytest.mark.parametrize("main", [spec_k.main, cpu_vs_hf.main, prefix_cache.main])
def test_threads_below_one_is_a_usage_error(main, capsys, restore_threads):
    with pytest.raises(SystemExit) as e:
        main(["--threads", "0"])
    assert e.value.code == 2
    assert "--threads must be an integer >= 1, got 0" in capsys.readouterr().err


def test_cpu_vs_hf_child_runs_with_threads(monkeypatch, capsys, restore_threads):
    monkeypatch.setattr(cpu_vs_hf, "_child_ours", lambda *a: {"threads": torch.get_num_threads()})
    torch.set_num_threads(2)
    assert cpu_vs_hf.main(["--child", "ours", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out) == {"threads": 1}


def test_cpu_vs_hf_passes_threads_to_both_children_and_records_it(monkeypatch, tmp_path, restore_threads):
    commands = []

    def fake_child(engine, args):
        commands.append(cpu_vs_hf._child_command(engine, args))
        return {"tokens": 4, "seconds": 1.0, "token_ids": [1, 2, 3, 4], "peak_rss_mib": 10.0}

    monkeypatch.setattr(cpu_vs_hf, "_run_child", fake_child)
    out = tmp_path / "r.json"
    assert cpu_vs_hf.main(["--threads", "1", "--repeats", "1", "--json-out", str(out)]) == 0
    assert [c[c.index("--child") + 1] for c in commands] == ["ours", "hf"]
    assert all(c[-2:] == ["--threads", "1"] for c in commands)
    assert json.loads(out.read_text())["threads"] == 1
    commands.clear()
    assert cpu_vs_hf.main(["--repeats", "1", "--json-out", str(out)]) == 0
    # no flag: the parent's choice ($BLOCKDRAFT_THREADS here, else from the load) once, for every child
    n = torch.get_num_threads()
    assert all(c[-2:] == ["--threads", str(n)] for c in commands) and json.loads(out.read_text())["threads"] == n


@pytest.mark.parametrize("main, bad", [(spec_k.main, "--repeats"), (prefix_cache.main, "--num-questions")])
def test_flag_error_comes_without_the_thread_notice(main, bad, monkeypatch, capsys, restore_threads):
    """A bad flag is reported alone: the automatic thread choice (and its notice) comes after the checks."""
    from blockdraft import cpu_threads

    monkeypatch.delenv(cpu_threads.THREADS_ENV, raising=False)
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda available, cpus=None: 1.3)  # would say "1 CPU thread"
    with pytest.raises(SystemExit) as e:
        main([bad, "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and bad in err and "CPU thread" not in err
