"""Garbage text end to end: real frontend, real engine (tiny model), real server.

The frontend's own garbage list (tests/engine_tests/text/test_text_frontend.py) sent over Wyoming,
whole and streamed: every input gives audio or a clear ``error`` event — never a crash, a hang or an
exception in the log — and the server keeps serving afterwards. The tiny model has random
weights, so ``force_tokens`` fixes each sentence's length and keeps the run short.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from wyoming.event import Event, async_read_event

# text -> expected error code, SILENCE (an empty audio block: a valid WAV with no samples), or
# None: audio
SILENCE = "silence"
GARBAGE: dict[str, tuple[str, str | None]] = {
    "empty": ("", SILENCE),
    "whitespace": ("   \t\n ", SILENCE),
    "only punctuation": ("...!!!", SILENCE),
    "only CJK punctuation": ("。，、？", SILENCE),
    "only emoji": ("😀😀🎉", SILENCE),
    "lone surrogates": ("\ud800\udfff", SILENCE),
    # "0m" of the escape counts as letters for the server but the frontend strips the escape:
    # the engine yields nothing, which is silence too.
    "control characters": ("\x00\x01\x1b[0m\x7f", SILENCE),
    "zero-width": ("\u200b\ufeff", SILENCE),
    "100 KB": ("今天天气很好。" * 15_000, "LimitExceededError"),
    "garbage around words": ("a\ud800b\x00 costs $5\x07 😀", None),
    "emoji and words": ("😀 Good morning! 🎉", None),
    "combining marks": ("e\u0301" * 30 + " cafe\u0301.", None),
    "one 300-letter word": ("a" * 300, None),
    "mixed scripts": ("Hello 你好 こんにちは 안녕하세요 مرحبا", None),
}


@contextlib.asynccontextmanager
async def real_server(port: int, model_dir: Path) -> AsyncIterator[Any]:
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.wyoming.server import create_server

    settings = {
        "server.uri": f"tcp://127.0.0.1:{port}",
        "server.warmup": False,
        "server.seed": 0,
        "server.threads": 1,  # the machine's other core belongs to other work
    }
    config = replace(load_config(None, settings.items()), force_tokens=3)
    running = await create_server(config, model_dir)
    try:
        await asyncio.wait_for(asyncio.shield(running.load_task), 120)
        yield running
    finally:
        await running.stop()


class AsciiClient:
    """A Wyoming client that frames JSON with ``ensure_ascii``, so lone surrogates can be sent
    (as ``\\ud800`` escapes, which any JSON peer may send); the wyoming client cannot."""

    def __init__(self, port: int) -> None:
        self.port = port

    async def __aenter__(self) -> AsciiClient:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def write_event(self, event: Event) -> None:
        block = json.dumps(event.data).encode() if event.data else b""
        head = {"type": event.type, **({"data_length": len(block)} if block else {})}
        self.writer.write(json.dumps(head).encode() + b"\n" + block)
        await self.writer.drain()

    async def read_event(self) -> Event | None:
        return await async_read_event(self.reader)


async def _whole(wy: SimpleNamespace, port: int, text: str, voice: Any = None) -> Any:
    async with AsciiClient(port) as client:
        await client.write_event(Event("synthesize", {"text": text, "voice": voice}))
        return await wy.read_until(client, ("audio-stop", "error"))


async def _streamed(wy: SimpleNamespace, port: int, text: str) -> Any:
    """Home Assistant's order: start, 7-character fragments, the compat synthesize, stop."""
    async with AsciiClient(port) as client:
        await client.write_event(Event("synthesize-start"))
        for i in range(0, len(text), 7):
            await client.write_event(Event("synthesize-chunk", {"text": text[i : i + 7]}))
        await client.write_event(Event("synthesize", {"text": text}))
        await client.write_event(Event("synthesize-stop"))
        return await wy.read_until(client, ("synthesize-stopped", "error"))


def test_garbage_text_through_the_server(
    wy: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)

    async def main() -> dict[str, tuple[Any, Any]]:
        out: dict[str, tuple[Any, Any]] = {}
        async with real_server(wy.free_port(), wy.TINY_MODEL) as running:
            port = running.port
            for name, (text, _) in GARBAGE.items():
                whole = await asyncio.wait_for(_whole(wy, port, text), 120)
                streamed = await asyncio.wait_for(_streamed(wy, port, text), 120)
                out[name] = (whole, streamed)
            out["afterwards"] = (await wy.synthesize(port, "Still here."), None)
        return out

    results = run_main(main)
    for name, (_text, code) in GARBAGE.items():
        whole, streamed = results[name]
        if code is None:
            assert whole.types[-1] == "audio-stop", (name, whole.types[-3:], whole.error())
            assert whole.samples > 0, name
            assert streamed.types[-1] == "synthesize-stopped", (name, streamed.error())
            assert streamed.samples > 0, name
        elif code == SILENCE:
            # Home Assistant builds its WAV from audio-start: an empty block, never zero bytes.
            assert whole.types == ["audio-start", "audio-stop"], (name, whole.types)
            assert streamed.types[0] == "audio-start", (name, streamed.types)
            assert streamed.types[-2:] == ["audio-stop", "synthesize-stopped"], name
            assert streamed.samples == 0, name
        else:
            assert whole.error() is not None and whole.error().code == code, (name, whole.types)
            assert streamed.error() is not None and streamed.error().code == code, name
    assert results["afterwards"][0].types[-1] == "audio-stop"
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, logged[:3]


def run_main(main: Any) -> Any:
    return asyncio.run(main())


def test_error_text_with_lone_surrogates_still_reaches_the_client(wy: SimpleNamespace) -> None:
    """An error message quoting the client's text must itself be sendable (UTF-8 encodable)."""

    async def main() -> Any:
        async with wy.fake_server() as srv:
            return await _whole(wy, srv.port, "x", {"name": "\ud800evil"})

    reply = asyncio.run(main())
    assert reply.error() is not None and reply.error().code == "VoiceNotFoundError"
