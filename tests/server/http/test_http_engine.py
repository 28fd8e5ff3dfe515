"""HTTP API end to end with the real engine on tests/data/tiny_model.

One server (Wyoming listener + HTTP, one scheduler) serves the module. The engine is wrapped to
record, on the engine thread, each chunk it produces; the number of speech tokens is fixed
(``force_tokens``) so every sentence takes the same short time. Streaming is shown by order,
not by wall time: the engine is not allowed to produce its last chunk until the HTTP client has
received audio, so the test can only pass if audio reaches the client while synthesis runs.
"""

from __future__ import annotations

import asyncio
import struct
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fake_surface import FakeSurface
from test_http import BackgroundServer, parse_wav

TOKENS = 80  # 1.6 s of audio per sentence: at least two chunks with the realtime schedule
# The flow makes 22050/256 mel frames per second from 50 tokens per second; HiFT 256 samples each.
SAMPLES = int(TOKENS / 50 * 22050 / 256) * 256


class Recorder:
    """Ordered log shared by the engine thread and the test's client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[Any, ...]] = []
        self.gate: threading.Event | None = None  # armed: hold the engine after its 1st chunk
        self.gate_opened: bool | None = None

    def log(self, *event: Any) -> None:
        with self.lock:
            self.events.append(event)

    def index(self, *prefix: Any) -> list[int]:
        with self.lock:
            return [i for i, e in enumerate(self.events) if e[: len(prefix)] == prefix]


class InstrumentedEngine(FakeSurface):
    """The real engine, recording what it produces and on which thread."""

    def __init__(self, inner: Any, recorder: Recorder) -> None:
        self.inner, self.recorder = inner, recorder
        self.speakers, self.kind = inner.speakers, inner.kind
        self.sample_rate, self.instruction_form = inner.sample_rate, inner.instruction_form

    def warmup(self) -> None:
        self.inner.warmup()

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
        options = replace(options, force_tokens=options.force_tokens or TOKENS)
        rec, gate = self.recorder, self.recorder.gate
        thread = threading.current_thread().name
        rec.log("start", text, thread)
        for i, chunk in enumerate(self.inner.synthesize(text, options, cancel)):
            rec.log("produced", text, i, thread)
            yield chunk
            if gate is not None and i == 0:
                # Runs on the engine thread when the server asks for the next chunk.
                rec.gate_opened = gate.wait(30)
        rec.log("finished", text, thread)


@pytest.fixture(scope="module")
def server() -> Iterator[SimpleNamespace]:
    from engine.cosyvoice1.engine import CosyVoiceEngine

    recorder = Recorder()

    def factory(path: Path, threads: int | None) -> InstrumentedEngine:
        return InstrumentedEngine(CosyVoiceEngine.load(path, threads=threads), recorder)

    # What the engine makes, as it makes it: no loudness gain learnt between requests and no
    # replays from the repeat cache.
    settings = {"server.threads": 1, "server.seed": 0, "server.loudness": None, "cache.max_mb": 0}
    with BackgroundServer(settings, engine_factory=factory, simple_splitter=False) as srv:
        yield SimpleNamespace(srv=srv, rec=recorder, url=srv.url, engines=srv.engines)


def test_wav_from_the_real_engine_is_valid_and_complete(server: SimpleNamespace) -> None:
    body = {"text": "Hello there.", "voice": "en-male", "seed": 5}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        whole = client.post("/tts", json=body)
        assert whole.status_code == 200
        params, pcm = parse_wav(whole.content)
        # force_tokens fixes the length
        assert params.nframes == SAMPLES and any(pcm)
        with client.stream("POST", "/tts", json={**body, "stream": True}) as r:
            streamed = b"".join(r.iter_raw())
    assert struct.unpack_from("<I", streamed, 40)[0] == 0xFFFFFFFF
    assert streamed[44:] == pcm  # same seed, same audio, whether streamed or not


def test_stream_delivers_audio_before_synthesis_ends(server: SimpleNamespace) -> None:
    rec = server.rec
    text = "Streaming starts before the end."
    rec.gate, rec.gate_opened = threading.Event(), None
    received = 0
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            body = {"text": text, "voice": "en-male", "stream": True}
            with client.stream("POST", "/tts", json=body) as r:
                assert r.status_code == 200
                for piece in r.iter_raw():
                    received += len(piece)
                    if received > 44 and not rec.gate.is_set():
                        rec.log("client got audio", received)
                        rec.gate.set()
    finally:
        rec.gate.set()
        rec.gate = None
    assert rec.gate_opened is True, "the client got no audio until synthesis was over"
    got = rec.index("client got audio")[0]
    produced = rec.index("produced", text)
    assert len(produced) >= 2 and produced[0] < got < produced[-1]
    assert got < rec.index("finished", text)[0]
    assert received == 44 + SAMPLES * 2


def test_http_and_wyoming_requests_share_the_engine(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    http_text = ["The web asks first.", "The web asks again."]
    wy_text = ["Wyoming asks too.", "Wyoming asks once more."]
    results: dict[str, Any] = {}

    def over_http() -> None:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            results["http"] = client.post("/tts", json={"text": " ".join(http_text)})

    def over_wyoming() -> None:
        reply = asyncio.run(wy.synthesize(server.srv.wyoming_port, " ".join(wy_text)))
        results["wyoming"] = reply

    threads = [threading.Thread(target=over_http), threading.Thread(target=over_wyoming)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert results["http"].status_code == 200
    _, pcm = parse_wav(results["http"].content)
    assert len(pcm) == 2 * SAMPLES * 2
    reply = results["wyoming"]
    assert reply.types[-1] == "audio-stop" and reply.samples == 2 * SAMPLES
    # One engine, one engine thread, and the FIFO lock per sentence interleaves the two.
    assert len(server.engines) == 1
    starts = [e for e in server.rec.events if e[0] == "start" and e[1] in http_text + wy_text]
    assert {e[2] for e in starts} == {"engine_0"} and len(starts) == 4
    owners = ["http" if e[1] in http_text else "wyoming" for e in starts]
    assert set(owners[:2]) == {"http", "wyoming"}, owners
