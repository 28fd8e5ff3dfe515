"""How many torch threads a synthesis may use, asked again before each LM token and flow step.

A caller that runs several syntheses side by side (the server's ``parallel_sentences``) gives
a sentence running alone every core and sentences side by side one each. Asking between
steps, not only between audio chunks, matters at a change: a first chunk takes seconds, and a
multi-thread OpenMP team sharing the cores with another sentence's thread waits on its
preempted member at every operation.

torch's thread count belongs to each thread (a new thread starts from the last count set
anywhere in the process), so the budget is applied in whichever thread does the work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ThreadBudget = Callable[[], int]


def apply_thread_budget(budget: ThreadBudget | None) -> None:
    """Set this thread's torch thread count to ``budget()`` (None: leave it)."""
    if budget is None:
        return
    threads = budget()
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
