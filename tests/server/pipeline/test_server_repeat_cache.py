"""Instant repeats through the real server: a sentence spoken again with nothing changed that
shapes its audio is replayed from the repeat cache without the engine (the fake engine counts
its calls); a change of voice, speaker, instruction, seed or profile is a new sentence; the
byte budget evicts the least recently used; audio cut short is never kept; 0 turns it off.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
from conftest import FakeEngine

from engine.core.types import AudioChunk, SynthesisOptions
from engine.family import DESCRIBED_SPEAKER
from wyoming_cosyvoice.pipeline.repeat_cache import RepeatCache
from wyoming_cosyvoice.voices.catalog import Voice, VoiceCatalog


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def calls(srv: SimpleNamespace) -> list[str]:
    return [call.text for call in srv.engines[0].calls]


def stats(srv: SimpleNamespace) -> dict[str, int]:
    return dict(srv.running.scheduler.repeat_cache.stats())


def entry_bytes(sentence: str) -> int:
    """What one sentence of the fake engine's audio takes in the cache (float32)."""
    return FakeEngine.expected_samples(sentence) * 4


# --- hits -----------------------------------------------------------------------------------


def test_a_repeated_sentence_is_replayed_without_the_engine(wy: SimpleNamespace) -> None:
    async def main() -> tuple[Any, Any, list[str], dict[str, int]]:
        async with wy.fake_server() as srv:
            first = await wy.synthesize(srv.port, "The front door is open.")
            again = await wy.synthesize(srv.port, "The front door is open.")
            return first, again, calls(srv), stats(srv)

    first, again, spoken, counts = run(main())
    assert spoken == ["The front door is open."]
    assert again.types[0] == "audio-start" and again.types[-1] == "audio-stop"
    assert again.audio == first.audio and first.samples > 0
    assert counts["hits"] == 1 and counts["misses"] == 1 and counts["entries"] == 1
    assert counts["bytes"] == entry_bytes("The front door is open.")
    assert counts["max_bytes"] == 64 * 1024 * 1024  # the default budget


def test_a_repeat_inside_a_text_and_across_protocols_is_a_hit() -> None:
    from test_http import BackgroundServer

    text = "Lights off. Doors locked. Lights off."
    with BackgroundServer() as srv:
        with srv.client() as http:
            first = http.post("/tts", json={"text": text, "format": "pcm"})
            again = http.post("/tts", json={"text": "Doors locked.", "format": "pcm"})
        wyoming = srv.call(_synthesize(srv.wyoming_port, "Lights off."))
        spoken = [call.text for call in srv.engines[0].calls]
        counts = srv.running.scheduler.repeat_cache.stats()
    assert spoken == ["Lights off.", "Doors locked."]
    assert first.status_code == again.status_code == 200
    lights = FakeEngine.expected_samples("Lights off.") * 2
    assert first.content[:lights] == first.content[-lights:] == wyoming.audio
    assert again.content == first.content[lights:-lights]
    assert counts["hits"] == 3 and counts["misses"] == 2


def test_the_caches_hits_and_size_are_in_the_metrics() -> None:
    from prometheus_client.parser import text_string_to_metric_families
    from test_http import BackgroundServer

    with BackgroundServer() as srv:
        with srv.client() as http:
            for _ in range(3):
                assert http.post("/tts", json={"text": "Lights off.", "format": "pcm"}).is_success
            scrape = http.get("/metrics").text
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
        if sample.labels.get("cache") == "repeat"
    }
    assert values["cosyvoice_cache_hits_total"] == 2
    assert values["cosyvoice_cache_misses_total"] == 1
    assert values["cosyvoice_cache_entries"] == 1
    assert values["cosyvoice_cache_bytes"] == entry_bytes("Lights off.")
    assert values["cosyvoice_cache_max_bytes"] == 64 * 1024 * 1024


async def _synthesize(port: int, text: str, voice: dict[str, Any] | None = None) -> Any:
    from conftest import synthesize

    return await synthesize(port, text, voice)


def test_a_hit_is_served_while_the_engine_is_busy(wy: SimpleNamespace) -> None:
    """A stored sentence does not queue for the engine behind another client's long text: it
    is replayed while that text's first sentence is still being made."""
    long_text = " ".join(f"Sentence number {i} of a long announcement." for i in range(20))

    hold = threading.Event()

    async def main() -> tuple[Any, list[Any]]:
        engine = lambda p, t: FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server(engine=engine) as srv:
            hold.set()
            await wy.synthesize(srv.port, "Good night.")
            hold.clear()  # the long text's first sentence holds the engine from its first chunk
            async with wy.connect(srv.port) as busy:
                from wyoming.event import Event

                await busy.write_event(Event("synthesize", {"text": long_text}))
                await wy.read_until(busy, ("audio-chunk",))
                reply = await wy.synthesize(srv.port, "Good night.")
                engine_calls = list(srv.engines[0].calls)
            return reply, engine_calls

    reply, engine_calls = run(main())
    assert reply.types[-1] == "audio-stop"
    assert reply.samples == FakeEngine.expected_samples("Good night.")
    assert [c.text for c in engine_calls][0] == "Good night." and len(engine_calls) == 2
    assert not engine_calls[1].finished  # the long text's first sentence


