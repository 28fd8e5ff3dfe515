"""The server with CosyVoice2-0.5B, end to end: the tiny v2 model, its voices made on the first
start from the tiny v1-SFT model's speakers (tiny ONNX stand-ins for the prompt models), and
24 kHz audio over Wyoming and HTTP.

One server (Wyoming listener + HTTP, one scheduler, the real loader) serves the module. Random
weights never end a sentence by themselves, so every request makes a fixed number of speech
tokens (``force_tokens``) and the audio length is known exactly. What the engine is asked to say
is recorded at its LM, so instruct2 and the inline tags are checked where they take effect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import threading
import wave
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from conftest import DATA, wait_until
from http_process import record_voice
from test_http import BackgroundServer, parse_wav

from engine.api import PrimesVoices
from engine.core.types import SynthesisOptions

TINY_V1 = DATA / "tiny_model"
TINY_V2 = DATA / "cosyvoice2" / "tiny"
ONNX = DATA / "zero_shot" / "onnx"
V2 = "CosyVoice2-0.5B"
TOKENS = 60  # speech tokens per sentence (25 a second)
SAMPLES = TOKENS * 2 * 480  # two mel frames a token, 480 samples a frame at 24 kHz
# How the tiny v1 model says each built-in voice's sentence: 4 s, cheap flow steps.
QUICK_V1 = SynthesisOptions(force_tokens=200, n_timesteps=2)


def wait_for_voice(srv: BackgroundServer, name: str) -> None:
    """Until the voices folder's scan offers ``name`` (a bounded wait)."""
    catalog = lambda: srv.running.scheduler.catalog  # noqa: E731
    wait_until(lambda: catalog().find(name) is not None, f"voice {name!r} is offered")


def data_dir(root: Path, *, with_v1: bool) -> Path:
    """A data dir holding the tiny v2 model (with its prompt models) and maybe the tiny v1-SFT."""
    data = root / "data"
    ignore = shutil.ignore_patterns("prepared")
    shutil.copytree(TINY_V2, data / V2, ignore=ignore)
    for name in ("campplus.onnx", "speech_tokenizer_v2.onnx"):
        shutil.copy(ONNX / f"tiny_{name}", data / V2 / name)
    if with_v1:
        shutil.copytree(TINY_V1, data / "CosyVoice-300M-SFT", ignore=ignore)
    return data


class V2Server(BackgroundServer):
    """The background server with the real loader on a CosyVoice2 data dir."""

    def __init__(self, data: Path, overrides: dict[str, Any] | None = None) -> None:
        settings = {"server.model": V2, "server.data_dirs": [str(data)], "server.offline": True,
                    "server.threads": 1, "server.seed": 0}  # fmt: skip
        super().__init__({**settings, **(overrides or {})}, simple_splitter=False)

    async def _start(self) -> None:
        from wyoming_cosyvoice.config import load_config
        from wyoming_cosyvoice.custom_voices.folder import CustomVoices
        from wyoming_cosyvoice.http import start_http
        from wyoming_cosyvoice.models.model import resolve_model_dir
        from wyoming_cosyvoice.wyoming.server import create_server

        config = load_config(None, self.settings.items())
        self.config = dataclasses.replace(config, force_tokens=TOKENS)
        self.running = await create_server(self.config, resolve_model_dir(self.config))
        self.http = await start_http(self.config, self.running.scheduler, "127.0.0.1", 0)
        self.voices = None
        if self.config.voices_dir is not None:  # as the command starts it
            model_dir = self.running.scheduler.model_dir
            self.voices = CustomVoices(self.config, self.running.scheduler, model_dir).start()
        await asyncio.wait_for(asyncio.shield(self.running.load_task), 300)

    async def _stop(self) -> None:
        if self.voices is not None:
            await self.voices.stop()
        await super()._stop()


