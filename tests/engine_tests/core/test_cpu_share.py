"""engine.core.cpu_share: the cores other processes leave free, from /proc/stat and
/proc/self/stat."""

from __future__ import annotations

import time

import pytest

from engine.core.cpu_share import (
    CpuShareMonitor,
    CpuTimes,
    free_cores,
    others_cores,
    read_cpu_times,
)

# user nice system idle iowait irq softirq steal (guest fields after them are inside user)
STAT = """cpu  900 0 100 1000 0 0 0 0 0 0
cpu0 400 0 50 500 10 0 0 40 0 0
cpu1 500 0 50 500 0 0 0 0 0 0
cpu2 7 0 0 9 0 0 0 0 0 0
intr 12345
ctxt 6789
"""
# pid (comm) state ppid ... field 14 utime = 30, field 15 stime = 12; a comm with spaces and ')'
SELF_STAT = "4242 (python (x) y) R 1 2 3 4 5 6 7 8 9 10 30 12 0 0 20 0 9 0 100 200 300"


def test_cpu_times_sum_our_cpus_and_count_steal_as_busy() -> None:
    times = read_cpu_times(STAT, SELF_STAT, cpus={0, 1})
    assert times.total == (400 + 50 + 500 + 10 + 40) + (500 + 50 + 500)
    # idle and iowait are not busy; steal (the hypervisor took the core) is.
    assert times.busy == (400 + 50 + 40) + (500 + 50)
    assert times.own == 42


def test_cpus_outside_our_affinity_are_not_counted() -> None:
    assert read_cpu_times(STAT, SELF_STAT, cpus={2}).total == 16


def test_others_are_the_busy_time_we_did_not_use() -> None:
    before = CpuTimes(total=0, busy=0, own=0)
    # 2 CPUs for 100 ticks each; 150 ticks busy, 50 of them ours: others used one core.
    after = CpuTimes(total=200, busy=150, own=50)
    assert others_cores(before, after, n_cpus=2) == pytest.approx(1.0)
    # Our own time is never counted as others', even when the counters disagree slightly.
    assert others_cores(before, CpuTimes(total=200, busy=100, own=110), n_cpus=2) == 0.0
    assert others_cores(after, after, n_cpus=2) == 0.0  # no time passed


@pytest.mark.parametrize(
    ("n_cpus", "others", "free"),
    [
        (2, 0.0, 2),
        (2, 0.3, 2),
        (2, 0.6, 1),
        (2, 1.0, 1),
        (2, 1.9, 1),
        (2, 5.0, 1),
        (4, 0.4, 4),
        (4, 1.0, 3),
        (4, 2.7, 1),
        (4, 4.0, 1),
    ],
)
def test_a_core_counts_as_taken_once_others_use_more_than_half_of_it(
    n_cpus: int, others: float, free: int
) -> None:
    assert free_cores(n_cpus, others) == free


def test_the_monitor_keeps_the_busier_of_the_last_two_periods() -> None:
    monitor = CpuShareMonitor(n_cpus=2, read=lambda: CpuTimes(0, 0, 0))
    assert monitor.free_cores() == 2
    monitor.record(1.0)
    assert monitor.free_cores() == 1
    monitor.record(0.0)  # one quiet period is not enough to take the core back
    assert monitor.free_cores() == 1
    monitor.record(0.1)
    assert monitor.free_cores() == 2


def test_a_change_of_free_cores_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    monitor = CpuShareMonitor(n_cpus=2, read=lambda: CpuTimes(0, 0, 0))
    with caplog.at_level("DEBUG", logger="engine.core.cpu_share"):
        monitor.record(1.0)
        monitor.record(1.0)  # no change: no second line
    assert [r.getMessage() for r in caplog.records] == [
        "Other processes use 1.0 of 2 cores: synthesis runs on up to 1 thread(s)"
    ]


def test_the_monitor_samples_in_the_background() -> None:
    """Two readings 0.25 s apart in which others used one of two cores."""
    readings = iter([CpuTimes(0, 0, 0), CpuTimes(200, 160, 60)])
    last = CpuTimes(200, 160, 60)
    monitor = CpuShareMonitor(period_s=0.01, n_cpus=2, read=lambda: next(readings, last))
    assert monitor.start()
    for _ in range(500):
        if monitor.others > 0:
            break
        time.sleep(0.01)
    assert monitor.others == pytest.approx(1.0)
    assert monitor.free_cores() == 1


def test_without_proc_the_monitor_does_not_start() -> None:
    def unreadable() -> CpuTimes:
        raise OSError("no /proc here")

    assert not CpuShareMonitor(read=unreadable).start()


def test_the_thread_report_says_what_the_monitor_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.core import thread_budget

    monitor = CpuShareMonitor(n_cpus=2, read=lambda: CpuTimes(0, 0, 0))
    monitor.record(1.234)
    monkeypatch.setattr(thread_budget, "_configured", 2)
    monkeypatch.setattr(thread_budget, "_follow_free_cores", True)
    monkeypatch.setattr(thread_budget, "process_monitor", lambda: monitor)
    assert thread_budget.thread_report() == {
        "configured": 2,
        "other_processes_cores": 1.23,
        "free_cores": 1,
    }
    assert thread_budget.threads_now(None) == 1
    monkeypatch.setattr(thread_budget, "_follow_free_cores", False)
    assert thread_budget.thread_report()["free_cores"] is None
    assert thread_budget.threads_now(None) == 2
