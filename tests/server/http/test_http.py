"""HTTP API with the fake engine: formats, every error code, streaming, disconnects.

The server is the real one (scheduler, Wyoming listener, Uvicorn) in a background thread with
its own event loop; the tests are a real HTTP client (httpx) in the test thread. The fake
engine (conftest) makes ``SAMPLES_PER_CHAR`` samples per character, so lengths are exact.
``BackgroundServer`` is imported by the other test_http*.py files.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import struct
import threading
import wave
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TINY_MODEL, FakeEngine, Outcomes, SimpleSplitter, wait_until

from engine.family import DESCRIBED_SPEAKER

RATE = 22050


class BackgroundServer:
    """Wyoming listener (optional) + HTTP API on free ports, in a thread with its own loop."""

    def __init__(self, overrides: dict[str, Any] | None = None, *,
                 engine_factory: Callable[[Path, int | None], Any] | None = None,
                 wyoming: bool = True, wait_ready: bool = True, simple_splitter: bool = True,
                 allow_origins: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.settings = {"server.uri": "tcp://127.0.0.1:0", "server.warmup": False}
        self.settings.update(overrides or {})
        self.engines: list[Any] = []
        self._factory = engine_factory or (lambda path, threads: FakeEngine(path, threads))
        self.wyoming, self.wait_ready, self.simple = wyoming, wait_ready, simple_splitter
        self.allow_origins = allow_origins
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test server")

    def _make_engine(self, path: Path, threads: int | None) -> Any:
        engine = self._factory(path, threads)
        self.engines.append(engine)
        return engine

    async def _start(self) -> None:
        from wyoming_cosyvoice.config import load_config
        from wyoming_cosyvoice.custom_voices.folder import CustomVoices
        from wyoming_cosyvoice.http import start_http, start_model_only
        from wyoming_cosyvoice.pipeline.sentences import make_splitter
        from wyoming_cosyvoice.wyoming.server import create_server

        self.config = load_config(None, self.settings.items())
        splitter = SimpleSplitter if self.simple else make_splitter
        if self.wyoming:
            self.running: Any = await create_server(self.config, TINY_MODEL,
                                                    engine_factory=self._make_engine,
                                                    splitter_factory=splitter)  # fmt: skip
        else:
            self.running = await start_model_only(self.config, TINY_MODEL,
                                                  engine_factory=self._make_engine)  # fmt: skip
        # A voices folder is served as by the CLI: scanned, re-scanned, saved into by the page.
        self.voices = None
        if self.config.voices_dir is not None:
            self.voices = CustomVoices(self.config, self.running.scheduler, TINY_MODEL)
        self.http = await start_http(self.config, self.running.scheduler, "127.0.0.1", 0,
                                     splitter_factory=splitter, allow_origins=self.allow_origins,
                                     custom_voices=self.voices)  # fmt: skip
        if self.voices is not None:
            self.voices.start()
        if self.wait_ready:
            await asyncio.wait_for(asyncio.shield(self.running.load_task), 120)

    async def _stop(self) -> None:
        if self.voices is not None:
            await self.voices.stop()
        await self.http.stop()
        await self.running.stop()

    def call(self, coro: Any, timeout: float = 120) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        try:
            self.call(self._start())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if hasattr(self, "http"):
                self.call(self._stop(), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    @property
    def wyoming_port(self) -> int:
        return int(self.running.port)

    def client(self, timeout: float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)


def parse_wav(data: bytes, rate: int = RATE) -> tuple[wave._wave_params, bytes]:
    """Params and PCM of a complete WAV; checks the RIFF and data sizes are exact."""
    riff, data_size = struct.unpack_from("<I", data, 4)[0], struct.unpack_from("<I", data, 40)[0]
    assert data[:4] == b"RIFF" and data[8:16] == b"WAVEfmt " and data[36:40] == b"data"
    assert riff == len(data) - 8 and data_size == len(data) - 44
    with wave.open(io.BytesIO(data)) as wav:
        params = wav.getparams()
        pcm = wav.readframes(params.nframes)
    assert (params.nchannels, params.sampwidth, params.framerate) == (1, 2, rate)
    assert len(pcm) == params.nframes * 2 == data_size
    return params, pcm


def expected_bytes(*sentences: str) -> int:
    return sum(FakeEngine.expected_samples(s) for s in sentences) * 2


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer({"limits.max_text_chars": 1000}) as running:
        yield running


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with server.client() as http:
        yield http


# --- audio ------------------------------------------------------------------------------------


def test_wav_is_valid_and_complete(client: httpx.Client) -> None:
    r = client.post("/tts", json={"text": "Hello there. Bye now.", "voice": "en-male"})
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert int(r.headers["content-length"]) == len(r.content)
    assert r.headers["x-voice"] == "en-male" and r.headers["x-sample-rate"] == str(RATE)
    _, pcm = parse_wav(r.content)
    assert len(pcm) == expected_bytes("Hello there.", "Bye now.")


def test_streamed_wav_has_open_header_and_the_same_audio(client: httpx.Client) -> None:
    body = {"text": "Hello there. Bye now.", "voice": "en-male", "seed": 3}
    whole = client.post("/tts", json=body).content
    with client.stream("POST", "/tts", json={**body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["transfer-encoding"] == "chunked"
        assert "content-length" not in r.headers
        streamed = b"".join(r.iter_raw())
    assert streamed[:4] == b"RIFF" and struct.unpack_from("<I", streamed, 4)[0] == 0xFFFFFFFF
    assert struct.unpack_from("<I", streamed, 40)[0] == 0xFFFFFFFF
    assert streamed[44:] == whole[44:]


def test_raw_pcm_streamed_and_whole(client: httpx.Client) -> None:
    body = {"text": "Short one.", "speaker": "中文女", "format": "pcm"}
    r = client.post("/tts", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("audio/pcm")
    assert len(r.content) == expected_bytes("Short one.") and r.headers["x-voice"] == "zh-female"
    with client.stream("POST", "/tts", json={**body, "stream": True}) as streamed:
        assert b"".join(streamed.iter_raw()) == r.content


def test_profile_and_seed_reach_the_engine(server: BackgroundServer, client: httpx.Client) -> None:
    r = client.post("/tts", json={"text": "Seeded text.", "profile": "batch", "seed": 42})
    assert r.status_code == 200 and r.headers["x-profile"] == "batch"


def test_voices_and_health(client: httpx.Client) -> None:
    voices = client.get("/voices").json()
    names = [v["name"] for v in voices["voices"]]
    assert "en-male" in names and "zh-female" in names and voices["ready"] is True
    assert set(voices["profiles"]) >= {"realtime", "quality", "batch"}
    assert voices["sample_rate"] == RATE
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ready"
    threads = health.json()["threads"]
    assert threads["configured"] >= 1
    # Tests do not follow the machine's load (conftest); a server does, and reports both.
    assert set(threads) == {"configured", "other_processes_cores", "free_cores"}
    page = client.get("/")
    assert page.status_code == 200 and "<select" in page.text


def test_the_page_has_an_icon(client: httpx.Client) -> None:
    # browsers ask for it on every load: a 404 each time fills logs and consoles
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
    assert icon.text.startswith("<svg") and 'rel="icon" href="favicon.ico"' in client.get("/").text


# --- OpenAI-compatible route ----------------------------------------------------------------


def test_openai_speech_without_stream_format_is_a_whole_wav_file(client: httpx.Client) -> None:
    # What the OpenAI SDK's write_to_file() and a plain curl save: it must carry its real sizes.
    body = {"model": "tts-1", "input": "Hello there. Bye now.", "voice": "en-male"}
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "audio/wav"
    assert "transfer-encoding" not in r.headers
    assert int(r.headers["content-length"]) == len(r.content)
    with wave.open(io.BytesIO(r.content)) as wav:
        assert wav.getnframes() * 2 == len(r.content) - 44 == expected_bytes(
            "Hello there.", "Bye now.")  # fmt: skip
    parse_wav(r.content)  # RIFF and data sizes exact


def test_openai_speech_wav_pcm_and_sse(client: httpx.Client) -> None:
    body = {"model": "tts-1", "input": "Hello there.", "voice": "en-male", "seed": 1}
    whole = client.post("/v1/audio/speech", json=body)
    _, whole_pcm = parse_wav(whole.content)
    streamed = {**body, "stream_format": "audio"}
    with client.stream("POST", "/v1/audio/speech", json=streamed) as wav:
        assert wav.status_code == 200 and wav.headers["transfer-encoding"] == "chunked"
        data = b"".join(wav.iter_raw())
    # only a streamed body has the open-ended header: its length is not known when it starts
    assert struct.unpack_from("<I", data, 4)[0] == struct.unpack_from("<I", data, 40)[0] == (
        0xFFFFFFFF)  # fmt: skip
    assert data[44:] == whole_pcm and len(whole_pcm) == expected_bytes("Hello there.")
    pcm = client.post("/v1/audio/speech", json={**body, "response_format": "pcm"})
    assert pcm.content == whole_pcm and int(pcm.headers["content-length"]) == len(whole_pcm)
    with client.stream("POST", "/v1/audio/speech",
                       json={**streamed, "response_format": "pcm"}) as r:  # fmt: skip
        assert r.headers["transfer-encoding"] == "chunked"
        assert b"".join(r.iter_raw()) == whole_pcm
    sse = client.post("/v1/audio/speech",
                      json={**body, "response_format": "pcm", "stream_format": "sse"})  # fmt: skip
    assert sse.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in sse.text.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done"
    audio = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert {e["type"] for e in events[:-1]} == {"speech.audio.delta"} and audio == whole_pcm


def test_openai_voice_names_fall_back_to_the_texts_language(client: httpx.Client) -> None:
    body = {"model": "tts-1", "input": "你好。", "voice": "alloy"}
    r = client.post("/v1/audio/speech", json=body)
    assert r.status_code == 200 and r.headers["x-voice"].startswith("zh-")


def test_openai_refusals_name_the_field(client: httpx.Client) -> None:
    body = {"model": "tts-1", "input": "Hi.", "voice": "alloy"}
    unknown = client.post("/v1/audio/speech", json={**body, "temperature": 0.5})
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "temperature"
    instructions = client.post("/v1/audio/speech", json={**body, "instructions": "Whisper."})
    assert instructions.json()["error"]["param"] == "instructions"
    assert instructions.json()["error"]["code"] == "instructions_unsupported"
    # clients that always send the field send it empty: nothing is asked, nothing is lost
    assert client.post("/v1/audio/speech", json={**body, "instructions": ""}).status_code == 200


class InstructEngine(FakeEngine):
    """The fake engine as an -Instruct model, keeping each request's options."""

    def __init__(self, model_dir: Path, threads: int | None = None) -> None:
        super().__init__(model_dir, threads)
        self.kind, self.instruction_form = "instruct", DESCRIBED_SPEAKER
        self.options: list[Any] = []

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
        self.options.append(options)
        return super().synthesize(text, options, cancel)


