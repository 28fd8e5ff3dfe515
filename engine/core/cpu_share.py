"""How many of this process's cores other processes are using right now.

A Home Assistant box is never quiet: Home Assistant itself, speech-to-text, other add-ons or a
local LLM still writing the answer we are reading aloud. An OpenMP team of N threads is only
fast when all N run at once: each parallel operation waits at a barrier for its slowest member,
and a member that shares its core with a busy neighbour is descheduled for whole scheduler
slices. With one busy neighbour on a 2-core machine, a 2-thread team ran 6–10x slower than one
thread. So the engine asks, before each LM token and flow step, how many cores are free and runs
no more threads than that (engine.core.thread_budget).

What others use is measured, not guessed from the load average: a background thread samples
``/proc/stat`` (the busy time of the CPUs this process may run on, steal time included) and
``/proc/self/stat`` (this process's own CPU time) every ``period_s``, and the difference over the
last two periods is what other processes (or the hypervisor) took. Where ``/proc`` is missing the
monitor reports nothing busy, i.e. the configured threads are used as they are.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_LOGGER = logging.getLogger(__name__)

PERIOD_S = 0.25
# A core counts as taken once others use more than half of it: a thread sharing a core with a
# neighbour that wants it half the time already stalls its whole team.
TAKEN_FRACTION = 0.5


@dataclass(frozen=True)
class CpuTimes:
    """Cumulative clock ticks: all of our CPUs' time, their busy part, and our own part."""

    total: int
    busy: int
    own: int


def _allowed_cpus() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def read_cpu_times(stat_text: str, self_stat_text: str, cpus: set[int]) -> CpuTimes:
    """Sum the ``cpuN`` lines of ``/proc/stat`` for ``cpus``, and this process's utime + stime.

    Busy is everything but idle and iowait (user, nice, system, irq, softirq and steal; guest
    time is already inside user).
    """
    total = busy = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(value) for value in rest.split()[:8]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        total += sum(fields)
        busy += sum(fields) - idle
    # /proc/self/stat: the command name may hold spaces, so split after its closing ')'.
    after_name = self_stat_text.rsplit(")", 1)[1].split()
    own = int(after_name[11]) + int(after_name[12])  # fields 14 and 15: utime, stime
    return CpuTimes(total=total, busy=busy, own=own)


def others_cores(before: CpuTimes, after: CpuTimes, n_cpus: int) -> float:
    """Cores' worth of time that other processes used between two readings."""
    elapsed = (after.total - before.total) / max(1, n_cpus)  # ticks per CPU
    if elapsed <= 0:
        return 0.0
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / elapsed)


def free_cores(n_cpus: int, others: float) -> int:
    """Whole cores left for us when others use ``others`` cores (at least one)."""
    return max(1, min(n_cpus, int(n_cpus - others + (1 - TAKEN_FRACTION))))


class CpuShareMonitor:
    """Samples the CPU time of the cores we may use; ``free_cores()`` is the latest estimate."""

    def __init__(
        self,
        period_s: float = PERIOD_S,
        read: Callable[[], CpuTimes] | None = None,
        n_cpus: int | None = None,
    ) -> None:
        cpus = _allowed_cpus()
        self.n_cpus = n_cpus or len(cpus)
        self._read = read or (
            lambda: read_cpu_times(
                Path("/proc/stat").read_text(), Path("/proc/self/stat").read_text(), cpus
            )
        )
        self._period_s = period_s
        self._others = [0.0, 0.0]  # the last two periods: a short dip does not add a thread
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Start sampling (once); False where the CPU times cannot be read."""
        with self._lock:
            if self._thread is not None:
                return True
            try:
                first = self._read()
            except (OSError, ValueError, IndexError) as err:
                _LOGGER.debug("CPU share not measured: %s", err)
                return False
            self._thread = threading.Thread(
                target=self._run, args=(first,), name="cosyvoice-cpu-share", daemon=True
            )
            self._thread.start()
            return True

    def _run(self, previous: CpuTimes) -> None:
        while True:
            time.sleep(self._period_s)
            try:
                current = self._read()
            except (OSError, ValueError, IndexError):
                continue
            self.record(others_cores(previous, current, self.n_cpus))
            previous = current

    def record(self, others: float) -> None:
        """Take one period's measurement (the sampling thread calls this)."""
        before = self.free_cores()
        self._others = [self._others[1], others]
        if (after := self.free_cores()) != before:  # DEBUG: a flapping neighbour would flood INFO
            _LOGGER.debug(
                "Other processes use %.1f of %d cores: synthesis runs on up to %d thread(s)",
                self.others,
                self.n_cpus,
                after,
            )

    @property
    def others(self) -> float:
        """Cores' worth of time others used: the busier of the last two periods."""
        return max(self._others)

    def free_cores(self) -> int:
        return free_cores(self.n_cpus, self.others)


_MONITOR: CpuShareMonitor | None = None
_MONITOR_TRIED = False
_MONITOR_LOCK = threading.Lock()


def process_monitor() -> CpuShareMonitor | None:
    """The process's running monitor, started on first use (None where /proc cannot be read)."""
    global _MONITOR, _MONITOR_TRIED
    with _MONITOR_LOCK:
        if not _MONITOR_TRIED:
            _MONITOR_TRIED = True
            monitor = CpuShareMonitor()
            _MONITOR = monitor if monitor.start() else None
        return _MONITOR
