"""The text ids of one sentence whose text arrives in pieces (an LLM's streamed reply).

:class:`GrowingTextIds` commits the sentence up to its last *safe cut* and returns the ids of
each newly committed piece, so that a :class:`~engine.cosyvoice2.lm.BistreamSession` can read
them before the sentence ends. A cut is safe when neither normalisation nor Qwen2's BPE joins
text across it (measured in docs/dev/cosyvoice2-bistream.md), so the pieces' ids put together are
the ids of the whole sentence:

* Chinese path: right before a clause mark (``，、；：。！？``, ``;!?``, and ``,`` followed by a
  non-digit) that follows a letter or digit. Pieces then start with their mark; Qwen2 attaches
  a mark to the letters after it, and a run of marks is one pre-token, so any other cut near a
  mark would change the tokens.
* English path: right before the space between two plain words (letters and apostrophes; the
  first may end in ``,;:``). The word after the cut must be complete, so the last word always
  waits.
* Both: never while a bracket, a markdown link or a ``<…>`` tag is open.

Each piece is normalised alone on the path of the sentence (decided at the first committed
piece) and tokenised, with one space put back in front when the piece began with one. The rest
comes from the whole sentence at :meth:`GrowingTextIds.finish`: its ids after the committed ones.
The joined ids are the normal path's whenever the committed ids begin the whole sentence's;
:attr:`GrowingTextIds.exact` turns False when they do not (the text was rewritten, or turned out
to need another path).
"""

from __future__ import annotations

import logging
import re
import unicodedata

from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
from engine.text.frontend import checked_text
from engine.text.normalize import contains_chinese, detect_language

_LOGGER = logging.getLogger(__name__)

_ZH_MARKS = frozenset("，、；：。！？")
# ASCII marks that never belong to a number ("." and ":" do: "21.5", "7:30"); "," is a cut
# only when a non-digit follows it ("1,000").
_ZH_ASCII_MARKS = frozenset(";!?")
_CLOSERS = {"(": ")", "[": "]", "{": "}", "<": ">", "（": "）", "【": "】", "《": "》"}
_WORD = re.compile(r"\S+")
_PLAIN_WORD = re.compile(r"(?:[^\W\d_]|['’])+")
_PLAIN_WORD_BEFORE_CUT = re.compile(r"(?:[^\W\d_]|['’])+[,;:]?")
_DIGIT = re.compile(r"\d")


