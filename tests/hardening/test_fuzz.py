"""Fuzzing the Wyoming side with hypothesis: bounded, deterministic, under ~30 s.

Two levels:
- the event reader alone gets arbitrary bytes and arbitrary JSON headers: it may only return
  events, ``None`` or raise the documented ``ClientError``/``IncompleteReadError`` — this is
  how the deep-nesting and digit-limit bugs were found;
- the real server (fake engine) gets random event sequences over TCP: every connection ends
  (no hang), what comes back is well formed (error last, audio blocks not interleaved),
  ``describe`` still answers afterwards, and nothing is logged at ERROR or reaches the
  event loop's exception handler.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from wyoming.event import Event, async_read_event, async_write_event

from wyoming_cosyvoice.errors import ClientError
from wyoming_cosyvoice.wyoming.protocol import read_event

LIMIT = 4096

# --- the reader alone ------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
length_values = st.one_of(
    st.integers(-10, 300), st.integers(), st.floats(), st.text(max_size=5), st.booleans(), st.none()
)


@st.composite
def framed(draw: st.DrawFn) -> bytes:
    """A header that is JSON, with plausible or hostile fields, then some bytes."""
    head: dict[str, Any] = {}
    if draw(st.booleans()):
        head["type"] = draw(st.sampled_from(["describe", "synthesize", "x"]) | json_values)
    if draw(st.booleans()):
        head["data"] = draw(json_values)
    for key in ("data_length", "payload_length"):
        if draw(st.booleans()):
            head[key] = draw(length_values)
    line = json.dumps(head, allow_nan=True).encode() + b"\n"
    return line + draw(st.binary(max_size=400))


def _read_all(data: bytes) -> list[Event]:
    async def main() -> list[Event]:
        reader = asyncio.StreamReader(limit=LIMIT)
        reader.feed_data(data)
        reader.feed_eof()
        events: list[Event] = []
        while True:
            try:
                event = await read_event(
                    reader, max_header_bytes=LIMIT, max_data_bytes=LIMIT, max_payload_bytes=LIMIT
                )
            except (ClientError, asyncio.IncompleteReadError):
                return events  # the documented failures: the server turns them into an error
            if event is None:
                return events
            assert isinstance(event.type, str) and event.type
            assert isinstance(event.data, dict)
            assert event.payload is None or len(event.payload) <= LIMIT
            events.append(event)

    return asyncio.run(main())


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=600), framed(), st.lists(framed(), max_size=4).map(b"".join)))
def test_the_reader_only_fails_the_documented_ways(data: bytes) -> None:
    _read_all(data)


def test_the_reader_survives_the_known_parser_bombs() -> None:
    assert _read_all(b"[" * 3000 + b"\n") == []  # RecursionError before the fix
    assert _read_all(b'{"type": "x", "data_length": ' + b"9" * 4400 + b"}\n") == []  # ValueError


# --- the whole server ----------------------------------------------------------------------------


class _ErrorLog(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))


class ServerThread:
    """The in-process server (fake engine) on its own event loop, for a whole hypothesis run."""

    def __init__(self, wy: SimpleNamespace, overrides: dict[str, Any]) -> None:
        self.wy, self.overrides = wy, overrides
        self.port = 0
        self.loop_errors: list[str] = []
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.failure: BaseException | None = None

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.set_exception_handler(lambda _loop, ctx: self.loop_errors.append(str(ctx)))
        self._stop = asyncio.Event()
        engine = lambda p, t: self.wy.FakeEngine(p, t, delay=0.0005)  # noqa: E731
        try:
            async with self.wy.fake_server(self.overrides, engine=engine) as srv:
                self.port = srv.port
                self._ready.set()
                await self._stop.wait()
        except BaseException as err:  # reported to the test thread
            self.failure = err
            self._ready.set()

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(20) and self.failure is None, self.failure
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(20)
        assert not self._thread.is_alive()


# Texts stay short (fast fake audio) and avoid the fake engine's failure triggers.
good_texts = st.sampled_from(
    ["Hello there. How are you?", "a\udfffb.", "😀 ok.", "\x00\x1b[31m hi", "你好。", "Wait, "]
)
texts = good_texts | st.text(max_size=40).filter(lambda t: "CRASH" not in t and "FAIL" not in t)
voices = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {},
        optional={
            "name": st.sampled_from(["zh-female", "en-male", "../../etc/passwd", "nobody", ""])
            | json_values,
            "language": st.sampled_from(["en_US", "zh", "xx"]) | json_values,
            "speaker": st.sampled_from(["中文女", "x"]) | json_values,
        },
    ),
    json_values,
)


@st.composite
def events(draw: st.DrawFn) -> Event:
    kind = draw(
        st.sampled_from(
            [
                "describe",
                "synthesize",
                "synthesize-start",
                "synthesize-chunk",
                "synthesize-stop",
                "audio-chunk",
                "ping",
                "transcribe",
            ]  # fmt: skip
        )
        | st.text(min_size=1, max_size=12)
    )
    data: dict[str, Any] = {}
    if draw(st.booleans()):
        data["text"] = draw(texts | json_values)
    if draw(st.booleans()):
        data["voice"] = draw(voices)
    payload = draw(st.none() | st.binary(min_size=1, max_size=64))
    return Event(kind, data, payload)


# Well-formed events, so random sequences also reach real synthesis and streaming.
plausible = st.one_of(
    st.builds(lambda t: Event("synthesize", {"text": t}), good_texts),
    st.just(Event("synthesize-start")),
    st.builds(lambda t: Event("synthesize-chunk", {"text": t}), good_texts),
    st.just(Event("synthesize-stop")),
    st.just(Event("describe")),
)


async def _converse(port: int, sequence: list[Event], close_early: bool) -> list[Event]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    received: list[Event] = []
    try:
        for event in sequence:
            # Framed by hand with ensure_ascii: lone surrogates travel as \ud800 escapes.
            block = json.dumps(event.data).encode()
            head = {"type": event.type, "data_length": len(block)}
            if event.payload:
                head["payload_length"] = len(event.payload)
            writer.write(json.dumps(head).encode() + b"\n" + block + (event.payload or b""))
        await writer.drain()
        if close_early:
            writer.write_eof()  # the client leaves: what it asked for is cancelled
        # Else the server closes once everything asked for is said and it has been idle
        # (idle_timeout_s): the whole reply is read.
        while (event := await asyncio.wait_for(async_read_event(reader), 10)) is not None:
            received.append(event)
    finally:
        writer.close()
    return received


def _check_reply(received: list[Event]) -> None:
    types = [e.type for e in received]
    if "error" in types:
        assert types.index("error") == len(types) - 1, types  # the error is the last word
        assert received[-1].data.get("code") and received[-1].data.get("text")
    open_block = False
    for kind in types:
        if kind == "audio-start":
            assert not open_block, types
            open_block = True
        elif kind == "audio-stop":
            assert open_block, types
            open_block = False
        elif kind == "audio-chunk":
            assert open_block, types


async def _describe(port: int) -> str:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await async_write_event(Event("describe"), writer)
        event = await asyncio.wait_for(async_read_event(reader), 5)
    finally:
        writer.close()
    return event.type if event is not None else "closed"


@pytest.fixture
def fuzz_server(wy: SimpleNamespace) -> Iterator[tuple[ServerThread, _ErrorLog]]:
    log = _ErrorLog()
    logger = logging.getLogger()
    logger.addHandler(log)
    limits = {"limits.max_text_chars": 120, "limits.max_events_per_connection": 20,
              "limits.idle_timeout_s": 0.2}  # fmt: skip
    try:
        with ServerThread(wy, limits) as server:
            yield server, log
    finally:
        logger.removeHandler(log)


@pytest.mark.long
def test_random_event_sequences_never_hurt_the_server(
    fuzz_server: tuple[ServerThread, _ErrorLog],
) -> None:
    server, log = fuzz_server

    @settings(
        max_examples=80,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        database=None,
    )
    @given(
        sequence=st.lists(plausible | events(), min_size=1, max_size=8), close_early=st.booleans()
    )
    def one(sequence: list[Event], close_early: bool) -> None:
        received = asyncio.run(_converse(server.port, sequence, close_early))
        _check_reply(received)
        seen.update(e.type for e in received)

    seen: set[str] = set()
    one()
    # The fuzz reached both the refusals and real synthesis, not just one of them.
    assert {"error", "audio-chunk", "info"} <= seen, seen
    assert asyncio.run(_describe(server.port)) == "info"
    assert log.records == [], log.records[:3]
    assert server.loop_errors == [], server.loop_errors[:3]
