"""Speech tokens from the LM: the first ones in the consumer's thread, the rest in the
consumer's thread too (taking turns with the vocoder) or in a thread beside it.

On a few cores the LM takes turns with the vocoder: the consumer asks for tokens when the next
chunk needs them, and each part runs with every thread while the other waits
(engine.core.thread_budget.lm_takes_turns says why). On more cores, once audio is flowing, a
background LM thread samples the tokens of chunk *k + 1* while the vocoder turns chunk *k* into
audio.

Until the first chunk is out a background thread does not pay on any machine: the first chunk's
tokens are all needed before anything can be vocoded, and a non-streaming request needs every
token first. A second thread there only costs: each thread drives its own OpenMP team, and with
more OpenMP threads than cores libgomp cuts its spin-wait short, so every parallel op wakes a
sleeping worker (on a 2-core machine an int8 LM step took 26–28 ms with one team and 33–40 ms
with two). So the first ``inline`` tokens are generated in the consumer's thread, and a
background thread takes the same generator over only when the consumer asks for the next token,
i.e. after the first chunk has been vocoded.

Before each token the producing thread applies the caller's thread budget
(engine.core.thread_budget: the configured count without one, never more than the cores other
processes leave free, and one thread while the vocoder beside it computes). It runs at normal
priority: a lowered one let the vocoder go first on a quiet machine, but on a shared one it also
put the LM behind every other process, and a streamed answer took twice as long to finish. torch's
thread count belongs to each thread, and a new thread starts from the last count set anywhere in
the process.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import torch

from engine.core.stage_times import StageListener, report
from engine.core.thread_budget import (
    ThreadBudget,
    apply_thread_budget,
    lm_beside_vocoder,
    lm_takes_turns,
)
from engine.core.types import SynthesisCancelled

_LOGGER = logging.getLogger(__name__)
_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class LmTokens:
    """Iterate over the tokens of ``make_tokens()``.

    ``inline``: how many tokens to generate in the consumer's thread before a background thread
    may take over (it does only on machines where the LM and the vocoder do not take turns);
    ``None`` generates all of them inline (no thread at all). ``threads``: the
    caller's thread budget, applied before each token. ``on_stage``: told what the inline
    tokens cost (engine.core.stage_times: the way to the first token, then the rest per token),
    named with the LM's format ``weights``.
    """

    def __init__(
        self,
        make_tokens: Callable[[], Iterator[int]],
        cancel: threading.Event | None = None,
        *,
        inline: int | None,
        threads: ThreadBudget | None = None,
        on_stage: StageListener | None = None,
        weights: str = "",
    ) -> None:
        self._make_tokens = make_tokens
        self._weights = weights  # the LM's format, for its stage times
        self._cancel = cancel or threading.Event()
        self._inline = inline
        self._budget = threads
        self._on_stage = on_stage
        self._stop = threading.Event()
        self._source: Iterator[int] | None = None
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def __iter__(self) -> Iterator[int]:
        self._source = source = self._make_tokens()
        count = 0
        sampling = 0.0  # seconds inside the LM for the tokens after the first
        while self._inline is None or count < self._inline:
            apply_thread_budget(self._budget)
            start = time.perf_counter()
            token = next(source, None)
            seconds = time.perf_counter() - start
            if token is None:
                report(self._on_stage, "lm_token", self._weights, sampling, count - 1)
                return
            self._check_cancel()
            count += 1
            if count == 1:  # the generator's first step encodes the text and the prompt
                report(self._on_stage, "lm_prefill", self._weights, seconds, 1)
            else:
                sampling += seconds
            yield token
        report(self._on_stage, "lm_token", self._weights, sampling, count - 1)
        if lm_takes_turns(self._budget):
            yield from self._in_turns(source)
            return
        # The consumer wants more: the first chunk is out, so overlapping now pays.
        self._thread = threading.Thread(
            target=self._produce, args=(source,), name="cosyvoice-lm", daemon=True
        )
        self._thread.start()
        while True:
            item = self._queue.get()
            self._check_cancel()
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item  # type: ignore[misc]

    def _in_turns(self, source: Iterator[int]) -> Iterator[int]:
        """The rest of the tokens in the consumer's thread, when it asks for them."""
        while True:
            apply_thread_budget(self._budget)
            token = next(source, None)
            if token is None:
                return
            self._check_cancel()
            yield token

    def _check_cancel(self) -> None:
        if self._cancel.is_set():
            raise SynthesisCancelled("synthesis cancelled")

    def _produce(self, source: Iterator[int]) -> None:
        try:
            with torch.inference_mode(), lm_beside_vocoder():
                while True:
                    apply_thread_budget(self._budget, beside_vocoder=True)
                    token = next(source, None)
                    if token is None or self._stop.is_set() or self._cancel.is_set():
                        break
                    self._queue.put(token)
        except BaseException as err:  # handed to the consumer, which re-raises it
            self._queue.put(_Failure(err))
        finally:
            self._queue.put(_END)

    def close(self) -> None:
        """Stop the LM (at its next token), wait for its thread and free its generator."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                _LOGGER.warning("LM thread did not stop within 30 s")
                return  # the thread still owns the generator: closing it here would race
        close = getattr(self._source, "close", None)
        if close is not None:
            close()
