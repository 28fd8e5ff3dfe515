"""wetext 0.1.8 behind a lazy, thread-safe, failure-proof facade.

* wetext 0.1.8 ships its FST grammars inside the wheel and loads them from there with
  ``importlib.resources`` when ``wetext.constants`` is imported (~0.7 s, once per process).
  It never touches the network (0.0.4, which CosyVoice pins, downloaded from ModelScope).
* kaldifst's normaliser objects are shared module globals; we serialise calls with a lock
  because the server normalises from worker threads.
* The FSTs get slow super-linearly on long inputs (10k chars: seconds), so long texts are
  normalised sentence by sentence.
* Any exception inside wetext/kaldifst (e.g. an AssertionError on some phone-number layouts)
  falls back to normalising word by word, and finally to the text unchanged.
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Any

_LOGGER = logging.getLogger(__name__)

# Above this many characters, normalise piece by piece (pieces end at sentence punctuation).
CHUNK_CHARS = 256
_PIECE_END = re.compile(r"(?<=[。！？；!?;\n])|(?<=[.,，、])(?=\s)")

_CJK = re.compile("[\u4e00-\u9fff]")
_DIGIT = re.compile(r"\d")
_CLAUSE_END = re.compile(r"(?<=[，。！？；、\n])")

_NORMALIZER: Any = None
_LOAD_LOCK = threading.Lock()
_CALL_LOCK = threading.Lock()


def _normalizer() -> Any:
    global _NORMALIZER
    if _NORMALIZER is None:
        with _LOAD_LOCK:
            if _NORMALIZER is None:
                _LOGGER.debug("Loading wetext grammars (bundled FSTs)")
                from wetext import Normalizer  # lazy: importing loads every FST

                _NORMALIZER = Normalizer()  # lang='auto' like the official frontend
    return _NORMALIZER


def warm_up() -> None:
    """Load the grammars now (e.g. at server start) instead of on the first request."""
    _normalizer()


def _call(text: str, lang: str) -> str:
    normalizer = _normalizer()
    with _CALL_LOCK:
        return normalizer.normalize(text, lang=lang)


def _safe(text: str, lang: str) -> str:
    """wetext on one piece; on failure retry word by word so one odd token cannot
    leave a whole sentence's numbers unspoken."""
    if not text.strip():
        return text
    try:
        return _call(text, lang)
    except Exception as err:  # a library failure must never reach the user
        _LOGGER.warning(
            "wetext failed on %r (%s: %s); retrying word by word",
            text[:80],
            type(err).__name__,
            err,
        )
    out = []
    for word in text.split(" "):
        try:
            out.append(_call(word, lang) if word else word)
        except Exception:
            out.append(word)
    return " ".join(out)


def _pieces(text: str) -> list[str]:
    pieces: list[str] = []
    current = ""
    for part in _PIECE_END.split(text):
        if current and len(current) + len(part) > CHUNK_CHARS:
            pieces.append(current)
            current = ""
        current += part
    if current:
        pieces.append(current)
    return pieces


def _normalize_pieces(pieces: list[str], lang: str, only_digits: bool) -> str:
    out = ""
    for piece in pieces:
        core = piece.strip()
        if not core or (only_digits and not _DIGIT.search(core)):
            out += piece
            continue
        lead = piece[: len(piece) - len(piece.lstrip())]
        trail = piece[len(piece.rstrip()) :]
        out += lead + _safe(core, lang) + trail
    return out.strip()


def normalize(text: str, lang: str = "auto") -> str:
    """wetext ``Normalizer().normalize`` (stripped output), robust and linear-time."""
    if lang == "auto":
        # Decide once for the whole text as wetext would, so pieces agree with each other.
        lang = "zh" if _CJK.search(text) or text.strip().isdigit() else "en"
    if lang != "en":
        # The zh/ja grammars only rewrite text with digits, and their cost grows with the
        # input length: feed them just the clauses that contain a digit (2-3x faster on a
        # typical sentence, linear on long texts).
        return _normalize_pieces(_CLAUSE_END.split(text), lang, only_digits=True)
    if len(text) <= CHUNK_CHARS:
        return _safe(text, lang)
    return _normalize_pieces(_pieces(text), lang, only_digits=False)