def test_openai_instructions_reach_an_instruct_model() -> None:
    with BackgroundServer(engine_factory=InstructEngine, wyoming=False) as srv:
        with srv.client() as http:
            r = http.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi there.",
                                                    "voice": "en-male",
                                                    "instructions": "Speak slowly."})  # fmt: skip
            assert r.status_code == 200, r.text
    assert [o.instruct for o in srv.engines[0].options] == ["Speak slowly."]


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/tts", b"{not json", 400, "not valid JSON"),
        ("/tts", b"[1, 2]", 400, "JSON object"),
        ("/tts", b"", 400, "JSON body"),
        ("/tts", {"voice": "en-male"}, 400, "'text' is required"),
        ("/tts", {"text": 5}, 400, "'text' must be a string"),
        ("/tts", {"text": "   "}, 400, "'text' is empty"),
        ("/tts", {"text": "?!..."}, 400, "nothing to speak"),
        ("/tts", {"text": "Hi.", "colour": "red"}, 400, "unknown field(s) colour"),
        ("/tts", {"text": "Hi.", "format": "mp3"}, 400, "'wav' or 'pcm'"),
        ("/tts", {"text": "Hi.", "profile": "turbo"}, 400, "unknown profile 'turbo'"),
        ("/tts", {"text": "Hi.", "seed": -1}, 400, "'seed' must be between"),
        ("/tts", {"text": "Hi.", "seed": "7"}, 400, "'seed' must be an integer"),
        ("/tts", {"text": "Hi.", "stream": "yes"}, 400, "'stream' must be true or false"),
        ("/tts", {"text": "Hi.", "voice": "xx-robot"}, 404, "unknown voice 'xx-robot'"),
        ("/tts", {"text": "Hi.", "speaker": "火星人"}, 404, "unknown speaker"),
        ("/tts", {"text": "x" * 1001}, 413, "over the limit of 1000"),
        ("/tts", b'{"text": "' + b"y" * 70000 + b'"}', 413, "request body"),
        ("/v1/audio/speech", {"model": "tts-1", "voice": "alloy"}, 400, "'input' is required"),
        ("/v1/audio/speech", {"input": "Hi.", "response_format": "mp3"}, 400, "'wav' or 'pcm'"),
        ("/v1/audio/speech", {"input": "Hi.", "stream_format": "ws"}, 400, "stream_format"),
        ("/v1/audio/speech", {"input": "Hi.", "speed": 5.0}, 400, "speed"),
        ("/v1/audio/speech", {"input": "Hi.", "voice": "nobody"}, 404, "unknown voice"),
        ("/v1/audio/speech", {"input": "Hi.", "colour": "red"}, 400, "unknown field(s) colour"),
        ("/v1/audio/speech", {"input": "Hi.", "stream": True}, 400, "unknown field(s) stream"),
        (
            "/v1/audio/speech",
            {"input": "Hi.", "instructions": "Whisper."},
            400,
            "'instructions' needs the CosyVoice-300M-Instruct or CosyVoice2-0.5B or "
            "Fun-CosyVoice3-0.5B model",
        ),
        ("/v1/audio/speech", {"input": "Hi.", "instructions": 3}, 400, "must be a string"),
    ],
)
def test_error_codes(client: httpx.Client, path: str, body: Any, status: int, needle: str) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["type"]


