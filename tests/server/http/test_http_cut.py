"""An answer cut short never looks whole: the real server of each family stopped by SIGTERM (as
the Supervisor stops the add-on) while it speaks three streamed answers and has a whole one
queued.

* server-sent events end with an ``error`` event, never ``speech.audio.done``;
* chunked WAV and PCM end without the chunked body's terminating chunk (every HTTP client
  reports an incomplete body);
* a whole answer that cannot be finished is a 503 with ``Retry-After``, not a short WAV;
* the server exits 0 and logs each cut at INFO, without Uvicorn's "ASGI callable returned
  without completing response" error.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_process import FAMILIES, WAIT_S, ServerProcess  # noqa: E402

# Sentences long enough to be still speaking when the signal comes (60 s of speech for v1,
# 120 s for CosyVoice2): the signal is sent once each stream's first audio has arrived.
TOKENS = 3000
TEXT = "A sentence that is still being spoken when the server stops."


class Reader(threading.Thread):
    """One request in a thread: its status, headers, the body as far as it came, how it
    ended; ``first`` is set once the first audio has arrived."""

    def __init__(self, srv: ServerProcess, route: str, body: dict[str, Any],
                 audio_in: Callable[[bytes], bool]) -> None:  # fmt: skip
        super().__init__(daemon=True)
        self.srv, self.route, self.body, self.audio_in = srv, route, body, audio_in
        self.first = threading.Event()
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.received = b""
        self.ended: BaseException | None = None

    def run(self) -> None:
        try:
            with self.srv.client() as http, http.stream("POST", self.route, json=self.body) as r:
                self.status, self.headers = r.status_code, dict(r.headers)
                for piece in r.iter_raw():
                    self.received += piece
                    if self.audio_in(self.received):
                        self.first.set()
        except httpx.HTTPError as err:
            self.ended = err
        finally:
            self.first.set()  # the waiter looks at what came

    def events(self) -> list[dict[str, Any]]:
        lines = self.received.decode().splitlines()
        return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def _after_header(size: int) -> Callable[[bytes], bool]:
    return lambda received: len(received) > size


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.long
def test_sigterm_cuts_every_answer_in_a_way_its_client_can_tell(family: str, tmp_path: Path
                                                                ) -> None:  # fmt: skip
    srv = ServerProcess(family, tmp_path, tokens=TOKENS,
                        args=("--parallel-sentences", "3", "--profile", "realtime"))  # fmt: skip
    try:
        srv.wait_ready()
        sse = Reader(srv, "/v1/audio/speech", {"model": "tts-1", "input": TEXT,
                                               "stream_format": "sse"},
                     lambda got: b"speech.audio.delta" in got)  # fmt: skip
        wav = Reader(srv, "/tts", {"text": TEXT, "stream": True}, _after_header(44))
        pcm = Reader(srv, "/v1/audio/speech", {"model": "tts-1", "input": TEXT,
                                               "stream_format": "audio",
                                               "response_format": "pcm"},
                     _after_header(0))  # fmt: skip
        streams = (sse, wav, pcm)
        for reader in streams:
            reader.start()
        for reader in streams:
            assert reader.first.wait(WAIT_S), f"no audio from {reader.route}"
            assert reader.ended is None, reader.ended
        # A whole answer behind them, waiting for one of the three engine slots.
        whole = Reader(srv, "/tts", {"text": TEXT}, _after_header(0))
        whole.start()
        srv.wait_until(lambda: srv.health()["queued"] >= 1, "the whole answer did not queue")
    finally:
        code = srv.stop()
    for reader in (*streams, whole):
        reader.join(WAIT_S)
        assert not reader.is_alive(), f"{reader.route} still reading"
    log = srv.log
    assert code == 0, log[-3000:]

    events = sse.events()
    assert sse.status == 200 and sse.ended is None  # the events say it, not the transport
    assert [e["type"] for e in events[:-1]] == ["speech.audio.delta"] * (len(events) - 1)
    assert events[-1]["type"] == "error", events[-1]
    assert events[-1]["error"]["code"] == "synthesis_cancelled"
    assert "incomplete" in events[-1]["error"]["message"]

    for reader in (wav, pcm):
        assert reader.status == 200
        assert isinstance(reader.ended, httpx.RemoteProtocolError), (reader.route, reader.ended)

    assert whole.status == 503 and whole.headers.get("retry-after") == "5"
    assert json.loads(whole.received)["error"]["code"] == "synthesis_cancelled"

    assert "ASGI callable returned without completing response" not in log, log[-3000:]
    assert "Traceback" not in log and " ERROR " not in log, log[-3000:]
    assert "HTTP event stream ended early: synthesis cancelled" in log
    assert log.count("HTTP stream ended early: synthesis cancelled") == 2, log[-3000:]


def test_an_engine_failure_mid_answer_ends_the_events_with_an_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The fake engine fails after the first chunk of a text with FAIL in it (conftest): the
    events so far, then an ``error`` event; a chunked WAV of the same ends incomplete."""
    from test_http import BackgroundServer

    with BackgroundServer(wyoming=False) as srv, srv.client() as http:
        r = http.post(
            "/v1/audio/speech",
            json={
                "model": "tts-1",
                "stream_format": "sse",
                "input": "This one FAILS after a chunk.",
            },
        )
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data:")]
        with pytest.raises(httpx.RemoteProtocolError):
            with http.stream("POST", "/tts", json={"text": "It FAILS too.", "stream": True}) as wav:
                b"".join(wav.iter_raw())
    assert r.status_code == 200 and events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and "speech.audio.done" not in r.text
    assert events[-1]["error"]["code"] == "synthesis_failed"
    assert "failed on purpose" in events[-1]["error"]["message"]
    errors = [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert errors == ["Synthesis failed mid-stream: EngineError: the fake engine failed on "
                      "purpose"] * 2, errors  # fmt: skip
