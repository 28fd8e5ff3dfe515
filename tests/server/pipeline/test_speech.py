"""The speech pipeline on its own: sentences, voices, the bounded audio stream, cancellation.

Every front end (Wyoming, HTTP, the synthesize command) drives this; their own tests check the
protocol around it. Here a real :class:`Scheduler` runs the fake engine (conftest), so the
engine thread, the FIFO turn and the cancel event are the server's own.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
from conftest import TINY_MODEL, FakeEngine, until

from engine.core.types import AudioChunk, EngineError, SynthesisCancelled
from engine.text.normalize import detect_language
from wyoming_cosyvoice.config import load_config
from wyoming_cosyvoice.pipeline.scheduler import Scheduler
from wyoming_cosyvoice.pipeline.sentences import (
    SentenceStream,
    make_splitter,
    split_text,
    text_language,
)
from wyoming_cosyvoice.pipeline.speech import (
    Audio,
    ClientStalledError,
    SentenceEnd,
    SentenceStart,
    Speech,
    SpeechSettings,
    VoiceChoice,
)

CONFIG = load_config(None)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@asynccontextmanager
async def scheduler(engine: Callable[..., Any] = FakeEngine) -> AsyncIterator[Scheduler]:
    made = Scheduler(TINY_MODEL, engine_factory=lambda path, threads: engine(path, threads),
                     warmup=False)  # fmt: skip
    await made.load()
    try:
        yield made
    finally:
        made.shutdown()


def speech_of(sched: Scheduler, text: str, *, limits: Any = None, **choice: Any) -> Speech:
    sentences = split_text(text)
    voices = VoiceChoice(choice.pop("wanted", None), None,
                         text_language=text_language(sentences), **choice)  # fmt: skip
    speech = Speech(sched, SpeechSettings(CONFIG.profile, seed=0), voices,
                    limits or CONFIG.limits, client="test")  # fmt: skip
    for sentence in sentences:
        speech.say(sentence)
    speech.end()
    return speech


async def drain(speech: Speech, deliver: bool = True) -> list[Any]:
    events = []
    while (event := await speech.next()) is not None:
        events.append(event)
        if deliver and isinstance(event, Audio):
            speech.delivered(event.samples)
    return events


# --- sentences and voices ---------------------------------------------------------------------


def test_a_text_is_split_once_into_sentences_that_carry_their_language() -> None:
    text = "Good morning, Dr. Smith. 今天天气很好。 こんにちは。 Bye!"
    sentences = split_text(text)
    assert [s.text for s in sentences] == [
        "Good morning, Dr. Smith.",
        "今天天气很好。",
        "こんにちは。",
        "Bye!",
    ]
    assert [s.language for s in sentences] == ["en", "zh", "ja", "en"]
    streamed = SentenceStream(make_splitter())
    pieces = [s for i in range(0, len(text), 4) for s in streamed.feed(text[i : i + 4])]
    assert pieces + streamed.flush() == sentences  # fragments give the same sentences


@pytest.mark.parametrize(
    "text",
    [
        "Hello. 你好。",
        "Hi! 안녕하세요. 你好。",
        "佢哋好。 Hello.",
        "Just English. Twice.",
        "はい。 你好。",
    ],
)
def test_the_language_of_a_text_is_read_off_its_sentences(text: str) -> None:
    assert text_language(split_text(text)) == detect_language(text)


def test_one_voice_per_request_or_one_per_sentence() -> None:
    mixed = "Good morning, everyone. 今天天气很好。"

    async def main() -> tuple[list[str], list[str], list[str]]:
        async with scheduler() as sched:
            whole = await drain(speech_of(sched, mixed))
            each = await drain(speech_of(sched, mixed, per_sentence=True))
            asked = await drain(speech_of(sched, mixed, per_sentence=True,
                                          wanted={"name": "en-male"}))  # fmt: skip

        def voices(events: list[Any]) -> list[str]:
            return [e.voice.name for e in events if isinstance(e, SentenceStart)]

        return voices(whole), voices(each), voices(asked)

    whole, each, asked = run(main())
    assert whole == ["zh-female", "zh-female"]  # the whole text's language, as detected whole
    assert each == ["en-female", "zh-female"]
    assert asked == ["en-male", "en-male"]


# --- the stream -------------------------------------------------------------------------------


def test_events_come_per_sentence_in_order_with_every_sample() -> None:
    async def main() -> tuple[list[Any], list[str]]:
        async with scheduler() as sched:
            events = await drain(speech_of(sched, "One sentence here. And a second one!"))
            return events, [call.text for call in sched.engine.calls]

    events, engine_texts = run(main())
    assert engine_texts == ["One sentence here.", "And a second one!"]  # one call per sentence
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "SentenceStart" and kinds[-1] == "SentenceEnd"
    assert kinds.count("SentenceStart") == kinds.count("SentenceEnd") == 2
    for text, index in zip(engine_texts, (0, 1), strict=True):
        start = kinds.index("SentenceStart", 0 if index == 0 else kinds.index("SentenceEnd") + 1)
        end = kinds.index("SentenceEnd", start)
        audio = sum(e.samples for e in events[start:end] if isinstance(e, Audio))
        assert audio == FakeEngine.expected_samples(text)


def test_an_undelivered_stream_waits_between_sentences_then_drops_its_stalled_client() -> None:
    limits = load_config(None, [("limits.max_buffered_audio_s", 0.2),
                                ("limits.stall_timeout_s", 0.5)]).limits  # fmt: skip
    text = " ".join(f"Sentence number {i} is long enough." for i in range(20))

    async def main() -> tuple[bool, int, Any, int]:
        async with scheduler() as sched:
            stalled = asyncio.Event()
            speech = speech_of(sched, text, limits=limits)
            speech.on_stall = stalled.set
            with pytest.raises(ClientStalledError):
                await drain(speech, deliver=False)  # read, never delivered to a client
            other = await drain(speech_of(sched, "Someone else."))  # the engine is free
            return stalled.is_set(), len(sched.engine.calls), other, speech.samples

    on_stall, calls, other, samples = run(main())
    assert on_stall and calls == 2  # the first sentence only (0.2 s of room), then the other
    assert sum(e.samples for e in other if isinstance(e, Audio)) > 0
    assert samples == FakeEngine.expected_samples("Sentence number 0 is long enough.")


def test_cancel_stops_the_engine_within_a_chunk_and_later_sentences_never_start() -> None:
    hold = threading.Event()  # never set: the sentence ends only by the cancel
    slow = lambda path, threads: FakeEngine(path, threads, hold=hold)  # noqa: E731
    text = "A sentence long enough to take a while to say. " * 4

    async def main() -> list[Any]:
        async with scheduler(slow) as sched:
            speech = speech_of(sched, text)
            while not isinstance(await speech.next(), Audio):
                pass
            speech.cancel()
            assert await speech.next() is None
            calls = sched.engine.calls
            await until(calls[0].ended.is_set, "the engine stops the sentence")
            assert await sched.wait_idle(10)
            return calls

    calls = run(main())
    # Stopped after its first chunk (the cancel event seen, or its generator closed), and the
    # later sentences never reached the engine.
    assert len(calls) == 1 and not calls[0].finished and calls[0].chunks == 1


def test_a_cancel_from_outside_ends_the_stream_with_synthesis_cancelled() -> None:
    async def main() -> None:
        hold = threading.Event()  # never set: the speech ends only by the cancel
        async with scheduler(lambda p, t: FakeEngine(p, t, hold=hold)) as sched:
            cancel = threading.Event()
            speech = Speech(sched, SpeechSettings(CONFIG.profile, 0), VoiceChoice(None, None),
                            CONFIG.limits, client="test", cancel=cancel)  # fmt: skip
            for sentence in split_text("A long enough sentence to be stopped. " * 3):
                speech.say(sentence)
            speech.end()
            await speech.next()
            cancel.set()  # a shutdown, or the connection went away
            with pytest.raises(SynthesisCancelled):
                await drain(speech)

    run(main())


class PickyEngine(FakeEngine):
    """Refuses sentences with "BAD" (as the text frontend refuses text it cannot speak), and
    yields audio at another rate for "RATE"."""

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Any:
        if "BAD" in text:
            raise ValueError("the frontend cannot speak this")
        if "RATE" in text:
            return iter([AudioChunk(FakeEngine.expected_samples(text) * [0.0], 16000)])
        return super().synthesize(text, options, cancel)


def test_a_refused_sentence_ends_the_speech_or_is_skipped() -> None:
    text = "First one is fine. Then a BAD one. And a last one."

    async def main() -> tuple[list[Any], Exception]:
        async with scheduler(PickyEngine) as sched:
            skipping = speech_of(sched, text)
            skipping.skip_failed = True
            events = await drain(skipping)
            with pytest.raises(ValueError) as refused:
                await drain(speech_of(sched, text))
            return events, refused.value

    events, refused = run(main())
    ends = [e for e in events if isinstance(e, SentenceEnd)]
    assert [e.skipped is not None for e in ends] == [False, True, False]
    assert "cannot speak" in str(refused)


def test_audio_at_another_sample_rate_is_an_engine_error() -> None:
    async def main() -> None:
        async with scheduler(PickyEngine) as sched:
            with pytest.raises(EngineError, match="16000 Hz, expected 22050"):
                await drain(speech_of(sched, "The RATE is wrong."))

    run(main())


class OptionsEngine(FakeEngine):
    """Keeps the options of every call."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.options: list[Any] = []

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Any:
        self.options.append(options)
        return super().synthesize(text, options, cancel)


def test_each_sentence_reaches_the_engine_already_split_with_its_language() -> None:
    async def main() -> list[Any]:
        async with scheduler(OptionsEngine) as sched:
            await drain(speech_of(sched, "Good morning to you. 早上好，今天天气不错。"))
            return sched.engine.options

    options = run(main())
    assert [(o.split, o.language) for o in options] == [(False, "en"), (False, "zh")]