def test_unknown_route_and_method_are_json(client: httpx.Client) -> None:
    missing = client.get("/nowhere")
    assert missing.status_code == 404 and "no route /nowhere" in missing.json()["error"]["message"]
    wrong = client.get("/tts")
    assert wrong.status_code == 405 and wrong.json()["error"]["message"]


def test_engine_failures(client: httpx.Client) -> None:
    crash = client.post("/tts", json={"text": "CRASH now."})
    assert crash.status_code == 500 and "RuntimeError" in crash.json()["error"]["message"]
    failed = client.post("/tts", json={"text": "This will FAIL after a chunk."})
    assert failed.status_code == 500 and "failed on purpose" in failed.json()["error"]["message"]
    # Streamed: the status line is already sent; the body is cut (no final chunk).
    with pytest.raises(httpx.RemoteProtocolError):
        with client.stream(
            "POST",
            "/tts",
            json={"text": "It will FAIL soon enough, after a first chunk.", "stream": True},
        ) as r:
            assert r.status_code == 200
            b"".join(r.iter_raw())
    assert client.post("/tts", json={"text": "Still fine."}).status_code == 200


def test_503_while_loading_and_after_a_failed_load() -> None:
    release = threading.Event()

    def slow(path: Path, threads: int | None) -> FakeEngine:
        release.wait(30)
        return FakeEngine(path, threads)

    with BackgroundServer(engine_factory=slow, wait_ready=False, wyoming=False) as srv:
        with srv.client() as http:
            health = http.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "loading"
            r = http.post("/tts", json={"text": "Hi."})
            assert r.status_code == 503 and r.headers["retry-after"] == "5"
            assert "still loading" in r.json()["error"]["message"]
            # the voice list is known before the model has loaded (read from spk2info.pt)
            assert [v["name"] for v in http.get("/voices").json()["voices"]] == [
                "en-male", "zh-female"]  # fmt: skip
            release.set()
            srv.call(asyncio.wait_for(asyncio.shield(srv.running.load_task), 30))
            assert http.get("/health").status_code == 200
            assert http.post("/tts", json={"text": "Hi."}).status_code == 200

    def broken(path: Path, threads: int | None) -> FakeEngine:
        raise RuntimeError("weights are corrupt")

    with BackgroundServer(engine_factory=broken, wait_ready=False, wyoming=False) as srv:
        with srv.client() as http:
            wait_until(lambda: http.get("/health").json()["status"] != "loading", "it failed")
            health = http.get("/health")
            assert health.status_code == 503 and "weights are corrupt" in health.json()["error"]
            r = http.post("/tts", json={"text": "Hi."})
            assert r.status_code == 503 and "failed to load" in r.json()["error"]["message"]


