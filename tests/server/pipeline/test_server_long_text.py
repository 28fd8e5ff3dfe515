"""Long announcements through the real server: a text at the default limit plays completely,
its first sentence reaches the engine before the rest is split, and one character over the
limit is a clear error on every path (Wyoming synthesize, a growing stream, HTTP).

The engine is the fake one (conftest) with fewer samples per character, so 20,000 characters
of text are a few hundred audio events. How much of the text the splitter and the language
detection had seen when the engine got its first sentence is recorded: that, not a clock,
shows the first audio does not wait for the whole text.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import TINY_MODEL, FakeEngine, SimpleSplitter, event_bytes, free_port, read_until
from wyoming.event import Event

from wyoming_cosyvoice.pipeline import sentences as sentences_module

LIMIT = 20_000  # the documented size of a long announcement: the default limit holds it


def run(coro: Any) -> Any:
    return asyncio.run(coro)


class Progress:
    """How far the text's splitting and language detection had got, and when the engine
    first asked for a sentence."""

    def __init__(self) -> None:
        self.fed = 0  # characters given to the splitters
        self.detected = 0  # characters the language detection looked at
        self.at_first_call: tuple[int, int] | None = None
        self.lock = threading.Lock()

    def splitter(self) -> SimpleSplitter:
        progress = self

        class CountingSplitter(SimpleSplitter):
            def feed(self, fragment: str) -> list[str]:
                progress.fed += len(fragment)
                return super().feed(fragment)

        return CountingSplitter()

    def engine(self, path: Path, threads: int | None) -> FakeEngine:
        progress = self

        class QuickEngine(FakeEngine):
            SAMPLES_PER_CHAR = 20  # 20,000 characters: a few hundred audio events

            def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
                with progress.lock:
                    if progress.at_first_call is None:
                        progress.at_first_call = (progress.fed, progress.detected)
                return super().synthesize(text, options, cancel)

        return QuickEngine(path, threads, delay=0.0)


@pytest.fixture
def progress(monkeypatch: pytest.MonkeyPatch) -> Progress:
    made = Progress()
    detect = sentences_module.detect_language

    def counting_detect(text: str) -> str:
        made.detected += len(text)
        return detect(text)

    monkeypatch.setattr(sentences_module, "detect_language", counting_detect)
    return made


@contextlib.asynccontextmanager
async def long_text_server(progress: Progress, **overrides: Any) -> AsyncIterator[Any]:
    """The real Wyoming server with the default limits (only the port and warm-up set)."""
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.wyoming.server import create_server

    port = free_port()
    settings = {"server.uri": f"tcp://127.0.0.1:{port}", "server.warmup": False, **overrides}
    config = load_config(None, settings.items())
    running = await create_server(config, TINY_MODEL, engine_factory=progress.engine,
                                  splitter_factory=progress.splitter)  # fmt: skip
    try:
        await asyncio.wait_for(asyncio.shield(running.load_task), 10)
        yield SimpleNamespace(port=port, running=running, config=config)
    finally:
        await running.stop()


def announcement(chars: int, template: str = "Notice {i}: item {i} is ready at gate {i}. ") -> str:
    """Distinct sentences (so none is a repeat) cut to exactly ``chars`` characters."""
    parts, length, i = [], 0, 0
    while length < chars:
        parts.append(template.format(i=i))
        length += len(parts[-1])
        i += 1
    return "".join(parts)[:chars]


def reference_sentences(text: str) -> list[str]:
    """The test splitter's cut of the whole text at once."""
    splitter = SimpleSplitter()
    return [*splitter.feed(text), *splitter.flush()]


def expected_samples(sentences: list[str]) -> int:
    return sum(len(s) * 20 for s in sentences)


def engine_texts(server: Any) -> list[str]:
    return [call.text for call in server.running.scheduler.engine.calls]


def first_call_saw_little(progress: Progress, text: str) -> None:
    assert progress.at_first_call is not None
    fed, detected = progress.at_first_call
    assert fed < len(text) // 10, f"the splitter had {fed} of {len(text)} characters"
    assert detected < len(text) // 4, f"language detection had seen {detected} characters"


