"""The text frontend the engine and the server call: text -> segments of BPE ids."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from engine.text import wetext_backend
from engine.text.errors import TextInputError
from engine.text.normalize import detect_language, normalize
from engine.text.pronunciations import PronouncingFrontend
from engine.text.tokenizer import get_tokenizer

_LOGGER = logging.getLogger(__name__)

# Plain text, 6 BPE ids: what the v1 release appended to instruct text. Upstream later dropped
# it and asks users for "<|endofprompt|>" (8 different ids) instead; the v1 -Instruct model was
# trained with the original behaviour, so we keep it.
INSTRUCT_SUFFIX = "<endofprompt>"
_USER_SUFFIX = re.compile(r"\s*<\|?endofprompt\|?>\s*$")
# A request longer than this is refused: wetext alone would take tens of seconds, and hours
# of audio belong in several requests (streamed text is cut by IncrementalSplitter first).
MAX_TEXT_CHARS = 20_000

__all__ = ["INSTRUCT_SUFFIX", "MAX_TEXT_CHARS", "Segment", "TextFrontend", "TextInputError"]


@dataclass(frozen=True)
class Segment:
    """One independently synthesised piece of text and its whisper BPE ids."""

    text: str
    token_ids: list[int]


def checked_text(text: object, what: str) -> str:
    """``text`` if it is a string within the length limit (``what``: its name in the error)."""
    if not isinstance(text, str):
        raise TextInputError(f"{what} must be a string, not {type(text).__name__}")
    if len(text) > MAX_TEXT_CHARS:
        raise TextInputError(
            f"{what} is {len(text)} characters long; the limit is {MAX_TEXT_CHARS}. "
            "Send it in several requests or stream it."
        )
    return text


class TextFrontend(PronouncingFrontend):
    """Normalise, split and tokenise text for CosyVoice-300M v1.

    Stateless apart from the process-wide tokenizer and wetext grammars, so one instance can be
    shared between threads.
    """

    def __init__(self, language_tags: bool = False) -> None:
        # Upstream only tags text the user tagged; since segments are synthesised independently,
        # a tag typed at the start only reaches the first one. With language_tags=True every
        # segment gets the tag of its detected language (useful for cross-lingual voices).
        self.language_tags = language_tags
        self.tokenizer = get_tokenizer()

    def warm_up(self) -> None:
        """Load the wetext grammars and run one sentence through the whole frontend."""
        wetext_backend.warm_up()
        self.segments("Hello, 21.5°C. 你好，7:30。")

    def segments(
        self, text: str, *, split: bool = True, language: str | None = None
    ) -> list[Segment]:
        """Segments to synthesise; ``[]`` when nothing speakable is left.

        ``split=False``: ``text`` is one sentence already split off by the caller, normalised
        as one segment. ``language``: the caller's detection, used for the language tags.
        """
        text = checked_text(text, "text")
        out = []
        for seg in normalize(self.pronunciations.apply(text), split=split):
            if self.language_tags and not seg.startswith("<|"):
                seg = f"<|{language or detect_language(seg)}|>{seg}"
            out.append(Segment(seg, self.tokenizer.encode(seg)))
        _LOGGER.debug("frontend: %d chars -> %d segments", len(text), len(out))
        return out

    def prompt_text_ids(self, text: str) -> list[int]:
        """Transcript of a zero-shot prompt, normalised without splitting."""
        norm = normalize(checked_text(text, "prompt text"), split=False)
        return self.tokenizer.encode(norm[0]) if norm else []

    def instruct_ids(self, instruct_text: str) -> list[int]:
        """Instruct text for the -Instruct model: normalised, then ``<endofprompt>``.

        A trailing ``<endofprompt>`` or ``<|endofprompt|>`` typed by the user is replaced by the
        v1 suffix, so both spellings end in the same 6 ids.
        """
        text = _USER_SUFFIX.sub("", checked_text(instruct_text, "instruct text"))
        norm = normalize(text, split=False)
        if not norm:
            raise TextInputError("instruct text is empty or has nothing to say")
        return self.tokenizer.encode(norm[0] + INSTRUCT_SUFFIX)