# --- clients that leave -------------------------------------------------------------------


def test_client_leaving_a_stream_cancels_its_synthesis() -> None:
    hold = threading.Event()  # set once the client has left: its sentence cannot end before

    def held(path: Path, threads: int | None) -> FakeEngine:
        return FakeEngine(path, threads, hold=hold)

    text = "A long sentence that nobody will wait for, " * 8 + "the end. And a second one."
    with BackgroundServer(engine_factory=held) as srv, srv.client() as http:
        with http.stream("POST", "/tts", json={"text": text, "stream": True}) as r:
            assert next(r.iter_raw())[:4] == b"RIFF"
        # Leaving the block closed the connection mid-stream: the engine stops within a chunk.
        engine = srv.engines[0]
        wait_until(engine.calls[0].ended.is_set, "the engine stops the sentence")
        hold.set()
        # Sentences run in turn: one of the left request still to come would run before this.
        assert http.post("/tts", json={"text": "Next."}).status_code == 200  # engine is free
        assert [c.text for c in engine.calls] == [engine.calls[0].text, "Next."]
        # Stopped after its first chunk: the cancel event seen, or its generator closed.
        assert not engine.calls[0].finished and engine.calls[0].chunks == 1


@pytest.mark.long
def test_client_that_stops_reading_is_dropped_and_frees_the_engine() -> None:
    import socket

    # cache off: its repeated sentence reaches the engine every time
    limits = {"limits.max_text_chars": 20000, "limits.max_buffered_audio_s": 0.5,
              "limits.stall_timeout_s": 1, "cache.max_mb": 0}  # fmt: skip
    text = "Nobody reads this sentence, it only fills the socket buffers of the test. " * 130
    body = json.dumps({"text": text, "stream": True, "format": "pcm"}).encode()
    outcomes = Outcomes()
    with BackgroundServer(limits, wyoming=False) as srv:
        srv.running.scheduler.metrics.subscribe(outcomes)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", srv.http.port))
            sock.sendall(b"POST /tts HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
            # Synthesis runs ahead until the unread audio passes the limit, then waits; after
            # stall_timeout_s (1 s) without reading, the job gives up and the server hangs up.
            wait_until(lambda: outcomes.seen, "the request ends")
            assert outcomes.seen == ["stalled"]
            assert srv.call(_idle(srv))
            engine = srv.engines[0]
            calls = len(engine.calls)
            assert 0 < calls < len(text) // 120 and all(c.finished for c in engine.calls)
            sock.settimeout(10)
            received = 0
            while part := sock.recv(1 << 16):  # the server closed the connection: EOF comes
                received += len(part)
            assert 0 < received < expected_bytes(text)
        with srv.client() as http:
            assert http.post("/tts", json={"text": "Next."}).status_code == 200
        # Sentences run in turn: one of the dropped request still to come would run before.
        assert [c.text for c in engine.calls[calls:]] == ["Next."]


async def _idle(srv: BackgroundServer) -> bool:
    """True once no request is waiting for or holding the engine."""
    return srv.running.scheduler.idle