# --- what changes the audio is a new sentence ----------------------------------------------


def test_voice_speaker_seed_and_profile_each_make_a_new_sentence() -> None:
    from test_http import BackgroundServer

    text = "Dinner is ready."
    with BackgroundServer() as srv:
        port = srv.wyoming_port
        srv.call(_synthesize(port, text, {"name": "en-male"}))
        srv.call(_synthesize(port, text, {"name": "en-female"}))  # another voice
        srv.call(_synthesize(port, text, {"name": "en-male", "speaker": "英文女"}))  # speaker
        srv.call(_synthesize(port, text, {"name": "en-male"}))  # hit
        with srv.client() as http:
            for body in ({"seed": 1}, {"seed": 2}, {"seed": 1}, {"profile": "quality"}):
                assert http.post("/tts", json={"text": text, "voice": "en-male", **body}).is_success
        speakers = [call.speaker for call in srv.engines[0].calls]
        counts = srv.running.scheduler.repeat_cache.stats()
    # en-male; en-female; the speaker 英文女 is en-female: a hit; en-male: a hit;
    # seed 1, seed 2 (new), seed 1 (hit); profile quality (new)
    assert speakers == ["英文男", "英文女", "英文男", "英文男", "英文男"]
    assert counts["misses"] == 5 and counts["hits"] == 3


