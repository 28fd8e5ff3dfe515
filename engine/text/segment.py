"""Sentence splitting.

Two splitters live here:

* ``split_paragraph`` — the official whole-text split of normalised text into synthesis
  segments: cut after sentence punctuation, greedily merge up to 80 units (characters for
  zh, BPE tokens for en), merge a short tail into the previous segment.
* ``IncrementalSplitter`` / ``split_sentences`` — for *raw* text streamed from an LLM. A
  sentence is emitted as soon as it is complete. Every decision looks only at a bounded
  window after the cut, and the splitter waits until that window has arrived, so feeding a
  text in any fragments yields exactly ``split_sentences(text)``.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from engine.text.rules import is_speakable

# --- official whole-text split ---------------------------------------------------------------

ZH_STOPS = frozenset("。？！；：、.?!;")
EN_STOPS = frozenset(".?!;:")
_CLOSING_QUOTES = frozenset('"”')


def split_paragraph(
    text: str,
    token_len: Callable[[str], int],
    lang: str,
    token_max_n: int = 80,
    token_min_n: int = 60,
    merge_len: int = 20,
    comma_split: bool = False,
) -> list[str]:
    """Cut ``text`` into segments of at most ~``token_max_n`` units (official algorithm)."""
    if not text:
        return []
    is_zh = lang == "zh"
    stops = set(ZH_STOPS if is_zh else EN_STOPS)
    if comma_split:
        stops |= {"，", ","}

    def measure(s: str) -> int:
        return len(s) if is_zh else token_len(s)

    if text[-1] not in stops:
        text += "。" if is_zh else "."
    sentences: list[str] = []
    start = 0
    i = 0
    while i < len(text):
        if text[i] in stops:
            end = i + 1
            if end < len(text) and text[end] in _CLOSING_QUOTES:
                end += 1
            if text[start:i]:
                sentences.append(text[start:end])
            elif sentences:  # a punctuation run: keep it with the sentence it ends
                sentences[-1] += text[start:end]
            start = i = end
        else:
            i += 1

    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if measure(current + sentence) > token_max_n and measure(current) > token_min_n:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if measure(current) < merge_len and segments:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


# --- streaming sentence splitter -------------------------------------------------------------

ZH_TERMINATORS = frozenset("。！？；…")
EN_TERMINATORS = frozenset(".!?")
_ALL_TERMINATORS = ZH_TERMINATORS | EN_TERMINATORS
_TRAILERS = frozenset("\"'”’)）」』》】]")
_OPENERS = frozenset("\"'“‘(（「『《【[")
CUT_AFTER_COMMA = frozenset("，,、；;：:")
_ABBREVIATIONS = frozenset(
    "mr mrs ms dr prof sr jr st mt vs etc e.g i.e approx dept fig no est inc ltd co "
    "jan feb mar apr jun jul aug sep sept oct nov dec u.s u.k a.m p.m".split()
)
_WORD_BEFORE = re.compile(r"([A-Za-z](?:[A-Za-z.]*[A-Za-z])?)$")
DEFAULT_MAX_CHARS = 120


def _is_cjk(ch: str) -> bool:
    return "\u3040" <= ch <= "\u9fff" or "\uac00" <= ch <= "\ud7af" or "\uff00" <= ch <= "\uffef"


def _new_sentence_start(ch: str) -> bool:
    return ch.isupper() or ch.isdigit() or _is_cjk(ch) or ch in _OPENERS


def _abbreviation_before(text: str, dot: int) -> bool:
    m = _WORD_BEFORE.search(text, 0, dot)
    if not m:
        return False
    word = m.group(1)
    # Single letters ("J. Smith", the "S" of "U.S.") are initials, not sentence ends.
    return len(word) == 1 or word.lower() in _ABBREVIATIONS


class _Undecided(Exception):
    """The decision needs characters that have not arrived yet."""


def _boundary_at(text: str, i: int, final: bool) -> int | None:
    """If a sentence ends with the terminator at ``text[i]``, the cut index after it."""

    def char(j: int) -> str:
        if j < len(text):
            return text[j]
        if final:
            return ""
        raise _Undecided

    ch = text[i]
    if ch == "\n":
        return i + 1
    if ch not in ZH_TERMINATORS and ch not in EN_TERMINATORS:
        return None
    j = i + 1
    while char(j) and (char(j) in _ALL_TERMINATORS or char(j) in _TRAILERS):
        j += 1
    if ch in ZH_TERMINATORS:
        return j
    nxt = char(j)
    if not nxt:
        return j
    if ch == "." and _abbreviation_before(text, i):
        return None
    if _is_cjk(nxt) and not text[i - 1 : i].isdigit():
        return j  # half-width punctuation inside Chinese text
    if not nxt.isspace():
        return None
    k = j
    while char(k).isspace():
        if char(k) == "\n":
            return j
        k += 1
    after = char(k)
    return j if not after or _new_sentence_start(after) else None


def _next_cut(text: str, max_chars: int, final: bool) -> int | None:
    """Cut index ending the first sentence of ``text``, or None if not known yet."""
    limit = min(len(text), max_chars)
    try:
        for i in range(limit):
            cut = _boundary_at(text, i, final)
            if cut is not None and cut <= max_chars:
                return cut
            if cut is not None:
                break  # the sentence would be too long: fall through to the soft cut
    except _Undecided:
        return None
    if len(text) <= max_chars:
        return len(text) if final and text else None
    window = text[:max_chars]
    for marks in (CUT_AFTER_COMMA, frozenset(" ")):
        best = max((p for p, c in enumerate(window) if c in marks and p > 0), default=-1)
        if best > 0:
            return best + 1
    return max_chars


def _clean(sentence: str) -> str | None:
    sentence = sentence.strip()
    return sentence if sentence and is_speakable(sentence) else None


class IncrementalSplitter:
    """Turn streamed text fragments into complete sentences as early as possible.

    Sentences end at ``。！？；…``, at ``.!?`` followed by whitespace and a new sentence
    start (not after ``Mr.``, ``U.S.``, initials, or inside ``3.5``), at half-width
    ``.!?`` directly followed by CJK, and at newlines. A sentence longer than ``max_chars``
    is cut after its last comma (or space) within the limit, else at the limit.
    Pieces without letters or digits (``...``, emoji) are dropped.
    """

    def __init__(self, max_chars: int = DEFAULT_MAX_CHARS) -> None:
        if max_chars < 2:
            raise ValueError("max_chars must be at least 2")
        self.max_chars = max_chars
        self._buffer = ""

    def _drain(self, final: bool) -> list[str]:
        out: list[str] = []
        while self._buffer:
            cut = _next_cut(self._buffer, self.max_chars, final)
            if cut is None:
                break
            sentence, self._buffer = self._buffer[:cut], self._buffer[cut:]
            cleaned = _clean(sentence)
            if cleaned:
                out.append(cleaned)
        return out

    def feed(self, fragment: str) -> list[str]:
        """Add text; return the sentences it completed."""
        self._buffer += fragment
        return self._drain(final=False)

    @property
    def pending(self) -> str:
        """The text fed but not yet released: the start of the sentence in progress."""
        return self._buffer

    def flush(self) -> list[str]:
        """End of stream: return everything still buffered."""
        out = self._drain(final=True)
        self._buffer = ""
        return out


def split_sentences(text: str, max_chars: int = DEFAULT_MAX_CHARS) -> list[str]:
    """Whole-text equivalent of feeding ``text`` to an ``IncrementalSplitter``."""
    splitter = IncrementalSplitter(max_chars)
    splitter._buffer = text
    return splitter.flush()
