"""Incremental sentence splitting for streamed text (``synthesize-chunk`` fragments).

The text frontend's ``engine.text.segment.IncrementalSplitter`` is used when it is available;
until then (or if it fails to import) a small regex splitter with the same ``feed``/``flush``
interface stands in, so the server works on its own.
"""

from __future__ import annotations

import logging
import re
from typing import Protocol

_LOGGER = logging.getLogger(__name__)

# A Latin ender only counts once whitespace follows (so "3.5" and "e.g." mid-token stay whole);
# CJK enders split at once. Closing quotes/brackets stay with their sentence.
_BOUNDARY = re.compile(
    r"""(?:[.!?…]+["'”’)\]]*\s+)|(?:[。！？；]+[”’」』）》】"']*\s*)|(?:\n\s*\n)"""
)


class Splitter(Protocol):
    def feed(self, fragment: str) -> list[str]: ...

    def flush(self) -> list[str]: ...


class SimpleSplitter:
    """Release each sentence as soon as its end is certain; ``flush`` returns the rest."""

    def __init__(self) -> None:
        self._buffer = ""

    def feed(self, fragment: str) -> list[str]:
        self._buffer += fragment
        sentences: list[str] = []
        start = 0
        for match in _BOUNDARY.finditer(self._buffer):
            sentence = self._buffer[start : match.end()].strip()
            if sentence:
                sentences.append(sentence)
            start = match.end()
        self._buffer = self._buffer[start:]
        return sentences

    def flush(self) -> list[str]:
        rest, self._buffer = self._buffer.strip(), ""
        return [rest] if rest else []


def make_splitter() -> Splitter:
    """The frontend's splitter if importable, else :class:`SimpleSplitter`."""
    try:
        from engine.text.segment import IncrementalSplitter
    except ImportError:
        return SimpleSplitter()
    return IncrementalSplitter()


def split_all(text: str, splitter: Splitter | None = None) -> list[str]:
    """Split a complete text into sentences."""
    splitter = splitter or make_splitter()
    return [*splitter.feed(text), *splitter.flush()]


def has_speech(sentence: str) -> bool:
    """False for pure punctuation/whitespace, which has nothing to say."""
    return any(ch.isalnum() for ch in sentence)