# --- a long text plays completely, its first sentence first -----------------------------


def test_a_20000_character_synthesize_plays_every_sentence(progress: Progress) -> None:
    text = announcement(LIMIT)
    sentences = reference_sentences(text)

    async def main() -> tuple[Any, list[str]]:
        async with long_text_server(progress) as srv:
            from conftest import synthesize

            reply = await synthesize(srv.port, text)
            return reply, engine_texts(srv)

    reply, spoken = run(main())
    assert reply.error() is None and reply.types[-1] == "audio-stop"
    assert spoken == sentences and len(sentences) > 300
    assert reply.samples == expected_samples(sentences)
    assert progress.fed == len(text)  # all of it was split in the end
    first_call_saw_little(progress, text)


def test_a_20000_character_stream_speaks_before_most_of_it_is_sent(progress: Progress) -> None:
    text = announcement(LIMIT)
    sentences = reference_sentences(text)
    fragments = [text[i : i + 100] for i in range(0, len(text), 100)]

    async def main() -> tuple[Any, list[str], int]:
        async with long_text_server(progress) as srv:
            from conftest import connect

            async with connect(srv.port) as client:
                await client.write_event(Event("synthesize-start", {}))
                for fragment in fragments[:10]:
                    await client.write_event(Event("synthesize-chunk", {"text": fragment}))
                # Audio comes while 95 % of the text has not even been sent.
                head = await read_until(client, ("audio-chunk",))
                sent = 10
                for fragment in fragments[10:]:
                    await client.write_event(Event("synthesize-chunk", {"text": fragment}))
                    sent += 1
                await client.write_event(Event("synthesize", {"text": text}))  # HA's copy
                await client.write_event(Event("synthesize-stop"))
                rest = await read_until(client, ("synthesize-stopped", "error"))
            head.events += rest.events
            return head, engine_texts(srv), sent

    reply, spoken, sent = run(main())
    assert sent == len(fragments) and reply.error() is None
    assert reply.types[-1] == "synthesize-stopped"
    assert spoken == sentences
    assert [len(block) // 2 for block in reply.blocks()] == [len(s) * 20 for s in sentences]


def test_a_20000_character_chinese_text_in_ascii_escaped_json_plays(progress: Progress) -> None:
    """Each character as a \\uXXXX escape, six bytes of data: the text limit decides, not the
    size limit of other events' data blocks."""
    text = announcement(LIMIT, "第{i}号通知：下午三点在第{i}会议室开会，请准时参加。")
    sentences = reference_sentences(text)

    async def main() -> tuple[list[Event], list[str]]:
        async with long_text_server(progress) as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(event_bytes("synthesize", {"text": text}))  # json.dumps: ASCII only
            await writer.drain()
            from wyoming.event import async_read_event

            events: list[Event] = []
            while (event := await asyncio.wait_for(async_read_event(reader), 30)) is not None:
                events.append(event)
                if event.type in ("audio-stop", "error"):
                    break
            writer.close()
            return events, engine_texts(srv)

    from wyoming_cosyvoice.config import load_config

    events, spoken = run(main())
    data_block = len(event_bytes("synthesize", {"text": text}).split(b"\n", 1)[1])
    assert data_block > load_config().limits.max_data_bytes  # bigger than other events may be
    assert [e.type for e in events if e.type in ("error", "audio-stop")] == ["audio-stop"]
    assert spoken == sentences


# --- one character over the limit: a clear error -----------------------------------------


def test_a_synthesize_over_the_limit_gets_an_error(progress: Progress) -> None:
    async def main() -> Any:
        async with long_text_server(progress) as srv:
            from conftest import synthesize

            return await synthesize(srv.port, announcement(LIMIT + 1)), srv.running.scheduler

    reply, scheduler = run(main())
    error = reply.error()
    assert error is not None and error.code == "LimitExceededError"
    assert f"{LIMIT + 1} characters" in error.text and str(LIMIT) in error.text
    assert not scheduler.engine.calls  # refused before anything was spoken


def test_a_stream_that_grows_over_the_limit_gets_an_error(progress: Progress) -> None:
    text = announcement(LIMIT + 1)

    async def main() -> Any:
        async with long_text_server(progress) as srv:
            from conftest import connect

            async with connect(srv.port) as client:
                await client.write_event(Event("synthesize-start", {}))
                for start in range(0, len(text), 1000):
                    chunk = {"text": text[start : start + 1000]}
                    await client.write_event(Event("synthesize-chunk", chunk))
                reply = await read_until(client, ("error", "synthesize-stopped"))
                closed = await asyncio.wait_for(client.read_event(), 10) is None
            return reply, closed

    reply, closed = run(main())
    error = reply.error()
    assert error is not None and error.code == "LimitExceededError"
    assert f"{LIMIT + 1} characters" in error.text and str(LIMIT) in error.text
    assert closed  # older Home Assistant ignores the error: the close ends its wait


def test_http_over_the_limit_is_413_and_at_the_limit_streams(
    progress: Progress, monkeypatch: pytest.MonkeyPatch
) -> None:
    import test_http

    monkeypatch.setattr(test_http, "SimpleSplitter", progress.splitter)
    text = announcement(LIMIT)
    sentences = reference_sentences(text)
    with test_http.BackgroundServer(wyoming=False, engine_factory=progress.engine) as srv:
        with srv.client() as http:
            for path, field in (("/tts", "text"), ("/v1/audio/speech", "input")):
                too_long = http.post(path, json={field: announcement(LIMIT + 1)})
                assert too_long.status_code == 413, too_long.text
                problem = too_long.json()["error"]
                assert problem["code"] == "text_too_long"
                assert f"{LIMIT + 1} characters" in problem["message"]
            assert not srv.engines[0].calls
            body = {"text": text, "stream": True, "format": "pcm"}
            with http.stream("POST", "/tts", json=body) as response:
                assert response.status_code == 200
                pcm = b"".join(response.iter_bytes())
        spoken = [call.text for call in srv.engines[0].calls]
    assert spoken == sentences
    assert len(pcm) == 2 * expected_samples(sentences)
    first_call_saw_little(progress, text)


@pytest.mark.long
def test_a_long_text_asked_for_as_one_wav_is_not_held_in_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A whole file's audio waits on disk past a small spool: the server's memory peak while
    answering stays a fraction of the file (holding it, as a list and its join, takes twice
    the file or more)."""
    import tracemalloc

    import test_http

    from wyoming_cosyvoice.http import stream

    monkeypatch.setattr(stream, "SPOOL_MEMORY_BYTES", 1 << 20)
    text = announcement(LIMIT)
    sentences = reference_sentences(text)
    pcm_bytes = 2 * sum(FakeEngine.expected_samples(s) for s in sentences)
    engine = lambda path, threads: FakeEngine(path, threads, delay=0.0)  # noqa: E731
    # cache off: it would hold the sentences' audio itself
    with test_http.BackgroundServer(
        {"cache.max_mb": 0}, wyoming=False, engine_factory=engine
    ) as srv:
        with srv.client() as http:
            tracemalloc.start()
            try:
                with http.stream("POST", "/tts", json={"text": text}) as response:
                    assert response.status_code == 200
                    length = int(response.headers["content-length"])
                    head, received = b"", 0
                    for part in response.iter_bytes():
                        head = head or part[:44]
                        received += len(part)
                _, peak = tracemalloc.get_traced_memory()
            finally:
                tracemalloc.stop()
    assert received == length == 44 + pcm_bytes > 16 << 20
    assert int.from_bytes(head[40:44], "little") == pcm_bytes  # the WAV's real data size
    assert peak < pcm_bytes // 4, f"peak {peak >> 20} MiB for {pcm_bytes >> 20} MiB of audio"
