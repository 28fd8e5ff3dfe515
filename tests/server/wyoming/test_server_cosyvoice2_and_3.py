"""The server with CosyVoice2-0.5B and with Fun-CosyVoice3-0.5B, end to end: each family's tiny
model, its voices made on the first start from the tiny v1-SFT model's speakers (tiny ONNX
stand-ins for the prompt models), a voice from the voices folder, and 24 kHz audio over Wyoming
and HTTP.

One server per family (Wyoming listener + HTTP, one scheduler, the real loader) serves the
module's tests of both (``tiny_family_server``: every request makes a fixed number of speech
tokens, so the audio length is known exactly). What the engine is asked to say is recorded at
its LM, so instructions and the inline tags are checked where they take effect.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import wave
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from http_process import record_voice
from test_http import parse_wav
from tiny_family_server import (
    QUICK_V1,
    SAMPLES,
    TINY_V1,
    TOKENS,
    V2,
    V3,
    LmInputs,
    TinyFamily,
    TinyServer,
    data_dir,
    server_log,
    wait_for_voice,
)

from engine.api import PrimesVoices
from engine.core.types import SynthesisOptions


@pytest.fixture(scope="module", params=[V2, V3], ids=["cosyvoice2", "cosyvoice3"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SimpleNamespace]:
    family: TinyFamily = request.param
    data = data_dir(tmp_path_factory.mktemp(f"{family.name}-server"), family, with_v1=True)
    record_voice(data / "voices", "anna")
    settings = {
        "server.voices_dir": str(data / "voices"),
        # these tests watch what reaches the engine: no replays from the repeat cache
        "cache.max_mb": 0,
        # warmed up as the command starts it: auto measures the stage costs
        "server.warmup": True,
    }
    with server_log() as log, TinyServer(data, family, settings) as srv:
        engine = srv.running.scheduler.engine
        yield SimpleNamespace(
            family=family,
            srv=srv,
            data=data,
            engine=engine,
            log=log.text(),
            log_threads=dict(log.threads),
            # what auto measured after the warm-up, before any request
            auto_at_start=srv.running.scheduler.auto.report(),
            lm=LmInputs(engine),
            port=srv.running.port,
            url=srv.url,
        )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _describe(server: SimpleNamespace, wy: SimpleNamespace) -> Any:
    """The server's ``info``, asked over Wyoming."""
    from wyoming.event import Event
    from wyoming.info import Info

    async with wy.connect(server.port) as client:
        await client.write_event(Event("describe"))
        reply = await wy.read_until(client, ("info",))
    return Info.from_event(reply.events[-1])


# --- voices out of the box --------------------------------------------------------------------


def test_first_start_makes_voices_from_the_v1_speakers(server: SimpleNamespace) -> None:
    family = server.family
    folder = server.data / family.builtin_voices
    for speaker in ("中文女", "英文男"):
        for suffix in (".wav", ".txt", f".{family.name}.prompt.pt"):
            assert (folder / f"{speaker}{suffix}").is_file(), speaker + suffix
    assert server.engine.kind == family.name and server.engine.speakers == ["中文女", "英文男"]
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
    data = data_dir(tmp_path, server.family, with_v1=True)
    folder = data / server.family.builtin_voices
    shutil.copytree(server.data / server.family.builtin_voices, folder)
    # Interrupted after the first voice: the second one and the mark are missing.
    for path in [*folder.glob("英文男*"), folder / ".finished"]:
        path.unlink()
    kept = (folder / "中文女.wav").read_bytes()
    config = load_config(None, [("server.data_dirs", [str(data)]), ("server.offline", True)])
    family = family_named(server.family.name)
    model_dir = data / server.family.model
    make_missing_voices(model_dir, family, config)
    made = folder / f"英文男.{family.name}.prompt.pt"
    assert made.is_file() and (folder / ".finished").is_file()
    assert (folder / "中文女.wav").read_bytes() == kept
    # Finished: the v1 model is not needed any more.
    shutil.rmtree(data / "CosyVoice-300M-SFT")
    make_missing_voices(model_dir, family, config)


