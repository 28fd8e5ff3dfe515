"""Protocol-level bad input over real TCP, beyond the cases of test_server_errors.py.

Already covered there (each with a concurrent good client): header not JSON, JSON not an
object, no type, data not an object, data block not JSON, binary garbage with a newline,
synthesize without text / text not a string / voice a string or a list / voice.name not a
string, negative data_length, enormous payload_length, data_length not a number, an over-long
header (5 kB against a 4 kB limit), chunk without start, two starts, stop without start, too
many events; plus a lying data_length with the client leaving, unknown events (alone), too many
connections, idle connections and a client that stops reading.

Added here: what a JSON parser can still throw (deep nesting, integers past Python's digit
limit — both were unhandled exceptions with no error event before), the other lengths that lie
(enormous data_length, negative or fractional payload_length, NaN, lengths larger than what
follows and then a half-close), a real 10 MB header line and 1 MB of newline-free garbage at
the default limits, invalid UTF-8, unknown events carrying a payload. Every case runs while a
*streaming* good client is mid-request on another connection, and no case may log an error.
"""

from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import event_bytes as header
from wyoming.event import Event, async_read_event


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def raw_exchange(port: int, payload: bytes, timeout: float = 15.0) -> list[Event]:
    """Send raw bytes and half-close, then read events until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        await writer.drain()
        writer.write_eof()
        events: list[Event] = []
        while (event := await asyncio.wait_for(async_read_event(reader), timeout)) is not None:
            events.append(event)
        return events
    finally:
        writer.close()


def _garbage(size: int) -> bytes:
    return random.Random(7).randbytes(size).replace(b"\n", b" ")


TEN_MB = 10 * 1024 * 1024

# name -> (bytes sent, then EOF; expected error code, or None: closed without an event)
CASES: dict[str, tuple[bytes, str | None]] = {
    "deeply nested JSON header": (b"[" * 50_000 + b"\n", "ProtocolError"),
    "deeply nested JSON data block": (
        b'{"type": "synthesize", "data_length": 40000}\n' + b"[" * 40_000,
        "ProtocolError",
    ),
    "integer past the digit limit": (
        b'{"type": "describe", "data_length": ' + b"9" * 5000 + b"}\n",
        "ProtocolError",
    ),
    "enormous data_length": (
        b'{"type": "synthesize", "data_length": 1000000000000000}\n',
        "LimitExceededError",
    ),
    "negative payload_length": (
        b'{"type": "audio-chunk", "payload_length": -1}\n',
        "ProtocolError",
    ),
    "fractional payload_length": (
        b'{"type": "audio-chunk", "payload_length": 1.5}\n',
        "ProtocolError",
    ),
    "NaN data_length": (b'{"type": "describe", "data_length": NaN}\n', "ProtocolError"),
    "boolean data_length": (b'{"type": "describe", "data_length": true}\n', "ProtocolError"),
    "type not a string": (b'{"type": 5}\n', "ProtocolError"),
    "empty header line": (b"\n", "ProtocolError"),
    "invalid UTF-8": (b'{"type": "\xff\xfe"}\n', "ProtocolError"),
    "10 MB header line": (
        b'{"type": "describe", "x": "' + b"a" * TEN_MB + b'"}\n',
        "LimitExceededError",
    ),
    "1 MB of garbage without a newline": (_garbage(1 << 20), "LimitExceededError"),
    "header cut mid-line": (b'{"type": "synth', "ProtocolError"),
    # A length larger than what follows looks like a slow client until it hangs up: then the
    # connection is simply forgotten (there is no one left to tell).
    "data_length larger than what follows": (
        b'{"type": "synthesize", "data_length": 1000}\n{"text": "Hi."}',
        None,
    ),
    "payload_length larger than what follows": (
        b'{"type": "audio-chunk", "payload_length": 5000}\n' + b"\0" * 100,
        None,
    ),
}

FIRST = "The good client is connected first."
SECOND = "It still gets all of its audio."


async def good_stream_around(wy: SimpleNamespace, port: int, during: Any) -> tuple[Any, Any]:
    """A streaming client opens its request, ``during`` runs, then the stream completes."""
    async with wy.connect(port) as client:
        await client.write_event(Event("synthesize-start"))
        await client.write_event(Event("synthesize-chunk", {"text": FIRST + " "}))
        result = await during
        await client.write_event(Event("synthesize-chunk", {"text": SECOND}))
        await client.write_event(Event("synthesize-stop"))
        reply = await wy.read_until(client, ("synthesize-stopped", "error"))
    return result, reply


@pytest.mark.parametrize("case", list(CASES))
def test_bad_bytes_get_an_error_while_a_stream_is_served(
    wy: SimpleNamespace, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    payload, code = CASES[case]
    caplog.set_level(logging.INFO)

    async def main() -> tuple[list[Event], Any]:
        async with wy.fake_server() as srv:  # the default limits of config.yaml
            return await good_stream_around(wy, srv.port, raw_exchange(srv.port, payload))

    events, good = run(main())
    if code is None:
        assert events == []
    else:
        assert [e.type for e in events] == ["error"], [e.type for e in events]
        assert events[0].data["code"] == code, events[0].data
        assert len(events[0].data["text"]) > 10
    assert good.types[-1] == "synthesize-stopped"
    assert [len(b) // 2 for b in good.blocks()] == [
        wy.FakeEngine.expected_samples(FIRST),
        wy.FakeEngine.expected_samples(SECOND),
    ]
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, [r.getMessage() for r in logged]


def test_unknown_events_with_payloads_are_skipped_cleanly(wy: SimpleNamespace) -> None:
    """Unknown events are ignored *and* their data/payload consumed, so framing holds."""
    text = "After the noise, speech."
    payload = (
        header("ping", {"x": 1})
        + header("audio-chunk", {"rate": 22050, "width": 2, "channels": 1}, payload_length=4096)
        + b"\x01" * 4096
        + header("run-pipeline", {"start_stage": "asr"})
        + header("x" * 200)
        + header("describe")
        + header("synthesize", {"text": text})
    )

    async def main() -> tuple[list[str], Any, Any]:
        async with wy.fake_server() as srv:

            async def noisy() -> tuple[list[str], Any]:
                reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
                writer.write(payload)
                await writer.drain()
                types: list[str] = []
                audio = b""
                while (event := await asyncio.wait_for(async_read_event(reader), 10)) is not None:
                    types.append(event.type)
                    audio += event.payload or b"" if event.type == "audio-chunk" else b""
                    if event.type == "audio-stop":
                        break
                writer.close()
                return types, audio

            (types, audio), other = await asyncio.gather(
                noisy(), wy.synthesize(srv.port, "Meanwhile, someone else.")
            )
            return types, audio, other

    types, audio, other = run(main())
    assert types[0] == "info" and types[1] == "audio-start" and types[-1] == "audio-stop"
    assert "error" not in types
    assert len(audio) // 2 == wy.FakeEngine.expected_samples(text)
    assert other.samples == wy.FakeEngine.expected_samples("Meanwhile, someone else.")
