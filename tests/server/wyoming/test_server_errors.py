"""Every refused request gets ``error{text, code}`` and a closed connection.

Old Home Assistant ignores ``error`` and has no timeout, so the close is what ends its wait;
every case therefore also checks that the server closed the connection, and that a client
talking to the server at the same time still gets its full audio.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import event_bytes as header
from wyoming.event import Event, async_read_event


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def raw_exchange(port: int, payload: bytes, timeout: float = 10.0) -> list[Event]:
    """Send raw bytes, then read events until the server closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    events: list[Event] = []
    try:
        while (event := await asyncio.wait_for(async_read_event(reader), timeout)) is not None:
            events.append(event)
    finally:
        writer.close()
    return events


START = header("synthesize-start")
STOP = header("synthesize-stop")
CHUNK = header("synthesize-chunk", {"text": "Hello there. "})

# name -> (bytes sent, expected error code)
BAD_INPUT: dict[str, tuple[bytes, str]] = {
    "unknown voice": (
        header("synthesize", {"text": "Hi.", "voice": {"name": "nobody"}}),
        "VoiceNotFoundError",
    ),
    "unknown speaker": (
        header("synthesize", {"text": "Hi.", "voice": {"name": "zh-female", "speaker": "x"}}),
        "VoiceNotFoundError",
    ),
    "unknown language": (
        header("synthesize", {"text": "Hi.", "voice": {"language": "fr_FR"}}),
        "VoiceNotFoundError",
    ),
    "text too long": (header("synthesize", {"text": "a" * 201}), "LimitExceededError"),
    "stream too long": (
        START + header("synthesize-chunk", {"text": "a" * 150}) * 2,
        "LimitExceededError",
    ),
    "header not json": (b"this is not json\n", "ProtocolError"),
    "json not an object": (b"[1, 2, 3]\n", "ProtocolError"),
    "no type": (b'{"data": {}}\n', "ProtocolError"),
    "data not an object": (b'{"type": "synthesize", "data": [1]}\n', "ProtocolError"),
    "data block not json": (b'{"type": "synthesize", "data_length": 3}\nabc', "ProtocolError"),
    "binary garbage": (bytes(range(256)) + b"\n", "ProtocolError"),
    "synthesize without text": (
        header("synthesize", {"voice": {"name": "zh-female"}}),
        "ProtocolError",
    ),
    "text not a string": (header("synthesize", {"text": 42}), "ProtocolError"),
    "voice is a string": (
        header("synthesize", {"text": "Hi.", "voice": "zh-female"}),
        "ProtocolError",
    ),
    "voice is a list": (
        header("synthesize", {"text": "Hi.", "voice": ["zh-female"]}),
        "ProtocolError",
    ),
    "voice name not a string": (
        header("synthesize", {"text": "Hi.", "voice": {"name": 3}}),
        "ProtocolError",
    ),
    "negative data_length": (b'{"type": "describe", "data_length": -5}\n', "ProtocolError"),
    "enormous payload_length": (
        b'{"type": "audio-chunk", "payload_length": 99999999999}\n',
        "LimitExceededError",
    ),
    "data_length not a number": (b'{"type": "describe", "data_length": "12"}\n', "ProtocolError"),
    "header line too long": (
        b'{"type": "describe", "x": "' + b"a" * 5000 + b'"}\n',
        "LimitExceededError",
    ),
    "chunk without start": (CHUNK, "StreamStateError"),
    "two starts": (START + START, "StreamStateError"),
    "stop without start": (STOP, "StreamStateError"),
    "too many events": (header("describe") * 30, "LimitExceededError"),
}
LIMITS = {
    "limits.max_text_chars": 200,
    "limits.max_header_bytes": 4096,
    "limits.max_events_per_connection": 25,
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_gets_an_error_and_a_close(wy: SimpleNamespace, case: str) -> None:
    payload, code = BAD_INPUT[case]

    async def main() -> tuple[list[Event], Any]:
        async with wy.fake_server(LIMITS) as srv:
            good = asyncio.create_task(wy.synthesize(srv.port, "A good client is unaffected."))
            events = await raw_exchange(srv.port, payload)
            return events, await good

    events, good = run(main())
    errors = [e for e in events if e.type == "error"]
    assert len(errors) == 1, [e.type for e in events]
    assert events[-1].type == "error"  # nothing after the error: then the close
    assert errors[0].data["code"] == code, errors[0].data
    assert len(errors[0].data["text"]) > 10
    assert good.types[-1] == "audio-stop"
    assert good.samples == wy.FakeEngine.expected_samples("A good client is unaffected.")


NOTHING_TO_SPEAK = {"empty": "", "blank": "   \n ", "punctuation": "?!...", "emoji": "😀🎉"}


@pytest.mark.parametrize("text", list(NOTHING_TO_SPEAK.values()), ids=list(NOTHING_TO_SPEAK))
def test_nothing_to_speak_is_an_empty_audio_block(wy: SimpleNamespace, text: str) -> None:
    """Home Assistant writes its WAV header at the first audio-start: with no audio-start, a
    text with nothing to speak would reach it as zero bytes instead of an empty WAV."""

    async def main() -> tuple[Any, Any, Any]:
        async with wy.fake_server(LIMITS) as srv:
            whole = await wy.synthesize(srv.port, text)
            streamed = await wy.stream(srv.port, text)
            after = await wy.stream(srv.port, "Still speaking.")
            return whole, streamed, after

    whole, streamed, after = run(main())
    assert whole.types == ["audio-start", "audio-stop"]
    assert streamed.types == ["audio-start", "audio-stop", "synthesize-stopped"]
    assert whole.events[0].data["rate"] == 22050 and whole.events[0].data["width"] == 2
    assert after.samples == wy.FakeEngine.expected_samples("Still speaking.")


def test_a_stream_with_only_some_silent_fragments_gets_no_extra_block(
    wy: SimpleNamespace,
) -> None:
    async def main() -> Any:
        async with wy.fake_server(LIMITS) as srv:
            return await wy.stream(srv.port, "😀 Hello there. 🎉")

    reply = run(main())
    assert reply.types.count("audio-start") == 1 and reply.samples > 0


# name -> (bytes sent, words the log line must contain)
REFUSED_STREAMS: dict[str, tuple[bytes, str]] = {
    "unknown voice": (
        header("synthesize-start", {"voice": {"name": "nobody"}})
        + header("synthesize-chunk", {"text": "Hello there."})
        + header("synthesize-stop"),
        "unknown voice 'nobody'",
    ),
    "text too long": (
        START + header("synthesize-chunk", {"text": "a" * 150}) * 2,
        "over the limit of 200",
    ),
}


@pytest.mark.parametrize("case", list(REFUSED_STREAMS))
def test_a_refused_stream_is_logged_as_a_warning_with_its_reason(
    wy: SimpleNamespace, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Home Assistant ignores error events while streaming: its user hears silence, and the
    add-on log is the only place that says why."""
    payload, reason = REFUSED_STREAMS[case]
    caplog.set_level(logging.INFO, logger="wyoming_cosyvoice")

    async def main() -> list[Event]:
        async with wy.fake_server(LIMITS) as srv:
            return await raw_exchange(srv.port, payload)

    events = run(main())
    assert events[-1].type == "error"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(reason in message for message in warnings), caplog.text


def test_lying_data_length_waits_then_the_client_leaves(wy: SimpleNamespace) -> None:
    """A data_length larger than what follows cannot be told from a slow client: the server
    waits for the bytes and forgets the connection when the client goes."""

    async def main() -> list[str]:
        async with wy.fake_server(LIMITS) as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(b'{"type": "synthesize", "data_length": 1000}\n{"text": "Hi."}')
            await writer.drain()
            await wy.until(lambda: srv.running.handlers, "the server serves the connection")
            writer.close()
            await wy.until(lambda: not srv.running.handlers, "the server forgets the connection")
            reply = await wy.synthesize(srv.port, "Still fine.")
            return reply.types, [call.text for call in srv.engines[0].calls]

    types, spoken = run(main())
    assert types[-1] == "audio-stop" and spoken == ["Still fine."]


def test_unknown_events_are_ignored(wy: SimpleNamespace) -> None:
    async def main() -> list[str]:
        async with wy.fake_server() as srv:
            payload = (
                header("select-program", {"name": "cosyvoice"})
                + header("ping")
                + header("describe")
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(payload)
            event = await asyncio.wait_for(async_read_event(reader), 5)
            writer.close()
            return [event.type] if event else []

    assert run(main()) == ["info"]


def test_too_many_connections(wy: SimpleNamespace) -> None:
    async def main() -> tuple[list[Event], Any]:
        async with wy.fake_server({"limits.max_connections": 1}) as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            await wy.until(lambda: srv.running.handlers, "the server serves the connection")
            refused = await raw_exchange(srv.port, header("describe"))
            writer.close()
            await wy.until(lambda: not srv.running.handlers, "the server forgets both")
            return refused, await wy.synthesize(srv.port, "Room again.")

    refused, later = run(main())
    assert [e.type for e in refused] == ["error"]
    assert refused[0].data["code"] == "ServerBusyError"
    assert later.types[-1] == "audio-stop"


def test_idle_connection_is_closed(wy: SimpleNamespace) -> None:
    async def main() -> list[Event]:
        async with wy.fake_server({"limits.idle_timeout_s": 0.3}) as srv:
            return await raw_exchange(srv.port, b"", timeout=5)

    events = run(main())
    assert [e.type for e in events] == ["error"] and "no request" in events[0].data["text"]


@pytest.mark.parametrize(
    "payload",
    [START + CHUNK, START + header("synthesize-chunk", {"text": "a" * 201})],
    ids=["idle open stream", "stream over the text limit"],
)
def test_a_stream_refused_while_open_leaves_no_task_behind(
    wy: SimpleNamespace, payload: bytes
) -> None:
    """Its speech, which waits for more of the stream, ends with the connection."""

    def speeches() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks() if t.get_name().startswith("speech for")]

    async def main() -> list[str]:
        async with wy.fake_server({"limits.idle_timeout_s": 0.3}) as srv:
            events = await raw_exchange(srv.port, payload)
            await wy.until(lambda: not srv.running.handlers, "the server forgets the connection")
            await wy.until(lambda: not speeches(), "no speech task is left")
            return [e.type for e in events]

    assert run(main())[-1] == "error"


def test_a_slow_open_stream_is_not_idle_while_audio_is_owed(wy: SimpleNamespace) -> None:
    """Idle means nothing asked and nothing owed: a long synthesis is never cut."""

    async def main() -> Any:
        engine = lambda p, t: wy.FakeEngine(p, t, delay=0.05)  # noqa: E731
        async with wy.fake_server({"limits.idle_timeout_s": 0.3}, engine=engine) as srv:
            return await wy.synthesize(srv.port, "A sentence that takes a while to say out loud.")

    assert run(main()).types[-1] == "audio-stop"


STALL_LIMITS = {
    "limits.max_buffered_audio_s": 0.5,
    "limits.max_text_chars": 20000,
    "cache.max_mb": 0,  # its repeated sentence reaches the engine every time
}
STALLED_TEXT = "Word word word word. " * 500  # 210 s of fake audio, more than socket buffers hold


async def _send_unread(port: int) -> asyncio.StreamWriter:
    """A client that asks for STALLED_TEXT and reads nothing (a small receive buffer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(header("synthesize", {"text": STALLED_TEXT}))
    await writer.drain()
    return writer


def test_a_client_that_stops_reading_blocks_nobody(wy: SimpleNamespace) -> None:
    """TCP back-pressure: audio queued for a non-reading client is bounded and waits outside
    the engine, so another client is served while the first one still holds its request."""
    limits = {**STALL_LIMITS, "limits.stall_timeout_s": 120}  # not dropped during the test

    async def main() -> tuple[Any, list[str], int]:
        engine = lambda p, t: wy.FakeEngine(p, t, delay=0.0005)  # noqa: E731
        async with wy.fake_server(limits, engine=engine) as srv:
            outcomes = wy.Outcomes()
            srv.running.scheduler.metrics.subscribe(outcomes)
            writer = await _send_unread(srv.port)
            await wy.until(lambda: srv.engines[0].calls, "the unread request speaks")
            other = await wy.synthesize(srv.port, "Someone else is served meanwhile.")
            ended_meanwhile = list(outcomes.seen)  # the other's "ok" only
            writer.close()
            await wy.until(lambda: not srv.running.handlers, "the server forgets the reader")
            spoken = sum(c.text.startswith("Word") for c in srv.engines[0].calls)
            return other, ended_meanwhile, spoken

    other, ended_meanwhile, spoken = run(main())
    assert other.types[-1] == "audio-stop" and ended_meanwhile == ["ok"]
    assert spoken < 500  # the unread request waited for its reader, it was not spoken to the end


def test_a_client_that_stops_reading_is_dropped(wy: SimpleNamespace) -> None:
    """After ``stall_timeout_s`` without reading, the request is given up and the connection
    closed."""
    limits = {**STALL_LIMITS, "limits.stall_timeout_s": 1.0}

    async def main() -> tuple[list[str], int]:
        engine = lambda p, t: wy.FakeEngine(p, t, delay=0.0005)  # noqa: E731
        async with wy.fake_server(limits, engine=engine) as srv:
            outcomes = wy.Outcomes()
            srv.running.scheduler.metrics.subscribe(outcomes)
            writer = await _send_unread(srv.port)
            await wy.until(lambda: outcomes.seen, "the unread request ends")
            await wy.until(lambda: not srv.running.handlers, "the server closes the connection")
            writer.close()
            spoken = sum(c.text.startswith("Word") for c in srv.engines[0].calls)
            return outcomes.seen, spoken

    outcomes, spoken = run(main())
    assert outcomes == ["stalled"]
    assert spoken < 500  # the stalled request was abandoned, not synthesized to the end