@pytest.mark.parametrize(
    ("overrides", "lm"),
    [
        ([("server.profile", "fastest")], "int8"),  # the profile's int4 is not the voices'
        ([("server.lm_weights", "int4")], "int8"),
        ([("server.lm_weights", "fp32")], "fp32"),
    ],
)
def test_the_voices_are_made_with_the_exact_profiles_lm(
    overrides: list[tuple[str, str]], lm: str
) -> None:
    """Made once and kept, so the start that makes them must not leave its profile in them."""
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.builtin_voices import _voice_making_lm

    assert _voice_making_lm(load_config(None, overrides)) == lm


def test_describe_lists_the_voices_before_and_after_the_load(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    from wyoming_cosyvoice.models.model import speakers_before_load

    info = run(_describe(server, wy))
    # The built-in voices, then the voices folder's once scanned.
    assert [v.name for v in info.tts[0].voices][:2] == ["en-male", "zh-female"]
    # The next start lists them while the model still loads (from the folder's caches).
    model_dir = server.srv.running.scheduler.model_dir
    assert speakers_before_load(server.srv.config, model_dir) == ["中文女", "英文男"]


def test_a_recorded_voice_joins_the_built_in_ones(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    wait_for_voice(server.srv, "anna")
    assert (server.data / "voices" / f"anna.{server.family.name}.prompt.pt").is_file()
    assert server.srv.running.scheduler.catalog.names == ["en-male", "zh-female", "anna"]
    server.lm.take()
    reply = run(wy.synthesize(server.port, "你好。", {"name": "anna"}))
    assert reply.error() is None and reply.samples == SAMPLES
    # Zero-shot: the transcript as the prompt text (CosyVoice3: after its system prompt) and
    # the recording's speech tokens.
    ((_, prompt_text, prompt_tokens),) = server.lm.take()
    transcript = (server.data / "voices" / "anna.txt").read_text(encoding="utf-8")
    assert prompt_text == server.engine.frontend.prompt_text_ids(transcript)
    if server.family is V3:
        system = server.engine.frontend.tokenizer.encode(
            "You are a helpful assistant.<|endofprompt|>"
        )
        assert prompt_text[: len(system)] == system
    assert len(prompt_tokens) > 0


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


# --- auto --------------------------------------------------------------------------------------


def test_auto_measured_every_loaded_format_and_chooses_per_request(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    costs = server.auto_at_start["stage_costs"]
    assert costs is not None, server.auto_at_start
    assert min(costs["lm_token_ms"].values()) > 0 and min(costs["lm_prefill_ms"].values()) > 0
    loaded = server.engine.weight_formats
    for part in ("flow", "hift"):
        for weights in loaded[part]:
            assert f"{part}.{weights}" not in costs["estimated"], (part, weights, costs)
    for weights in loaded["llm"]:  # every loaded LM measured in its own format
        for stage in ("lm_prefill", "lm_token"):
            assert f"{stage}.{weights}" not in costs["estimated"], (weights, costs)
    assert all(costs["flow_us_per_frame_step"][w] > 0 for w in loaded["flow"])
    reply = run(wy.synthesize(server.port, "Hello there.", {"name": "en-male"}))
    assert reply.error() is None and reply.samples == SAMPLES
    with httpx.Client(base_url=server.url, timeout=120) as client:
        auto = client.get("/health").json()["auto"]
    profiles = ["realtime", "fast", "faster", "fastest"]
    assert auto["last_choice"]["profile"] in auto["profiles"] == profiles


# --- instructions and the inline tags ---------------------------------------------------------

# A dialect each family was trained on, in its words.
INSTRUCTIONS = {"cosyvoice2": "用四川话说这句话", "cosyvoice3": "请用四川话表达。"}


def _lm_prompt_of(server: SimpleNamespace, instruction: str) -> list[int]:
    """What the family's LM must be given as its prompt text for ``instruction``: CosyVoice2
    the instruction as typed, CosyVoice3 the instruction inside its system prompt (written out
    here, not asked of the engine)."""
    tokenizer = server.engine.frontend.tokenizer
    if server.family is V3:
        return list(tokenizer.encode(f"You are a helpful assistant. {instruction}<|endofprompt|>"))
    return list(tokenizer.encode(f"{instruction}<|endofprompt|>"))


def _instructed_calls(server: SimpleNamespace, instruction: str) -> None:
    calls = server.lm.take()
    expected = _lm_prompt_of(server, instruction)
    assert calls and all(prompt == expected and tokens == [] for _, prompt, tokens in calls)


def test_an_instruction_over_wyoming(server: SimpleNamespace, wy: SimpleNamespace) -> None:
    instruction = INSTRUCTIONS[server.family.name]
    server.lm.take()
    voice = {"name": "zh-female", "speaker": instruction}
    reply = run(wy.synthesize(server.port, "今天天气很好。", voice))
    assert reply.error() is None and reply.samples == SAMPLES
    _instructed_calls(server, instruction)


def test_an_instruction_over_http(server: SimpleNamespace) -> None:
    instruction = INSTRUCTIONS[server.family.name]
    server.lm.take()
    body = {"input": "今天天气很好。", "voice": "zh-female", "instructions": instruction}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        reply = client.post("/v1/audio/speech", json=body)
    assert reply.status_code == 200, reply.text
    _instructed_calls(server, instruction)


def test_a_style_is_the_familys_own_instruction_or_refused_clearly(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    """Each style a family was trained on reaches its LM in that family's words; any other is
    refused over Wyoming and HTTP, saying which styles it has and which model speaks the one
    asked for (CosyVoice3's official instructions hold no calm or serious one)."""
    from wyoming_cosyvoice.voices.presets import STYLES

    form = server.engine.instruction_form
    spoken = {
        "cosyvoice2": ["calm", "cheerful", "sad", "serious"],
        "cosyvoice3": ["cheerful", "sad"],
    }
    assert (
        STYLES["sad"].get(form)
        == {"cosyvoice2": "用悲伤的语气说这句话", "cosyvoice3": "请非常伤心地说一句话。"}[
            server.family.name
        ]
    )
    for style in STYLES:
        server.lm.take()
        voice = {"name": "zh-female", "speaker": style}
        reply = run(wy.synthesize(server.port, "今天天气很好。", voice))
        if style in spoken[server.family.name]:
            assert reply.error() is None and reply.samples == SAMPLES, style
            _instructed_calls(server, STYLES[style][form])
            continue
        error = reply.error()
        assert error is not None and error.code == "StyleUnsupportedError", (style, reply.types)
        assert f"{style!r}" in error.text and "its styles are cheerful, sad" in error.text
        assert "CosyVoice2-0.5B" in error.text and "Fun-CosyVoice3" not in error.text
        with httpx.Client(base_url=server.url, timeout=120) as client:
            http = client.post(
                "/tts", json={"text": "你好。", "voice": "zh-female", "style": style}
            )
        assert http.status_code == 400 and "its styles are cheerful, sad" in http.text
        assert server.lm.take() == []  # nothing reached the engine


def test_describe_lists_the_styles_the_family_speaks(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    info = run(_describe(server, wy))
    speakers = {s.name for s in info.tts[0].voices[0].speakers or []}
    styles = {"calm", "cheerful", "sad", "serious"}
    assert speakers & styles == (styles if server.family is V2 else {"cheerful", "sad"})


def test_a_speed_speaker_makes_the_answer_shorter(
    server: SimpleNamespace, wy: SimpleNamespace
) -> None:
    reply = run(wy.synthesize(server.port, "Hello there.", {"name": "en-male", "speaker": "fast"}))
    # the mel's 2 frames a token resampled to ⌊frames / 1.25⌋ frames (engine.core.speed)
    assert reply.error() is None and reply.samples == int(TOKENS * 2 / 1.25) * 480


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


@pytest.mark.parametrize("family", [V2, V3], ids=["cosyvoice2", "cosyvoice3"])
def test_offline_without_the_v1_model_says_how_to_get_voices(
    family: TinyFamily, tmp_path: Path, wy: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    data = data_dir(tmp_path, family, with_v1=False)
    with TinyServer(data, family, {"server.warmup": False}) as srv:
        assert srv.running.scheduler.engine.speakers == []
        reply = srv.call(wy.synthesize(srv.running.port, "Hello."))
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            voices = client.get("/voices").json()
    assert f"No built-in voices for {family.model}" in caplog.text
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
    data = data_dir(tmp_path, server.family, with_v1=False)
    settings = {"server.warmup": False, "server.voices_dir": str(voices)}
    with TinyServer(data, server.family, settings) as srv:
        wait_for_voice(srv, "anna")
    assert f"prompt from anna.{server.family.name}.prompt.pt" in caplog.text


def test_voice_caches_are_named_per_family(tmp_path: Path) -> None:
    from engine.cosyvoice2.prompt import COSYVOICE2
    from engine.cosyvoice3.prompt import COSYVOICE3
    from engine.family import family_named
    from engine.prompt.recipe import COSYVOICE1
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.custom_voices.folder import prompt_model_files, voice_model_name

    assert family_named("cosyvoice").prompt_cache_suffix == COSYVOICE1.cache_suffix
    assert family_named("cosyvoice2").prompt_cache_suffix == COSYVOICE2.cache_suffix
    assert family_named("cosyvoice3").prompt_cache_suffix == COSYVOICE3.cache_suffix
    suffixes = {COSYVOICE1.cache_suffix, COSYVOICE2.cache_suffix, COSYVOICE3.cache_suffix}
    assert len(suffixes) == 3
    config = load_config(None, [("server.model", "CosyVoice-300M-SFT")])
    # A --model-dir of another family than the configured model: its own prompt models.
    assert prompt_model_files(V2.source) == ("campplus.onnx", "speech_tokenizer_v2.onnx")
    assert prompt_model_files(V3.source) == ("campplus.onnx", "speech_tokenizer_v3.onnx")
    assert prompt_model_files(TINY_V1) == ("campplus.onnx", "speech_tokenizer_v1.onnx")
    assert voice_model_name(config, V2.source) == "CosyVoice2-0.5B"
    assert voice_model_name(config, V3.source) == "Fun-CosyVoice3-0.5B"
    assert voice_model_name(config, TINY_V1) == "CosyVoice-300M-SFT"


def test_the_synthesize_command_writes_24_khz(server: SimpleNamespace, tmp_path: Path) -> None:
    from wyoming_cosyvoice.synthesize import main

    out = tmp_path / "hello.wav"
    argv = ["Hello there.", "-o", str(out), "--model", server.family.model,
            "--data-dir", str(server.data)]  # fmt: skip
    assert main([*argv, "--offline", "--threads", "1", "--seed", "1", "--quiet"]) == 0
    with wave.open(str(out)) as wav:
        assert (wav.getframerate(), wav.getnchannels()) == (24000, 1) and wav.getnframes() > 0


def test_a_fast_profile_loads_cosyvoice2_in_its_weight_formats(tmp_path: Path) -> None:
    from engine.core.cpu import detect
    from engine.core.runtime import int4_kernel_for_lm, int8_hift_fast
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.model import engine_loader

    data = data_dir(tmp_path, V2, with_v1=False)
    settings = [("server.profile", "fastest"), ("server.offline", True),
                ("server.data_dirs", [str(data)])]  # fmt: skip
    engine = engine_loader(load_config(None, settings))(data / V2.model, 1)
    assert engine.kind == "cosyvoice2"
    # The fast formats this CPU runs (engine.core.runtime.setup_cpu falls back to int8 for the
    # int4 LM, to float32 for int8).
    cpu = detect()
    int8 = cpu.int8_kernels is not None
    lm = "int4" if int4_kernel_for_lm() else "int8" if int8 else "fp32"
    formats = {f"llm.{lm}", "flow.int8" if int8 else "flow.fp32"}
    formats.add("hift.int8" if int8_hift_fast() else "hift.fp32")
    assert formats <= set(engine.prepared_at_load), cpu.describe()
    assert engine.weight_formats["llm"] == (lm,)  # fastest's own LM, and no other


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
    assert (options.n_timesteps, options.cfg_rate, options.solver) == (1, 0.7, "euler")  # fastest's


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
    # realtime, fast, faster, fastest: each one's flow steps, solver, guidance and weights
    settings = [(o.n_timesteps, o.solver, o.cfg_rate, o.flow_weights) for o in engine.primed]
    assert settings == [
        (10, "euler", 0.7, "fp32"),
        (5, "euler", 0.7, "int8"),
        (1, "heun", 0.7, "int8"),
        (1, "euler", 0.7, "int8"),
    ]


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
