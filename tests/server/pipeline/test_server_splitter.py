"""Streamed text through the real server, the real splitter and the real engine (tiny model).

Home Assistant streams an LLM's answer in small fragments. The server's own splitter (the text
frontend's ``IncrementalSplitter``, not a test stand-in) must cut them where the whole text
would be cut, never inside an abbreviation or a decimal, and speak each sentence as soon as it
is complete: one audio block per sentence, each sentence one engine call.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from fake_surface import FakeSurface
from wyoming.event import Event

from engine.text.segment import split_sentences

# Abbreviations, initials, a decimal and a time: a naive splitter cuts after each of their dots.
TEXT = (
    "Dr. Smith met Mr. J. Brown at 3.5 km from the U.S. border. "
    "It was 7 p.m. on Friday! 我们明天见。 See you then."
)


class RecordingEngine(FakeSurface):
    """The real engine with a fixed number of speech tokens (random weights never end a
    sentence by themselves), recording the text of every call."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.speakers, self.kind = inner, inner.speakers, inner.kind
        self.sample_rate, self.instruction_form = inner.sample_rate, inner.instruction_form
        self.texts: list[str] = []
        self.lock = threading.Lock()

    def warmup(self) -> None:
        pass

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
        with self.lock:
            self.texts.append(text)
        return self.inner.synthesize(text, replace(options, force_tokens=10), cancel)


def test_streamed_fragments_are_cut_by_the_frontends_splitter(wy: SimpleNamespace) -> None:
    from engine.cosyvoice1.engine import CosyVoiceEngine
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.wyoming.server import create_server

    engines: list[RecordingEngine] = []

    def factory(path: Path, threads: int | None) -> RecordingEngine:
        engines.append(RecordingEngine(CosyVoiceEngine.load(path, threads=1)))
        return engines[-1]

    async def main() -> tuple[Any, Any]:
        # A fixed profile: auto's measuring requests after the warm-up would be recorded too.
        uri = f"tcp://127.0.0.1:{wy.free_port()}"
        config = load_config(None, [("server.uri", uri), ("server.seed", 0),
                                    ("server.profile", "realtime")])  # fmt: skip
        # No splitter_factory: the server's own.
        running = await create_server(config, wy.TINY_MODEL, engine_factory=factory)
        try:
            await asyncio.wait_for(asyncio.shield(running.load_task), 120)
            async with wy.connect(running.port) as client:
                await client.write_event(Event("synthesize-start", {"voice": {"name": "en-male"}}))
                # Up to the first letter after the first sentence: its end is then certain.
                head = TEXT.index("It was") + 1
                for i in range(0, len(TEXT), 3):
                    if i == (head // 3 + 1) * 3:
                        # Its audio comes while the rest of the stream is still to be sent.
                        first = await wy.read_until(client, ("audio-chunk",), timeout=120)
                    chunk = Event("synthesize-chunk", {"text": TEXT[i : i + 3]})
                    await client.write_event(chunk)
                await client.write_event(Event("synthesize-stop"))
                rest = await wy.read_until(client, ("synthesize-stopped", "error"), timeout=120)
            return first, rest
        finally:
            await running.stop()

    first, reply = asyncio.run(main())
    expected = split_sentences(TEXT)
    assert expected[:2] == [
        "Dr. Smith met Mr. J. Brown at 3.5 km from the U.S. border.",
        "It was 7 p.m. on Friday!",
    ]
    assert engines[0].texts == expected  # cut once, where the whole text is cut
    assert first.types == ["audio-start", "audio-chunk"]
    reply.events[:0] = first.events
    assert reply.types[-1] == "synthesize-stopped" and reply.error() is None
    blocks = reply.blocks()
    assert len(blocks) == len(expected) and all(blocks)  # one audio block per sentence
