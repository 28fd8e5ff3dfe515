"""CosyVoice2 speaks a sentence while its text is still arriving (``synthesize_growing``): the
tiny model, a sentence fed through a :class:`~engine.core.text_feed.TextFeed`."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from test_cosyvoice2_engine import load_tiny

import engine.cosyvoice2.growing_speech as growing_speech
from engine.core.text_feed import TextFeed
from engine.core.types import AudioChunk, SynthesisCancelled, SynthesisOptions
from engine.cosyvoice2.engine import CosyVoice2Engine

# No sentence end: what an LLM has streamed of its first sentence so far.
BEGUN = (
    "Sure, I have turned on the kitchen lights and the lamp in the living room, and I set the "
    "heating to twenty one degrees so that it is warm when you come home this evening and"
)
WHOLE = BEGUN + " the kettle is on."
TOKENS = 40
SAMPLES_PER_TOKEN = 2 * 480
# A finish() that comes this late means the engine waited for the sentence's end.
LATE_FINISH_S = 60.0


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Bit-stable sums, and no oversubscription of the shared cores."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> CosyVoice2Engine:
    return load_tiny(tmp_path_factory)


def _options(**kw: object) -> SynthesisOptions:
    base = {"speaker": "tester", "seed": 3, "stream": True, "force_tokens": TOKENS,
            "n_timesteps": 2, "language": "en"}  # fmt: skip
    return SynthesisOptions(**{**base, **kw})  # type: ignore[arg-type]


def _audio(chunks: Iterator[AudioChunk]) -> np.ndarray:
    return np.concatenate([c.samples for c in chunks])


class Sessions:
    """Counts the interleaved (bistream) LM sessions the engine opens and draws from."""

    def __init__(self, engine: CosyVoice2Engine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.opened = 0
        inner = growing_speech.BistreamSession

        def session(*args: object, **kwargs: object) -> object:
            self.opened += 1
            return inner(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(growing_speech, "BistreamSession", session)


def _first_then_finish(engine: CosyVoice2Engine, feed: TextFeed, **kw: object) -> np.ndarray:
    """The first chunk while the sentence is unfinished, then the rest after its end."""
    late = threading.Timer(LATE_FINISH_S, feed.finish, (WHOLE,))
    late.start()
    try:
        chunks = engine.synthesize_growing(feed, _options(**kw))
        first = next(chunks)
        assert not feed.now.final, "the first audio waited for the end of the sentence"
    finally:
        late.cancel()
    feed.finish(WHOLE)
    return np.concatenate([first.samples, _audio(chunks)])


def test_audio_starts_before_the_sentence_ends(engine: CosyVoice2Engine) -> None:
    audio = _first_then_finish(engine, TextFeed(BEGUN))
    assert audio.shape == (TOKENS * SAMPLES_PER_TOKEN,) and np.isfinite(audio).all()


def test_the_speech_does_not_depend_on_how_the_text_arrived(engine: CosyVoice2Engine) -> None:
    at_once = _first_then_finish(engine, TextFeed(BEGUN))
    # Word by word, from another thread, while the engine already waits for text.
    feed = TextFeed()
    words = BEGUN.split(" ")

    def type_words() -> None:
        for n in range(1, len(words) + 1):
            feed.update(" ".join(words[:n]))

    typist = threading.Thread(target=type_words)
    typist.start()
    try:
        in_words = _first_then_finish(engine, feed)
    finally:
        typist.join()
    np.testing.assert_array_equal(in_words, at_once)


def test_a_sentence_that_ends_before_the_lm_starts_is_spoken_as_usual(
    engine: CosyVoice2Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = Sessions(engine, monkeypatch)
    feed = TextFeed("Hello")
    feed.finish("Hello there.")
    growing = _audio(engine.synthesize_growing(feed, _options()))
    usual = _audio(engine.synthesize("Hello there.", _options()))
    np.testing.assert_array_equal(growing, usual)
    # The interleaved session was opened but never drew (no LM call): the usual layout spoke.
    assert sessions.opened == 1


def test_the_early_start_is_the_interleaved_layout(
    engine: CosyVoice2Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    sessions = Sessions(engine, monkeypatch)
    early = _first_then_finish(engine, TextFeed(BEGUN))
    assert sessions.opened == 1
    usual = _audio(engine.synthesize(WHOLE, _options()))
    assert early.shape == usual.shape and not np.array_equal(early, usual)


def test_not_streamed_waits_for_the_whole_sentence(engine: CosyVoice2Engine) -> None:
    feed = TextFeed(BEGUN)
    chunks = engine.synthesize_growing(feed, _options(stream=False))
    finisher = threading.Timer(0.2, feed.finish, (WHOLE,))
    finisher.start()
    try:
        whole = _audio(chunks)
    finally:
        finisher.cancel()
    np.testing.assert_array_equal(whole, _audio(engine.synthesize(WHOLE, _options(stream=False))))


@pytest.mark.parametrize("stream", [True, False])
def test_cancel_while_waiting_for_text(engine: CosyVoice2Engine, stream: bool) -> None:
    feed = TextFeed("Hello")  # too little text for the LM to start
    cancel = threading.Event()
    raised: list[BaseException] = []

    def speak() -> None:
        try:
            for _ in engine.synthesize_growing(feed, _options(stream=stream), cancel):
                pass
        except BaseException as err:  # noqa: BLE001 - recorded for the test
            raised.append(err)

    worker = threading.Thread(target=speak)
    worker.start()
    cancel.set()
    worker.join(LATE_FINISH_S)
    alive = worker.is_alive()
    feed.finish("Hello there.")  # never leave the thread behind
    worker.join()
    assert not alive, "a cancelled request kept waiting for its text"
    assert len(raised) == 1 and isinstance(raised[0], SynthesisCancelled)


def test_text_after_the_end_is_refused() -> None:
    feed = TextFeed("Hello")
    feed.finish("Hello.")
    with pytest.raises(RuntimeError):
        feed.update("Hello. More")
    feed.finish("ignored")  # a second end changes nothing
    assert feed.now.text == "Hello." and feed.now.final
