"""How many torch threads a synthesis may use, asked again before each LM token and flow step.

Two things set it. The caller's budget: one that runs several syntheses side by side (the
server's ``parallel_sentences``) gives a sentence running alone every core and sentences side by
side one each; without a budget, the process's configured count (``configure_threads``). And the
cores other processes leave free (engine.cpu_share): never more threads than that, because a
multi-thread OpenMP team sharing its cores with a busy neighbour waits on its descheduled member
at every operation. Asking between steps, not only between audio chunks, matters at a change: a
first chunk takes seconds.

torch's thread count belongs to each thread (a new thread starts from the last count set
anywhere in the process), so the budget is applied in whichever thread does the work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.cpu_share import process_monitor

ThreadBudget = Callable[[], int]

_configured: int | None = None
_follow_free_cores = True


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


def threads_now(budget: ThreadBudget | None) -> int:
    """``budget()`` (None: the configured count), capped to the cores free right now.

    Never more than the configured count either: that one is already capped to what this CPU's
    libraries survive (engine.cpu).
    """
    wanted = configured_threads()
    if budget is not None:
        wanted = min(wanted, budget())
    monitor = process_monitor() if _follow_free_cores else None
    if monitor is not None:
        wanted = min(wanted, monitor.free_cores())
    return max(1, wanted)


def apply_thread_budget(budget: ThreadBudget | None) -> None:
    """Set this thread's torch thread count to ``threads_now(budget)``."""
    threads = threads_now(budget)
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