def test_an_instruction_makes_a_new_sentence(wy: SimpleNamespace) -> None:
    class InstructEngine(FakeEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.kind, self.instruction_form = "instruct", DESCRIBED_SPEAKER
            self.instructions: list[str | None] = []

        def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
            self.instructions.append(options.instruct)
            return super().synthesize(text, options, cancel)

    async def main() -> list[str | None]:
        async with wy.fake_server(engine=InstructEngine) as srv:
            for speaker in ("Speak slowly.", "Speak cheerfully.", "Speak slowly.", None):
                voice = {"name": "en-male", **({"speaker": speaker} if speaker else {})}
                reply = await wy.synthesize(srv.port, "Time to wake up.", voice)
                assert reply.types[-1] == "audio-stop"
            return list(srv.engines[0].instructions)

    assert run(main()) == ["Speak slowly.", "Speak cheerfully.", None]


# --- the budget -----------------------------------------------------------------------------


def test_the_budget_evicts_the_least_recently_used(wy: SimpleNamespace) -> None:
    a, b, c = "First one here.", "Other one here.", "Third one here."
    budget = int(2.5 * entry_bytes(a))  # room for two sentences

    async def main() -> tuple[list[str], dict[str, int]]:
        async with wy.fake_server({"cache.max_mb": budget / 2**20}) as srv:
            for text in (a, b, a, c, a, b):  # a is used again before c: b is the oldest
                assert (await wy.synthesize(srv.port, text)).types[-1] == "audio-stop"
            return calls(srv), stats(srv)

    spoken, counts = run(main())
    assert spoken == [a, b, c, b]
    assert counts["entries"] == 2 and counts["bytes"] == 2 * entry_bytes(a) <= budget
    assert counts["hits"] == 2 and counts["misses"] == 4


def test_a_sentence_longer_than_the_budget_is_not_kept(wy: SimpleNamespace) -> None:
    text = "This sentence is longer than the whole budget."

    async def main() -> tuple[list[str], dict[str, int]]:
        budget = entry_bytes(text) - 1
        async with wy.fake_server({"cache.max_mb": budget / 2**20}) as srv:
            for _ in range(2):
                assert (await wy.synthesize(srv.port, text)).types[-1] == "audio-stop"
            return calls(srv), stats(srv)

    spoken, counts = run(main())
    assert spoken == [text, text] and counts["entries"] == counts["bytes"] == 0


def test_a_budget_of_zero_turns_the_cache_off(wy: SimpleNamespace) -> None:
    async def main() -> tuple[list[str], dict[str, int], Any, Any]:
        async with wy.fake_server({"cache.max_mb": 0}) as srv:
            first = await wy.synthesize(srv.port, "Say it twice.")
            again = await wy.synthesize(srv.port, "Say it twice.")
            return calls(srv), stats(srv), first, again

    spoken, counts, first, again = run(main())
    assert spoken == ["Say it twice.", "Say it twice."] and first.audio == again.audio
    assert counts == {"hits": 0, "misses": 0, "entries": 0, "bytes": 0, "max_bytes": 0}


# --- audio cut short is never kept ----------------------------------------------------------


def test_a_sentence_the_client_left_is_spoken_again_in_full(wy: SimpleNamespace) -> None:
    text = "A long sentence the first listener never hears to the end."
    hold = threading.Event()  # the first listener's sentence cannot end before it has left

    async def main() -> tuple[list[Any], Any, dict[str, int]]:
        engine = lambda p, t: FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server(engine=engine) as srv:
            async with wy.connect(srv.port) as client:
                from wyoming.event import Event

                await client.write_event(Event("synthesize", {"text": text}))
                await wy.read_until(client, ("audio-chunk",))
            await wy.until(lambda: srv.running.scheduler.idle, "the cancelled sentence let go")
            hold.set()
            reply = await wy.synthesize(srv.port, text)
            return list(srv.engines[0].calls), reply, stats(srv)

    engine_calls, reply, counts = run(main())
    assert [c.finished for c in engine_calls] == [False, True]
    assert reply.samples == FakeEngine.expected_samples(text)
    assert counts["misses"] == 2 and counts["entries"] == 1


def test_a_sentence_stopped_without_an_error_is_not_kept(wy: SimpleNamespace) -> None:
    """An engine may end a cancelled sentence early without raising: the audio it made is cut
    short, and must not be replayed as the whole sentence."""

    class QuietEngine(FakeEngine):
        def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
            chunks = super().synthesize(text, options, None)
            yield next(chunks)
            cancel.wait(10)  # stops at the cancel: returns, raises nothing

    async def main() -> dict[str, int]:
        async with wy.fake_server(engine=QuietEngine) as srv:
            async with wy.connect(srv.port) as client:
                from wyoming.event import Event

                await client.write_event(Event("synthesize", {"text": "Stop me half way."}))
                await wy.read_until(client, ("audio-chunk",))
                srv.running.scheduler.cancel_all()  # what a shutdown does
                await wy.until(lambda: srv.running.scheduler.idle, "the sentence let go")
            return stats(srv)

    counts = run(main())
    assert counts["misses"] == 1 and counts["entries"] == 0


# --- custom voices: a new catalogue may hold a new recording -------------------------------


def _custom(name: str = "grandma") -> Voice:
    return Voice(name, name, ("en_US",), f"{name} (custom voice)", custom=True)


async def _spoken(cache: RepeatCache, voice: Voice, catalog: object, *, store: bool) -> bool:
    """One sentence's turn: True if it was a hit; else records a chunk and stores it."""
    lookup = cache.lookup("Hello.", voice, SynthesisOptions(speaker=voice.speaker), catalog)
    if lookup.hit:
        return True

    async def nowhere(chunk: AudioChunk) -> None:
        pass

    await lookup.record(nowhere)(AudioChunk(np.zeros(100, np.float32)))
    if store:
        lookup.store()
    return False


def test_a_new_voice_catalogue_drops_only_the_custom_voices_audio() -> None:
    async def main() -> list[bool]:
        cache, builtin = RepeatCache(1 << 20), Voice("en-male", "英文男", ("en_US",), "")
        old, new = VoiceCatalog(["英文男"]), VoiceCatalog(["英文男"])
        for voice in (builtin, _custom()):
            await _spoken(cache, voice, old, store=True)
        return [
            await _spoken(cache, builtin, old, store=False),
            await _spoken(cache, _custom(), old, store=False),
            await _spoken(cache, builtin, new, store=False),  # the folder was scanned again
            await _spoken(cache, _custom(), new, store=False),
        ]

    assert run(main()) == [True, True, True, False]


def test_a_custom_voice_sentence_finished_after_a_rescan_is_not_kept() -> None:
    async def main() -> tuple[bool, dict[str, int]]:
        cache, old, new = RepeatCache(1 << 20), VoiceCatalog([]), VoiceCatalog([])
        options = SynthesisOptions(speaker="grandma")
        lookup = cache.lookup("Hello.", _custom(), options, old)

        async def nowhere(chunk: AudioChunk) -> None:
            pass

        await lookup.record(nowhere)(AudioChunk(np.zeros(100, np.float32)))
        cache.lookup("Other.", _custom(), options, new)  # a rescan published meanwhile
        lookup.store()
        return await _spoken(cache, _custom(), new, store=False), cache.stats()

    hit, counts = run(main())
    assert not hit and counts["entries"] == 0


def test_stored_audio_is_unchanged_by_what_is_done_to_a_replay() -> None:
    async def main() -> tuple[np.ndarray, np.ndarray]:
        cache, voice = RepeatCache(1 << 20), Voice("en-male", "英文男", ("en_US",), "")
        options, catalog = SynthesisOptions(speaker="英文男"), object()
        made = AudioChunk(np.full(50_000, 0.25, np.float32))
        lookup = cache.lookup("Hello.", voice, options, catalog)

        async def gain_in_place(chunk: AudioChunk) -> None:
            np.multiply(chunk.samples, 2.0, out=chunk.samples)  # a careless gain on the way

        await lookup.record(gain_in_place)(made)
        lookup.store()
        for piece in cache.lookup("Hello.", voice, options, catalog).replay():
            await gain_in_place(piece)
        pieces = list(cache.lookup("Hello.", voice, options, catalog).replay())
        return np.concatenate([p.samples for p in pieces]), np.array([len(pieces)])

    replayed, pieces = run(main())
    assert np.all(replayed == np.float32(0.25)) and len(replayed) == 50_000
    assert pieces[0] == 5  # half-second pieces at 22050 Hz
