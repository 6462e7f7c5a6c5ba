"""--threads and its default: torch's thread count minus the cores other processes keep busy."""

import pytest
import torch

from blockdraft import cpu_threads
from blockdraft.cpu_threads import THREADS_ENV, auto_threads, busy_cpus, set_threads


@pytest.fixture
def restore_threads(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv(THREADS_ENV, raising=False)
    yield
    torch.set_num_threads(before)


def test_auto_threads_leaves_the_busy_cores_to_their_jobs():
    assert auto_threads(2, 2, 1.2) == 1  # another job holds a core: one thread
    assert auto_threads(2, 2, 0.3) == 2  # light background load: torch's default
    assert auto_threads(2, 2, 3.5) == 1  # never below one
    assert auto_threads(8, 8, 3.4) == 5  # the free cores, rounded
    assert auto_threads(4, 8, 0.0) == 4  # never above torch's own choice
    assert auto_threads(2, 2, None) == 2  # unknown load: torch's default


def test_busy_cpus_reads_the_non_idle_share_while_it_sleeps():
    readings = iter([(100, 1000), (150, 1100)])  # (idle, total) jiffies: half the time busy
    assert busy_cpus(2, interval_s=0, read=lambda: next(readings)) == pytest.approx(1.0)
    same = iter([(100, 1000), (100, 1000)])  # no tick between the readings
    assert busy_cpus(2, interval_s=0, read=lambda: next(same)) is None

    def unreadable():
        raise OSError("no /proc/stat")

    assert busy_cpus(2, interval_s=0, read=unreadable) is None
    assert 0.0 <= busy_cpus(1, interval_s=0.05) <= 1.0  # this machine's /proc/stat


def test_default_takes_fewer_threads_on_a_busy_machine_and_says_so(restore_threads, monkeypatch, capsys):
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda available: 1.3)
    set_threads(None)
    assert torch.get_num_threads() == 1
    assert "1 CPU thread for the model's math, not 2: other processes keep about 1.3 of 2 cores busy" in \
        capsys.readouterr().err
    torch.set_num_threads(2)
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda available: 0.2)
    set_threads(None)
    assert torch.get_num_threads() == 2 and capsys.readouterr().err == ""  # idle: nothing changed, nothing said


def test_flag_and_environment_win_over_the_automatic_choice(restore_threads, monkeypatch):
    monkeypatch.setattr(cpu_threads, "busy_cpus", lambda available: pytest.fail("the load must not be read"))
    set_threads(3)
    assert torch.get_num_threads() == 3
    monkeypatch.setenv(THREADS_ENV, "2")
    set_threads(None)
    assert torch.get_num_threads() == 2
    set_threads(1)  # the flag over the environment
    assert torch.get_num_threads() == 1
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=rf"\$BLOCKDRAFT_THREADS must be an integer >= 1 \(CPU threads\), got '{bad}'"):
            set_threads(None)
    with pytest.raises(ValueError, match="--threads must be an integer >= 1, got 0"):
        set_threads(0)
