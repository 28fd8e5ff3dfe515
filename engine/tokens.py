"""Run the LM's token generator in its own thread so flow + HiFT can work on earlier tokens.

The LM is memory-bandwidth bound and the flow/HiFT are compute bound, so on two cores the two
stages overlap well: while the vocoder turns chunk *k* into audio, the LM is already sampling the
tokens of chunk *k + 1*.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from collections.abc import Callable, Iterator

import torch

from engine.types import SynthesisCancelled

_LOGGER = logging.getLogger(__name__)
_END = object()
# The LM thread runs at a lower CPU priority: when both stages want the cores, the vocoder,
# which turns already-generated tokens into the audio the listener is waiting for, goes first;
# the LM uses whatever the vocoder leaves. Threads its OpenMP pool spawns inherit the value.
LM_NICE = 10


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LM_NICE)
    except (AttributeError, OSError):  # not Linux, or not permitted: keep the default
        pass


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class ThreadedTokens:
    """Iterate over tokens produced by ``make_tokens()`` in a background thread."""

    def __init__(self, make_tokens: Callable[[], Iterator[int]],
                 cancel: threading.Event | None = None, *,
                 pause_after: int | None = None) -> None:
        """``pause_after``: stop after that many tokens until :meth:`resume` is called."""
        self._make_tokens = make_tokens
        self._cancel = cancel or threading.Event()
        self._stop = threading.Event()
        self._pause_after = pause_after
        self._resumed = threading.Event()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._produce, name="cosyvoice-lm", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        _lower_priority()
        try:
            with torch.inference_mode():
                for count, token in enumerate(self._make_tokens(), start=1):
                    if self._stop.is_set() or self._cancel.is_set():
                        break
                    self._queue.put(token)
                    if count == self._pause_after:
                        self._wait_for_resume()
        except BaseException as err:  # handed to the consumer, which re-raises it
            self._queue.put(_Failure(err))
        finally:
            self._queue.put(_END)

    def __iter__(self) -> Iterator[int]:
        while True:
            item = self._queue.get()
            if self._cancel.is_set():
                raise SynthesisCancelled("synthesis cancelled")
            if item is _END:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item  # type: ignore[misc]

    def _wait_for_resume(self) -> None:
        while not self._resumed.wait(0.05):
            if self._stop.is_set() or self._cancel.is_set():
                return

    def resume(self) -> None:
        """Let a paused producer go on (no-op otherwise)."""
        self._resumed.set()

    def close(self) -> None:
        """Stop the producer (at its next token) and wait for it."""
        self._stop.set()
        self._resumed.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            _LOGGER.warning("LM thread did not stop within 30 s")
