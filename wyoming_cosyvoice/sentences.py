"""Incremental sentence splitting for streamed text (``synthesize-chunk`` fragments).

The text frontend's ``engine.text.segment.IncrementalSplitter`` is used when it is available;
until then (or if it fails to import) a small regex splitter with the same ``feed``/``flush``
interface stands in, so the server works on its own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
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


MAX_CHARS = 120  # like the frontend's splitter: bounds the audio of one sentence


class SimpleSplitter:
    """Release each sentence as soon as its end is certain; ``flush`` returns the rest.

    A sentence longer than ``max_chars`` is cut at its last comma or space within the limit.
    """

    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self._buffer = ""
        self.max_chars = max_chars

    def _cut_long(self) -> list[str]:
        out = []
        while len(self._buffer) > self.max_chars:
            head = self._buffer[: self.max_chars]
            comma = max(head.rfind(c) for c in ",，、;；")
            cut = (comma if comma > 0 else head.rfind(" ")) + 1 or self.max_chars
            piece, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:]
            if piece:
                out.append(piece)
        return out

    def feed(self, fragment: str) -> list[str]:
        self._buffer += fragment
        sentences: list[str] = []
        start = 0
        for match in _BOUNDARY.finditer(self._buffer):
            sentence = self._buffer[start : match.end()].strip()
            if sentence:
                sentences.extend(SimpleSplitter(self.max_chars).feed_whole(sentence))
            start = match.end()
        self._buffer = self._buffer[start:]
        return sentences + self._cut_long()

    def feed_whole(self, sentence: str) -> list[str]:
        """A complete sentence, cut to ``max_chars`` pieces."""
        self._buffer = sentence
        pieces = self._cut_long()
        rest, self._buffer = self._buffer.strip(), ""
        return [*pieces, rest] if rest else pieces

    def flush(self) -> list[str]:
        pieces = self._cut_long()
        rest, self._buffer = self._buffer.strip(), ""
        return [*pieces, rest] if rest else pieces


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


def _load_frontend_detect() -> Callable[[str], str] | None:
    try:
        from engine.text.normalize import detect_language
    except ImportError:  # the server also runs without the text frontend
        return None
    return detect_language


_frontend_detect = _load_frontend_detect()


def detect_language(text: str) -> str:
    """The frontend's guess (zh, en, ja, ko, yue) if available, else one from the script."""
    if _frontend_detect is not None:
        try:
            return str(_frontend_detect(text))
        except Exception:  # a guess only
            _LOGGER.debug("detect_language failed", exc_info=True)
    if re.search(r"[\u3040-\u30ff]", text):
        return "ja"
    if re.search(r"[\uac00-\ud7af]", text):
        return "ko"
    if re.search(r"[\u4e00-\u9fff]", text):
        return "zh"
    return "en"


def has_speech(sentence: str) -> bool:
    """False for pure punctuation/whitespace, which has nothing to say."""
    return any(ch.isalnum() for ch in sentence)
