"""How many torch threads a synthesis may use, asked again before each LM token and flow step.

Three things set it. The caller's budget: one that runs several syntheses side by side (the
server's ``parallel_sentences``) gives a sentence running alone every core and sentences side by
side one each; without a budget, the process's configured count (``configure_threads``). And the
cores other processes leave free (engine.core.cpu_share): never more threads than that, because a
multi-thread OpenMP team sharing its cores with a busy neighbour waits on its descheduled member
at every operation. And one OpenMP team at a time inside this process.

On up to ``TURNS_UP_TO_THREADS`` threads the LM and the vocoder take turns in one thread, each
with every thread (``lm_takes_turns``). Beyond, once the first chunk is out, the LM runs in a
thread beside the vocoder (engine.core.lm_thread), and two teams of N threads on N cores wait on
each other's descheduled members the same way: while the vocoder computes a chunk, the LM thread
beside it runs one thread and the vocoder the rest; while the vocoder waits for tokens, the LM
takes every free core. Asking between steps, not only between audio chunks, matters at a change:
a first chunk takes seconds.

torch's thread count belongs to each thread (a new thread starts from the last count set
anywhere in the process), so the budget is applied in whichever thread does the work.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from engine.core.cpu_share import process_monitor

ThreadBudget = Callable[[], int]

# The LM reads all its weights from memory for every token. Beside it on two cores a chunk's
# flow and HiFT took several times as long as alone (one thread instead of two, and the memory
# bus shared), and the LM's own OpenMP team slowed it too: the answer finished no sooner and its
# early chunks came late. Taking turns, each with every thread, the answer finished sooner and
# paused far less (docs/dev/performance-notes.md, "The LM beside the vocoder"). A four-core
# board shares a slower memory bus; beyond four threads taking turns is not measured.
TURNS_UP_TO_THREADS = 4

_configured: int | None = None
_follow_free_cores = True
_stage_lock = threading.Lock()
_lm_threads_beside = 0  # LM threads producing tokens beside a vocoder
_vocoders_busy = 0  # vocoders computing a chunk


def configure_threads(threads: int | None = None, *, follow_free_cores: bool = True) -> None:
    """Set the process's thread count (None: torch's current one) and whether it shrinks to the
    cores other processes leave free."""
    global _configured, _follow_free_cores
    if threads:
        torch.set_num_threads(threads)
    _configured = torch.get_num_threads()
    _follow_free_cores = follow_free_cores
    if follow_free_cores:
        process_monitor()  # sampling from now on: the first request finds a measurement


def configured_threads() -> int:
    """The count set by ``configure_threads`` (torch's first count if it was never called)."""
    global _configured
    if _configured is None:
        _configured = torch.get_num_threads()
    return _configured


@contextlib.contextmanager
def lm_beside_vocoder() -> Iterator[None]:
    """Marks this thread as an LM thread running beside a vocoder (for ``threads_now``)."""
    global _lm_threads_beside
    with _stage_lock:
        _lm_threads_beside += 1
    try:
        yield
    finally:
        with _stage_lock:
            _lm_threads_beside -= 1


@contextlib.contextmanager
def vocoder_busy() -> Iterator[None]:
    """Marks a vocoder computing a chunk (for ``threads_now``)."""
    global _vocoders_busy
    with _stage_lock:
        _vocoders_busy += 1
    try:
        yield
    finally:
        with _stage_lock:
            _vocoders_busy -= 1


def threads_now(budget: ThreadBudget | None, *, beside_vocoder: bool = False) -> int:
    """``budget()`` (None: the configured count), capped to the cores free right now, and
    shared between an LM thread beside the vocoder and the vocoder.

    Never more than the configured count either: that one is already capped to what this CPU's
    libraries survive (engine.core.cpu).
    """
    wanted = configured_threads()
    if budget is not None:
        wanted = min(wanted, budget())
    monitor = process_monitor() if _follow_free_cores else None
    if monitor is not None:
        wanted = min(wanted, monitor.free_cores())
    if beside_vocoder:
        return 1 if _vocoders_busy else max(1, wanted)
    return max(1, wanted - _lm_threads_beside)


def lm_takes_turns(budget: ThreadBudget | None) -> bool:
    """Whether a streamed answer's LM, once its first chunk is out, should take turns with the
    vocoder in the consumer's thread (True) rather than decode beside it in a thread of its own."""
    return threads_now(budget) <= TURNS_UP_TO_THREADS


def thread_report() -> dict[str, float | int | None]:
    """What decides the thread counts now: the configured count, the cores other processes use
    and the cores left free (None where they are not measured)."""
    monitor = process_monitor() if _follow_free_cores else None
    return {
        "configured": configured_threads(),
        "other_processes_cores": None if monitor is None else round(monitor.others, 2),
        "free_cores": None if monitor is None else monitor.free_cores(),
    }


def apply_thread_budget(budget: ThreadBudget | None, *, beside_vocoder: bool = False) -> None:
    """Set this thread's torch thread count to ``threads_now(budget, ...)``."""
    threads = threads_now(budget, beside_vocoder=beside_vocoder)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
