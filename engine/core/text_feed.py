"""A sentence whose text is still arriving while it is spoken (an LLM's reply, streamed).

The caller (a server's event loop) calls :meth:`TextFeed.update` with the sentence so far and
:meth:`TextFeed.finish` with the whole sentence once it has ended; neither blocks for longer than
a lock. The engine reads it from its own thread with :meth:`TextFeed.wait`, which returns when
the text has grown, the sentence has ended, or a short poll has passed (so the reader can look
at its cancel event).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TextSoFar:
    """The sentence's text as last given, and whether it is the whole sentence."""

    text: str
    final: bool


class TextFeed:
    """One sentence's text, given as it grows (thread-safe)."""

    def __init__(self, text: str = "") -> None:
        self._now = TextSoFar(text, final=False)
        self._changed = threading.Condition()

    def update(self, text: str) -> None:
        """The sentence so far (it extends what was given before)."""
        with self._changed:
            if self._now.final:
                raise RuntimeError("text given after the sentence ended")
            if text != self._now.text:
                self._now = TextSoFar(text, final=False)
                self._changed.notify_all()

    def finish(self, text: str | None = None) -> None:
        """The whole sentence (None: what was given last)."""
        with self._changed:
            if not self._now.final:
                self._now = TextSoFar(self._now.text if text is None else text, final=True)
                self._changed.notify_all()

    @property
    def now(self) -> TextSoFar:
        return self._now

    def wait(self, seen: TextSoFar | None, timeout: float) -> TextSoFar:
        """The text once it differs from ``seen`` (None: at once), or after ``timeout`` s."""
        with self._changed:
            self._changed.wait_for(lambda: self._now != seen, timeout)
            return self._now
