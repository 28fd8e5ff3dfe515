"""A streamed sentence spoken while it arrives: the handler hands the sentence in progress to an
engine that can start early (``synthesize_growing``), through the real server with a fake
engine. The real CosyVoice2 engine's side is
tests/engine_tests/cosyvoice2/test_cosyvoice2_early_speech.py and the end-to-end run
tests/server/wyoming/test_server_cosyvoice2_and_3.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from fake_surface import FakeSurface
from wyoming.event import Event

from engine.api import SpeaksGrowingText
from engine.core.text_feed import TextFeed
from engine.core.types import AudioChunk, SynthesisCancelled

FIRST = "Turn on the kitchen lights please."
SECOND = "And the hall."


class GrowingFakeEngine(FakeSurface, SpeaksGrowingText):
    """The fake engine, plus ``synthesize_growing``: its first audio once three words have
    arrived, the rest after the sentence's end (as long as ``synthesize`` would make)."""

    START_WORDS = 3

    def __init__(self, model_dir: Path, threads: int | None, fake: type) -> None:
        self.fake = fake(model_dir, threads)
        self.speakers = self.fake.speakers
        self.growing: list[SimpleNamespace] = []

    def warmup(self) -> None:
        pass

    def synthesize(self, text: str, options: Any, cancel: threading.Event | None = None) -> Any:
        return self.fake.synthesize(text, options, cancel)

    def synthesize_growing(
        self, feed: TextFeed, options: Any, cancel: threading.Event | None = None
    ) -> Iterator[AudioChunk]:
        call = SimpleNamespace(first_audio_text=None, final=None, cancelled=False)
        self.growing.append(call)
        seen = None
        while not (now := feed.wait(seen, 0.02)).final:
            seen = now
            if cancel is not None and cancel.is_set():
                call.cancelled = True
                raise SynthesisCancelled("cancelled")
            if call.first_audio_text is None and len(now.text.split()) >= self.START_WORDS:
                call.first_audio_text = now.text
                try:
                    yield AudioChunk(np.full(self.fake.CHUNK, 0.1, np.float32))
                except GeneratorExit:
                    # The scheduler saw the cancel first and closed the synthesis at this
                    # chunk: stopped just the same.
                    call.cancelled = True
                    raise
        call.final = now.text
        done = self.fake.CHUNK if call.first_audio_text is not None else 0
        rest = self.fake.expected_samples(now.text) - done
        yield AudioChunk(np.full(rest, 0.1, np.float32))


def _server(wy: SimpleNamespace, **overrides: Any) -> Any:
    engines: list[GrowingFakeEngine] = []

    def factory(path: Path, threads: int | None) -> GrowingFakeEngine:
        engines.append(GrowingFakeEngine(path, threads, wy.FakeEngine))
        return engines[-1]

    return wy.fake_server({"cache.max_mb": 0, "server.loudness": None, **overrides},
                          engine=factory), engines  # fmt: skip


async def _speak_first_part_then_rest(wy: SimpleNamespace, port: int) -> tuple[Any, Any]:
    """Send the first words; read until audio arrives; then the rest of the stream."""
    async with wy.connect(port) as client:
        await client.write_event(Event("synthesize-start", {}))
        await client.write_event(Event("synthesize-chunk", {"text": "Turn on the kitchen"}))
        early = await wy.read_until(client, ("audio-chunk",))
        await client.write_event(Event("synthesize-chunk", {"text": " lights please. And the"}))
        await client.write_event(Event("synthesize-chunk", {"text": " hall."}))
        await client.write_event(Event("synthesize-stop"))
        rest = await wy.read_until(client, ("synthesize-stopped", "error"))
    return early, rest


def test_the_sentence_in_progress_is_spoken_while_it_arrives(wy: SimpleNamespace) -> None:
    async def go() -> None:
        server, engines = _server(wy)
        async with server as srv:
            early, rest = await _speak_first_part_then_rest(wy, srv.port)
        (engine,) = engines
        # Audio came before the sentence ended, from the words so far; then the whole sentence.
        assert early.types == ["audio-start", "audio-chunk"]
        (call,) = engine.growing
        assert call.first_audio_text == "Turn on the kitchen" and call.final == FIRST
        # The next sentence came while the first was spoken: the usual way, its own block.
        assert [c.text for c in engine.fake.calls] == [SECOND]
        blocks = wy.Reply(events=early.events + rest.events).blocks()
        assert [len(b) // 2 for b in blocks] == [
            wy.FakeEngine.expected_samples(FIRST),
            wy.FakeEngine.expected_samples(SECOND),
        ]
        assert rest.types[-1] == "synthesize-stopped" and rest.error() is None

    asyncio.run(go())


def test_early_speech_off_waits_for_each_sentence(wy: SimpleNamespace) -> None:
    async def go() -> None:
        server, engines = _server(wy, **{"server.early_speech": False})
        async with server as srv:
            reply = await wy.stream(srv.port, f"{FIRST} {SECOND}")
        (engine,) = engines
        assert engine.growing == [] and [c.text for c in engine.fake.calls] == [FIRST, SECOND]
        assert reply.error() is None and len(reply.blocks()) == 2

    asyncio.run(go())


def test_a_stream_typed_in_small_fragments_says_every_sentence_once(
    wy: SimpleNamespace,
) -> None:
    async def go() -> None:
        server, engines = _server(wy)
        async with server as srv:
            reply = await wy.stream(srv.port, f"{FIRST} {SECOND} Thanks!", fragment=2)
        (engine,) = engines
        said = [c.final for c in engine.growing] + [c.text for c in engine.fake.calls]
        assert sorted(said) == sorted([FIRST, SECOND, "Thanks!"])
        assert reply.error() is None and len(reply.blocks()) == 3

    asyncio.run(go())


def test_a_client_gone_mid_sentence_cancels_it(wy: SimpleNamespace) -> None:
    async def go() -> None:
        server, engines = _server(wy)
        async with server as srv:
            async with wy.connect(srv.port) as client:
                await client.write_event(Event("synthesize-start", {}))
                await client.write_event(Event("synthesize-chunk", {"text": "Turn on the kitch"}))
                await wy.read_until(client, ("audio-chunk",))
            (call,) = engines[0].growing
            await wy.until(
                lambda: call.cancelled, "the engine stops: it sees the cancel or is closed"
            )
            assert call.final is None
            # The engine is free again: the next client is served.
            reply = await wy.synthesize(srv.port, SECOND)
            assert reply.error() is None and reply.samples > 0

    asyncio.run(go())


def test_a_busy_server_gives_a_stream_whole_sentences(wy: SimpleNamespace) -> None:
    """A growing sentence holds the engine until it ends: never while another request waits."""

    async def go() -> None:
        server, engines = _server(wy)
        async with server as srv:
            scheduler = srv.running.scheduler
            scheduler.waiting += 1  # as if another request waited for the engine
            try:
                reply = await wy.stream(srv.port, f"{FIRST} {SECOND}")
            finally:
                scheduler.waiting -= 1
        assert engines[0].growing == [] and reply.error() is None

    asyncio.run(go())
