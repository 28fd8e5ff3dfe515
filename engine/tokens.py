"""Run the LM's token generator in its own thread so flow + HiFT can work on earlier tokens.

The LM is memory-bandwidth bound and the flow/HiFT are compute bound, so on two cores the two
stages overlap well: while the vocoder turns chunk *k* into audio, the LM is already sampling the
tokens of chunk *k + 1*.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import torch

from engine.types import SynthesisCancelled

_LOGGER = logging.getLogger(__name__)
_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class ThreadedTokens:
    """Iterate over tokens produced by ``make_tokens()`` in a background thread."""

    def __init__(self, make_tokens: Callable[[], Iterator[int]],
                 cancel: threading.Event | None = None) -> None:
        self._make_tokens = make_tokens
        self._cancel = cancel or threading.Event()
        self._stop = threading.Event()
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._produce, name="cosyvoice-lm", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        try:
            with torch.inference_mode():
                for token in self._make_tokens():
                    if self._stop.is_set() or self._cancel.is_set():
                        break
                    self._queue.put(token)
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

    def close(self) -> None:
        """Stop the producer (at its next token) and wait for it."""
        self._stop.set()
        self._thread.join(timeout=30)
        if self._thread.is_alive():
            _LOGGER.warning("LM thread did not stop within 30 s")