def _is_letter_or_digit(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "LN"


class _Brackets:
    """Which brackets are open in the text scanned so far (a cut waits until they close)."""

    def __init__(self) -> None:
        self._expected: list[str] = []

    def scan(self, text: str) -> None:
        for ch in text:
            if ch in _CLOSERS:
                self._expected.append(_CLOSERS[ch])
            elif self._expected and ch == self._expected[-1]:
                self._expected.pop()

    @property
    def open(self) -> bool:
        return bool(self._expected)


def _chinese_cut(text: str, start: int) -> int | None:
    """The last safe cut after ``start`` on the Chinese path (``start``: a cut, or 0)."""
    brackets = _Brackets()
    last = None
    for i in range(start + 1, len(text)):
        brackets.scan(text[i - 1])
        if brackets.open or not _is_letter_or_digit(text[i - 1]):
            continue
        mark = text[i]
        if mark in _ZH_MARKS or mark in _ZH_ASCII_MARKS:
            last = i
        elif mark == "," and i + 1 < len(text) and not text[i + 1].isdigit():
            last = i
    return last


def _english_cut(text: str, start: int) -> int | None:
    """The last safe cut after ``start`` on the English path (``start``: a cut, or 0)."""
    brackets = _Brackets()
    last = None
    before: re.Match[str] | None = None
    for word in _WORD.finditer(text, start):
        if word.end() == len(text):
            break  # not known to be complete yet
        if before is not None:
            gap = text[before.end() : word.start()]
            if (
                not brackets.open
                and gap.strip(" ") == ""  # other spaces and newlines are rewritten
                and _PLAIN_WORD_BEFORE_CUT.fullmatch(before.group())
                and _PLAIN_WORD.fullmatch(word.group())
            ):
                last = before.end()
        brackets.scan(word.group())
        before = word
    return last


class GrowingTextIds:
    """Text ids of one sentence whose text arrives in pieces.

    One instance per sentence, used from one thread: :meth:`update` with the sentence so far as
    it grows, then :meth:`finish` with the whole sentence.
    """

    def __init__(self, frontend: CosyVoice2TextFrontend) -> None:
        self._frontend = frontend
        self._chinese: bool | None = None  # the path, fixed at the first committed piece
        self._committed_text = ""  # the raw text up to the last cut (leading space stripped)
        self._ids: list[int] = []
        self._finished = False
        self._exact = True

    @property
    def exact(self) -> bool:
        """False if :meth:`finish` could not make the joined ids the whole sentence's."""
        return self._exact

    def update(self, text: str) -> list[int]:
        """``text`` = the sentence so far (each call's text extends the previous one). Returns
        the ids newly safe to feed (possibly []): those up to the last safe cut."""
        text = self._sentence(text)
        if not text.startswith(self._committed_text):
            return []  # the text was rewritten: finish() sorts it out
        chinese = contains_chinese(text) if self._chinese is None else self._chinese
        if not chinese and contains_chinese(text):
            return []  # the whole sentence will take the Chinese path: nothing more is safe
        start = len(self._committed_text)
        cut = (_chinese_cut if chinese else _english_cut)(text, start)
        if cut is None or not self._same_wetext_language(text, text[start:cut], chinese):
            return []
        self._chinese = chinese
        ids = self._piece_ids(text[start:cut])
        self._committed_text = text[:cut]
        self._ids += ids
        return ids

    def finish(self, text: str) -> list[int]:
        """``text`` = the whole sentence (as the server's splitter released it). Returns the
        rest of the ids: all the returned lists joined are ``frontend.segments(text,
        split=False)[0].token_ids``, or [] when that is empty."""
        text = self._sentence(text)
        self._finished = True
        segments = self._frontend.segments(text, split=False)
        whole = segments[0].token_ids if segments else []
        committed = len(self._ids)
        if whole[:committed] == self._ids:
            rest = whole[committed:]
        else:
            self._exact = False
            rest = self._continuation(text, whole)
            _LOGGER.warning(
                "streamed sentence diverged after %d committed ids (%r, then %r); "
                "its ids differ from the whole sentence's",
                committed,
                self._committed_text[:80],
                text[:80],
            )
        self._ids += rest
        return rest

    def _sentence(self, text: str) -> str:
        if self._finished:
            raise RuntimeError("text given after finish()")
        # Normalisation strips the sentence, and the splitter releases it stripped.
        return checked_text(text, "text").lstrip()

    def _same_wetext_language(self, text: str, piece: str, chinese: bool) -> bool:
        """A piece with digits is read by the grammar of its own script: on the Chinese path,
        Japanese when it has kana. It must agree with the sentence so far."""
        if not chinese or not _DIGIT.search(piece):
            return True
        return (detect_language(piece) == "ja") == (detect_language(text) == "ja")

    def _piece_ids(self, piece: str) -> list[int]:
        """Ids of a piece normalised alone on the sentence's path."""
        normalized = self._frontend.piece_text(piece, chinese=self._chinese)
        if not normalized:
            return []
        # Qwen2 marks a word start by its space; normalising stripped it.
        space = " " if piece[:1].isspace() and self._ids else ""
        return self._frontend.tokenizer.encode(space + normalized)

    def _continuation(self, text: str, whole: list[int]) -> list[int]:
        """The best rest after committed ids that are not the whole sentence's start."""
        if text.startswith(self._committed_text):
            return self._piece_ids(text[len(self._committed_text) :])
        if self._committed_text.startswith(text):
            return []  # all of it was committed already
        return whole[len(self._ids) :]
