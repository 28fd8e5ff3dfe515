"""Text → sentences, each with its language: the first stage of the speech pipeline.

A whole text and a stream of fragments (Wyoming's ``synthesize-chunk``) go through the same
splitter, the text frontend's ``IncrementalSplitter``: a sentence is released as soon as its
end is certain, and feeding a text in any fragments gives the sentences of the whole text.
Each sentence's language is detected once, here, and travels with it. A whole text is split
as it is spoken (:func:`iter_sentences`): a long announcement's first sentence goes to the
engine without the rest being split or detected first.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from engine.text.normalize import detect_language
from engine.text.segment import IncrementalSplitter

# The order detect_language checks a text in: a text holding sentences of several languages
# is detected as the first of theirs in this order (any kana makes it Japanese, ...).
_LANGUAGE_ORDER = ("ja", "ko", "yue", "zh", "en")
# A whole text is fed to the splitter in pieces of this many characters, as its sentences are
# taken: the work before a sentence is bounded however long the text.
FEED_CHARS = 512
# A whole text's language (which voice speaks it) is detected from its opening characters: all
# of a voice-pipeline answer, the beginning of a long announcement.
OPENING_CHARS = 2000


@dataclass(frozen=True)
class Sentence:
    """One sentence to synthesize, and its language (zh, en, ja, ko or yue)."""

    text: str
    language: str


class Splitter(Protocol):
    """The text frontend's ``IncrementalSplitter`` as the pipeline uses it."""

    # A sentence without an end is cut after this many characters.
    max_chars: int

    def feed(self, fragment: str) -> list[str]: ...

    def flush(self) -> list[str]: ...

    @property
    def pending(self) -> str:
        """The text fed but not yet released as a sentence."""
        ...


SplitterFactory = Callable[[], Splitter]


def make_splitter() -> Splitter:
    """The text frontend's incremental sentence splitter."""
    return IncrementalSplitter()


def has_speech(sentence: str) -> bool:
    """False for pure punctuation/whitespace, which has nothing to say."""
    return any(ch.isalnum() for ch in sentence)


def _sentences(pieces: Iterable[str]) -> list[Sentence]:
    return [Sentence(p, detect_language(p)) for p in pieces if has_speech(p)]


class SentenceStream:
    """Streamed text → the sentences each fragment completes; :meth:`flush` gives the rest."""

    def __init__(self, splitter: Splitter) -> None:
        self._splitter = splitter
        self._max_chars = splitter.max_chars

    def release_long_sentences(self, after: int | None) -> None:
        """Cut a sentence without an end after ``after`` characters instead of the splitter's
        own limit (None: that limit again). A sentence spoken while it arrives has been read up
        to its last word: a cut at an earlier comma would say those words twice."""
        self._splitter.max_chars = self._max_chars if after is None else after

    def feed(self, fragment: str) -> list[Sentence]:
        return _sentences(self._splitter.feed(fragment))

    def flush(self) -> list[Sentence]:
        return _sentences(self._splitter.flush())

    @property
    def pending(self) -> str:
        """The text fed but not yet released as a sentence."""
        return self._splitter.pending


def iter_sentences(text: str, splitter: Splitter | None = None) -> Iterator[Sentence]:
    """A complete text's sentences, split and detected only as each is taken (none: nothing to
    say). The same sentences as splitting the text at once: the splitter cuts fragments where
    it would cut the whole."""
    stream = SentenceStream(splitter or make_splitter())
    for start in range(0, len(text), FEED_CHARS):
        yield from stream.feed(text[start : start + FEED_CHARS])
    yield from stream.flush()


def split_text(text: str, splitter: Splitter | None = None) -> list[Sentence]:
    """A complete text's sentences, all at once (none: nothing to say)."""
    return list(iter_sentences(text, splitter))


def text_language(sentences: Iterable[Sentence]) -> str | None:
    """The language of the text these sentences make up, as detecting it whole would say,
    from their languages (no second detection); None for no sentence."""
    found = {sentence.language for sentence in sentences}
    return next((language for language in _LANGUAGE_ORDER if language in found), None)


def opening_language(text: str) -> str | None:
    """The language of a whole text for choosing its voice, detected from its opening
    :data:`OPENING_CHARS` characters (as :func:`text_language` of their sentences would say);
    None when they hold nothing to speak (the first sentence's language decides then)."""
    opening = text[:OPENING_CHARS]
    return detect_language(opening) if has_speech(opening) else None