class LmInputs:
    """What the engine's LM is asked for, request by request (wraps its ``generate``)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.lock, self.calls = engine, threading.Lock(), []
        inner = engine.models.llm.generate

        def generate(text_ids: list[int], prompt_text_ids: list[int],
                     prompt_tokens: list[int], **kwargs: Any) -> Any:  # fmt: skip
            with self.lock:
                self.calls.append((list(text_ids), list(prompt_text_ids), list(prompt_tokens)))
            return inner(text_ids, prompt_text_ids, prompt_tokens, **kwargs)

        engine.models.llm.generate = generate

    def take(self) -> list[tuple[list[int], list[int], list[int]]]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    data = data_dir(tmp_path_factory.mktemp("v2server"), with_v1=True)
    record_voice(data / "voices", "anna")
    handler, logger = _Capture(), logging.getLogger("wyoming_cosyvoice")
    logger.addHandler(handler)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logger, "level", logging.INFO)
        patch.setattr("wyoming_cosyvoice.models.builtin_voices.SPEAKING_OPTIONS", QUICK_V1)
        try:
            with V2Server(
                # these tests watch what reaches the engine: no replays from the repeat cache
                data,
                {"server.voices_dir": str(data / "voices"), "cache.max_mb": 0},
            ) as srv:
                engine = srv.running.scheduler.engine
                yield SimpleNamespace(
                    srv=srv,
                    data=data,
                    engine=engine,
                    log=handler.text(),
                    log_threads=dict(handler.threads),
                    lm=LmInputs(engine),
                    port=srv.running.port,
                    url=srv.url,
                )
        finally:
            logger.removeHandler(handler)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.threads: dict[str, str] = {}  # message -> the thread that logged it

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.threads[record.getMessage()] = record.threadName or ""

    def text(self) -> str:
        return "\n".join(self.lines)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


# --- voices out of the box --------------------------------------------------------------------


# Where the voices made from v1's speakers are kept, under the download directory: existing
# installs have it, so its name stays.
BUILTIN_VOICES_DIR = "CosyVoice2-voices-from-CosyVoice-300M-SFT"


def test_first_start_makes_voices_from_the_v1_speakers(server: SimpleNamespace) -> None:
    folder = server.data / BUILTIN_VOICES_DIR
    for speaker in ("中文女", "英文男"):
        for suffix in (".wav", ".txt", ".cosyvoice2.prompt.pt"):
            assert (folder / f"{speaker}{suffix}").is_file(), speaker + suffix
    assert server.engine.kind == "cosyvoice2" and server.engine.speakers == ["中文女", "英文男"]
    assert "Built-in voice 1 of 2" in server.log and "Built-in voice 2 of 2" in server.log
    # Made on the engine thread, inside the load: the event loop stays free meanwhile.
    assert server.log_threads["Built-in voice 1 of 2: 中文女"].startswith("engine")
    assert f"Built-in voices from {folder}: 中文女, 英文男" in server.log
    assert (folder / ".finished").is_file()


def test_an_unfinished_voices_folder_is_finished_on_the_next_start(
    server: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.family import family_named
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.builtin_voices import make_missing_voices

    monkeypatch.setattr("wyoming_cosyvoice.models.builtin_voices.SPEAKING_OPTIONS", QUICK_V1)
    data = data_dir(tmp_path, with_v1=True)
    folder = data / BUILTIN_VOICES_DIR
    shutil.copytree(server.data / BUILTIN_VOICES_DIR, folder)
    # Interrupted after the first voice: the second one and the mark are missing.
    for path in [*folder.glob("英文男*"), folder / ".finished"]:
        path.unlink()
    kept = (folder / "中文女.wav").read_bytes()
    config = load_config(None, [("server.data_dirs", [str(data)]), ("server.offline", True)])
    family = family_named("cosyvoice2")
    make_missing_voices(data / V2, family, config)
    assert (folder / "英文男.cosyvoice2.prompt.pt").is_file() and (folder / ".finished").is_file()
    assert (folder / "中文女.wav").read_bytes() == kept
    # Finished: the v1 model is not needed any more.
    shutil.rmtree(data / "CosyVoice-300M-SFT")
    make_missing_voices(data / V2, family, config)


def test_describe_lists_the_voices_before_and_after_the_load(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    from wyoming.event import Event
    from wyoming.info import Info

    from wyoming_cosyvoice.models.model import speakers_before_load

    async def describe() -> Info:
        async with wy.connect(server.port) as client:
            await client.write_event(Event("describe"))
            reply = await wy.read_until(client, ("info",))
        return Info.from_event(reply.events[-1])

    info = run(describe())
    # The built-in voices, then the voices folder's once scanned.
    assert [v.name for v in info.tts[0].voices][:2] == ["en-male", "zh-female"]
    # The next start lists them while the model still loads (from the folder's caches).
    model_dir = server.srv.running.scheduler.model_dir
    assert speakers_before_load(server.srv.config, model_dir) == ["中文女", "英文男"]


def test_a_recorded_voice_joins_the_built_in_ones(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    wait_for_voice(server.srv, "anna")
    assert (server.data / "voices" / "anna.cosyvoice2.prompt.pt").is_file()
    assert server.srv.running.scheduler.catalog.names == ["en-male", "zh-female", "anna"]
    reply = run(wy.synthesize(server.port, "你好。", {"name": "anna"}))
    assert reply.error() is None and reply.samples == SAMPLES


# --- 24 kHz over Wyoming and HTTP -------------------------------------------------------------


def test_wyoming_audio_is_24_khz(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    reply = run(wy.synthesize(server.port, "Hello there.", {"name": "en-male"}))
    assert reply.error() is None and reply.types[0] == "audio-start"
    assert reply.events[0].data["rate"] == 24000
    chunks = [e for e in reply.events if e.type == "audio-chunk"]
    assert chunks and all(c.data["rate"] == 24000 for c in chunks)
    assert reply.samples == SAMPLES


def test_wyoming_streaming_input_is_24_khz(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    reply = run(wy.stream(server.port, "The first one. 第二句。", voice={"name": "zh-female"}))
    assert reply.types[-1] == "synthesize-stopped" and reply.error() is None
    starts = [e for e in reply.events if e.type == "audio-start"]
    assert len(starts) == 2 and all(e.data["rate"] == 24000 for e in starts)
    assert reply.samples == 2 * SAMPLES


def test_http_audio_is_24_khz(server: SimpleNamespace) -> None:
    body = {"text": "Hello there.", "voice": "en-male"}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        assert client.get("/voices").json()["sample_rate"] == 24000
        whole = client.post("/tts", json=body)
        assert whole.status_code == 200 and whole.headers["X-Sample-Rate"] == "24000"
        params, pcm = parse_wav(whole.content, 24000)
        assert params.nframes == SAMPLES
        raw = client.post("/tts", json={**body, "format": "pcm", "stream": True})
        assert raw.headers["content-type"].startswith("audio/pcm;rate=24000")
        assert len(raw.content) == 2 * SAMPLES


# --- instruct2 and the inline tags ------------------------------------------------------------

INSTRUCTION = "用四川话说这句话"


def _instruct2_calls(server: SimpleNamespace) -> list[tuple[list[int], list[int], list[int]]]:
    calls = server.lm.take()
    expected = server.engine.frontend.instruct_ids(INSTRUCTION)
    assert calls and all(prompt == expected and tokens == [] for _, prompt, tokens in calls)
    return calls


def test_instruct2_over_wyoming(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    server.lm.take()
    voice = {"name": "zh-female", "speaker": INSTRUCTION}
    reply = run(wy.synthesize(server.port, "今天天气很好。", voice))
    assert reply.error() is None and reply.samples == SAMPLES
    _instruct2_calls(server)


def test_instruct2_over_http(server: SimpleNamespace) -> None:
    server.lm.take()
    body = {"input": "今天天气很好。", "voice": "zh-female", "instructions": INSTRUCTION}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        reply = client.post("/v1/audio/speech", json=body)
    assert reply.status_code == 200, reply.text
    _instruct2_calls(server)


TAGGED = "Well [laughter] that is <strong>really</strong> funny [breath] indeed."


def _tags_reached_the_lm(server: SimpleNamespace) -> None:
    tokenizer = server.engine.frontend.tokenizer
    tags = [tokenizer.token_id(t) for t in ("[laughter]", "<strong>", "</strong>", "[breath]")]
    said = [i for text_ids, _, _ in server.lm.take() for i in text_ids]
    assert all(tag in said for tag in tags), (tags, said)


def test_inline_tags_over_wyoming(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    server.lm.take()
    reply = run(wy.synthesize(server.port, TAGGED, {"name": "en-male"}))
    assert reply.error() is None and reply.samples > 0
    _tags_reached_the_lm(server)


def test_inline_tags_over_http(server: SimpleNamespace) -> None:
    server.lm.take()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        reply = client.post("/tts", json={"text": TAGGED, "voice": "en-male"})
    assert reply.status_code == 200, reply.text
    _tags_reached_the_lm(server)


# --- without voices -----------------------------------------------------------------------------


def test_offline_without_the_v1_model_says_how_to_get_voices(
    tmp_path: Path, wy: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    data = data_dir(tmp_path, with_v1=False)
    with V2Server(data, {"server.warmup": False}) as srv:
        assert srv.running.scheduler.engine.speakers == []
        reply = srv.call(wy.synthesize(srv.running.port, "Hello."))
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            voices = client.get("/voices").json()
    assert "No built-in voices for CosyVoice2-0.5B" in caplog.text
    assert "allow the download of CosyVoice-300M-SFT" in caplog.text
    assert "--voices-dir" in caplog.text
    assert reply.error() is not None and "no speakers" in reply.error().text
    assert voices["voices"] == [] and voices["sample_rate"] == 24000


def test_a_cached_voice_is_logged_with_its_cache_file(
    server: SimpleNamespace, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    wait_for_voice(server.srv, "anna")
    voices = tmp_path / "voices"
    shutil.copytree(server.data / "voices", voices)
    caplog.set_level(logging.INFO)
    data = data_dir(tmp_path, with_v1=False)
    with V2Server(data, {"server.warmup": False, "server.voices_dir": str(voices)}) as srv:
        wait_for_voice(srv, "anna")
    assert "prompt from anna.cosyvoice2.prompt.pt" in caplog.text


def test_voice_caches_are_named_per_family(tmp_path: Path) -> None:
    from engine.cosyvoice2.prompt import COSYVOICE2
    from engine.family import family_named
    from engine.prompt.recipe import COSYVOICE1
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.custom_voices.folder import prompt_model_files, voice_model_name

    assert family_named("cosyvoice").prompt_cache_suffix == COSYVOICE1.cache_suffix
    assert family_named("cosyvoice2").prompt_cache_suffix == COSYVOICE2.cache_suffix
    assert COSYVOICE1.cache_suffix != COSYVOICE2.cache_suffix
    config = load_config(None, [("server.model", "CosyVoice-300M-SFT")])
    # A --model-dir of another family than the configured model: its own prompt models.
    assert prompt_model_files(TINY_V2) == ("campplus.onnx", "speech_tokenizer_v2.onnx")
    assert prompt_model_files(TINY_V1) == ("campplus.onnx", "speech_tokenizer_v1.onnx")
    assert voice_model_name(config, TINY_V2) == "CosyVoice2-0.5B"
    assert voice_model_name(config, TINY_V1) == "CosyVoice-300M-SFT"


def test_the_synthesize_command_writes_24_khz(server: SimpleNamespace, tmp_path: Path) -> None:
    from wyoming_cosyvoice.synthesize import main

    out = tmp_path / "hello.wav"
    argv = ["Hello there.", "-o", str(out), "--model", V2, "--data-dir", str(server.data)]
    assert main([*argv, "--offline", "--threads", "1", "--seed", "1", "--quiet"]) == 0
    with wave.open(str(out)) as wav:
        assert (wav.getframerate(), wav.getnchannels()) == (24000, 1) and wav.getnframes() > 0


def test_a_fast_profile_loads_cosyvoice2_in_its_weight_formats(tmp_path: Path) -> None:
    from engine.core.cpu import detect
    from engine.core.runtime import int8_hift_fast
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.model import engine_loader

    data = data_dir(tmp_path, with_v1=False)
    settings = [("server.profile", "fastest"), ("server.offline", True),
                ("server.data_dirs", [str(data)])]  # fmt: skip
    engine = engine_loader(load_config(None, settings))(data / V2, 1)
    assert engine.kind == "cosyvoice2"
    # The fast formats this CPU runs (engine.core.runtime.setup_cpu falls back to float32
    # otherwise).
    cpu = detect()
    int8 = ("llm.int8", "flow.int8") if cpu.int8_kernels is not None else ("llm.fp32", "flow.fp32")
    hift = ("hift.int8",) if int8_hift_fast() else ("hift.fp32",)
    assert {*int8, *hift} <= set(engine.prepared_at_load), cpu.describe()


def test_the_default_voice_is_primed_for_the_server_profile(wy: SimpleNamespace) -> None:
    class PrimingEngine(wy.FakeEngine, PrimesVoices):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.primed: list[tuple[bool, SynthesisOptions]] = []

        def prime_voice(self, options: SynthesisOptions | None = None) -> None:
            assert options is not None
            self.primed.append((self.warmed, options))

        def unprime_voice(self, options: SynthesisOptions | None = None) -> None:
            raise AssertionError("a fixed profile lets go of no primed voice")

    async def start() -> Any:
        settings = {"server.warmup": True, "server.profile": "fastest"}
        async with wy.fake_server(settings, engine=PrimingEngine) as srv:
            return srv.engines[0]

    engine = run(start())
    ((warmed_first, options),) = engine.primed
    assert warmed_first and options.speaker is None  # after the warm-up, the default voice
    assert (options.n_timesteps, options.cfg_rate) == (2, 0.7)  # fastest's flow settings


def test_the_auto_profile_primes_the_default_voice_for_each_profile_it_chooses_from(
    wy: SimpleNamespace,
) -> None:
    class PrimingEngine(wy.FakeEngine, PrimesVoices):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.primed: list[SynthesisOptions] = []

        def prime_voice(self, options: SynthesisOptions | None = None) -> None:
            assert options is not None
            self.primed.append(options)

        def unprime_voice(self, options: SynthesisOptions | None = None) -> None:
            pass  # what auto lets go of: test_auto_profile's concern

    async def start() -> Any:
        settings = {"server.warmup": True, "server.profile": "auto"}
        async with wy.fake_server(settings, engine=PrimingEngine) as srv:
            return srv.engines[0]

    engine = run(start())
    # realtime, fast, fastest: each one's flow steps, guidance and weights
    settings = [(o.n_timesteps, o.cfg_rate, o.flow_weights) for o in engine.primed]
    assert settings == [(10, 0.7, "fp32"), (5, 0.7, "int8"), (2, 0.7, "int8")]


# --- a streamed sentence spoken while it arrives ----------------------------------------------

# An LLM's first sentence so far: long enough for the LM to read the voice's prompt and start.
BEGUN = (
    "Sure, I have turned on the kitchen lights and the lamp in the living room, and I set the "
    "heating to twenty one degrees so that the house is warm when you come home this evening, "
    "and I also opened the blinds in the bedroom because the sun is out and"
)


def test_wyoming_speaks_a_streamed_sentence_before_it_ends(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    from wyoming.event import Event

    async def go() -> tuple[Any, Any]:
        async with wy.connect(server.port) as client:
            await client.write_event(Event("synthesize-start", {"voice": {"name": "en-male"}}))
            for word in BEGUN.split(" "):
                await client.write_event(Event("synthesize-chunk", {"text": word + " "}))
            early = await wy.read_until(client, ("audio-chunk", "error"), timeout=120)
            await client.write_event(Event("synthesize-chunk", {"text": "the kettle is on."}))
            await client.write_event(Event("synthesize-stop"))
            rest = await wy.read_until(client, ("synthesize-stopped", "error"), timeout=120)
        return early, rest

    wait_for_voice(server.srv, "anna")  # the voices folder's scan holds the engine until then
    server.lm.take()
    early, rest = run(go())
    # Audio before the sentence's end was sent, in the voice asked for; the sentence's usual
    # layout was never asked for (its LM read the text as it came).
    assert early.types == ["audio-start", "audio-chunk"], early.types
    assert early.events[0].data["rate"] == 24000
    assert rest.types[-1] == "synthesize-stopped" and rest.error() is None
    assert wy.Reply(events=early.events + rest.events).samples == SAMPLES
    assert server.lm.take() == []
