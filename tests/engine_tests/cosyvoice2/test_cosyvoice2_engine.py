"""The CosyVoice2 engine: the tiny v2 model through its prepared files, the family picker, and
synthesis (streamed and whole) against the official orchestration's audio."""

from __future__ import annotations

import copy
import itertools
import math
import shutil
import threading
import wave
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TESTS
from parity import stream_atols, waveform_atol
from torch import nn

from engine.__main__ import main
from engine.core.pacing import ChunkPacer
from engine.core.prepared import PREPARED_DIR, PreparedLoad, WeightFormats, prepare_model
from engine.core.quantize import INT8_LINEAR_TYPES
from engine.core.types import (
    LOW_LATENCY_SCHEDULE,
    OFFICIAL_SCHEDULE,
    ModelLoadError,
    StreamSchedule,
    SynthesisCancelled,
    SynthesisOptions,
    UnknownSpeakerError,
)
from engine.cosyvoice2.engine import CosyVoice2Engine
from engine.cosyvoice2.model_dir import PARTS, CosyVoice2Models, load_model_dir
from engine.cosyvoice2.schedule import chunk_hops, prompt_tail
from engine.family import load_engine, model_family
from engine.prompt.extract import PromptFeatures
from engine.prompt.voices import CustomVoice

DATA = TESTS / "data" / "cosyvoice2"
TINY = DATA / "tiny"
V1_TINY = TESTS / "data" / "tiny_model"


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Bit-stable sums, and no oversubscription of the shared cores."""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A writable copy of the tiny v2 model (its prepared files go beside it)."""
    target = tmp_path / "CosyVoice2-0.5B"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    return target


@pytest.fixture(scope="module")
def reference() -> CosyVoice2Models:
    return load_model_dir(TINY)


def _loaded(model_dir: Path, formats: WeightFormats) -> CosyVoice2Models:
    loading = PreparedLoad(model_dir, formats, model_dir.parent / "cache", PARTS)
    modules = loading.modules()
    loading.finish()
    return CosyVoice2Models.of(model_dir, loading.args, modules)


def _lm_logits(models: CosyVoice2Models, steps: list[int]) -> torch.Tensor:
    llm = models.llm
    with torch.inference_mode():
        cache = llm.new_cache(64)
        outs = [llm.prefill(llm.build_input([5, 9, 300, 7], [11, 12], [40, 41, 42]), cache)]
        outs += [llm.decode_step(token, cache) for token in steps]
    return torch.cat([out.logits for out in outs])


# --- prepared files ----------------------------------------------------------------------------


def test_prepared_models_equal_the_checkpoints(model: Path, reference: CosyVoice2Models) -> None:
    models = _loaded(model, WeightFormats())
    assert sorted(p.name for p in (model / PREPARED_DIR).iterdir()) == [
        "flow.fp32.safetensors",
        "hift.fp32.safetensors",
        "llm.fp32.safetensors",
    ]
    for part in ("llm", "flow", "hift"):
        got, want = getattr(models, part).state_dict(), getattr(reference, part).state_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    # The unused text head is not stored: it is the embedding again.
    head = models.llm.llm.model
    assert head.lm_head.weight is head.model.embed_tokens.weight


def test_prepared_int8_lm_equals_quantising_the_float_lm(
    model: Path, reference: CosyVoice2Models
) -> None:
    models = _loaded(model, WeightFormats(llm="int8"))
    block = models.llm.backbone.layers[0]
    assert isinstance(block.self_attn.qkv_proj, INT8_LINEAR_TYPES)
    assert isinstance(block.mlp.gate_up_proj, INT8_LINEAR_TYPES)
    assert not hasattr(block.self_attn, "q_proj") and not hasattr(block.mlp, "up_proj")
    quantised = copy.deepcopy(reference)
    quantised.llm.quantize_int8()
    steps = [3, 17, 6000, 3]
    torch.testing.assert_close(
        _lm_logits(models, steps), _lm_logits(quantised, steps), atol=0, rtol=0
    )


def test_prepare_command_prepares_a_cosyvoice2_directory(model: Path) -> None:
    assert main(["prepare", "--model-dir", str(model), "--lm", "int8", "--hift", "bf16"]) == 0
    assert sorted(p.name for p in (model / PREPARED_DIR).iterdir()) == [
        "flow.fp32.safetensors",
        "hift.bf16.safetensors",
        "llm.int8.safetensors",
    ]
    again = prepare_model(model, {"llm": ["int8"]}, parts=PARTS)
    assert [prepared_now for _, _, prepared_now in again] == [False]


def test_an_incomplete_directory_names_what_is_missing(model: Path) -> None:
    (model / "flow.pt").unlink()
    (model / "CosyVoice-BlankEN" / "merges.txt").unlink()
    with pytest.raises(ModelLoadError, match=r"missing flow\.pt, CosyVoice-BlankEN/merges\.txt"):
        PreparedLoad(model, WeightFormats(), None, PARTS)


def test_a_checkpoint_that_does_not_fit_names_its_keys(model: Path) -> None:
    state = torch.load(model / "flow.pt", weights_only=True)
    del state["encoder_proj.weight"]
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, model / "flow.pt")
    with pytest.raises(ModelLoadError, match=r"missing keys: encoder_proj\.weight.*extra\.weight"):
        PreparedLoad(model, WeightFormats(), None, PARTS)


# --- the family picker -------------------------------------------------------------------------


def test_the_family_is_picked_by_the_config_file(tmp_path: Path) -> None:
    assert model_family(TINY).name == "cosyvoice2"
    assert model_family(V1_TINY).name == "cosyvoice"
    (tmp_path / "cosyvoice3.yaml").write_text("{}")
    assert model_family(tmp_path).name == "cosyvoice3"
    with pytest.raises(ModelLoadError, match="llm.pt"):  # the rest of a v3 directory is missing
        load_engine(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_family(tmp_path / "absent")
    with pytest.raises(
        ModelLoadError, match=r"missing cosyvoice\.yaml \(CosyVoice v1\) or cosyvoice2\.yaml"
    ):
        model_family(DATA)


# --- synthesis ---------------------------------------------------------------------------------

SAMPLES_PER_TOKEN = 2 * 480  # two mel frames a token, 480 samples a frame
HELD_BACK = 8 * 480  # the cross-fade tail each streamed chunk keeps for the next
CASES = torch.load(DATA / "stream_cases.pt", weights_only=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> CosyVoice2Engine:
    return load_tiny(tmp_path_factory)


def load_tiny(tmp_path_factory: pytest.TempPathFactory) -> CosyVoice2Engine:
    """The tiny v2 model loaded from a copy (one thread), with the voice ``tester``."""
    target = tmp_path_factory.mktemp("v2") / "CosyVoice2-0.5B"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    torch.set_num_threads(1)
    loaded = load_engine(target, threads=1)
    assert isinstance(loaded, CosyVoice2Engine)
    loaded.add_voice(_voice("tester", 60))
    return loaded


@pytest.fixture
def fresh(engine: CosyVoice2Engine) -> Iterator[CosyVoice2Engine]:
    """The engine, with whatever a test replaces or adds (forced tokens, injected noise,
    voices) put back."""
    generate, noise = engine.models.llm.generate, engine.hift_noise
    voices, speakers = dict(engine.voices), list(engine.speakers)
    yield engine
    engine.models.llm.generate, engine.hift_noise = generate, noise  # type: ignore[method-assign]
    engine.voices, engine.speakers = voices, speakers


def _voice(name: str, n_tokens: int, seed: int = 0) -> CustomVoice:
    g = torch.Generator().manual_seed(seed)
    features = PromptFeatures(
        torch.randn(1, 192, generator=g),
        torch.randint(0, 6561, (1, n_tokens), generator=g, dtype=torch.int32),
        torch.randn(1, 2 * n_tokens, 80, generator=g),
    )
    return CustomVoice(name, "Hello there, my friend.", "en", features, 2.0, family="cosyvoice2")


def _random_tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class ForcedTokens:
    """Stands in for the LM's ``generate``: yields planned tokens, counting them."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.yielded = tokens, 0

    def __call__(self, *args: object, **kwargs: object) -> Iterator[int]:
        for token in self.tokens:
            self.yielded += 1
            yield token


def _force(engine: CosyVoice2Engine, tokens: list[int]) -> ForcedTokens:
    forced = ForcedTokens(tokens)
    engine.models.llm.generate = forced  # type: ignore[method-assign]
    return forced


def expand(codes: torch.Tensor, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """An injected draw: the stored codes repeated over the row-major shape, scaled."""
    n = math.prod(shape)
    return (codes.to(torch.float32).repeat(-(-n // codes.numel()))[:n] * scale).view(shape)


class ReplayNoise:
    """One official run's recorded HiFT draws, chunk by chunk (tests/data/cosyvoice2/README)."""

    def __init__(self, run: str) -> None:
        self.run, self.chunk = run, 0

    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = f"{self.run}/chunk{self.chunk}/"
        self.chunk += 1
        phase = expand(CASES[prefix + "rng_phase_rand_codes"], (1, 9), 1 / 256)
        sine = expand(CASES[prefix + "rng_sine_noise_codes"], (1, n_samples, 9), 1 / 32)
        return phase.view(1, 9, 1), sine.transpose(1, 2)


def _official_voice(scenario: str) -> CustomVoice:
    """The scenario's flow prompt as a voice (the LM's part is moot: its tokens are forced)."""
    embedding = CASES[f"{scenario}/in_flow_embedding"]
    tokens = CASES.get(f"{scenario}/in_flow_prompt_speech_token", torch.zeros(1, 0))
    feat = CASES.get(f"{scenario}/in_prompt_speech_feat", torch.zeros(1, 0, 80))
    features = PromptFeatures(embedding, tokens.to(torch.int32), feat)
    return CustomVoice(scenario, "Hello.", "en", features, 1.0, family="cosyvoice2")


def _official_chunks(run: str) -> list[torch.Tensor]:
    count = len({k.split("/")[2] for k in CASES if k.startswith(run + "/chunk")})
    return [CASES[f"{run}/chunk{i}/speech_out"] for i in range(count)]


@pytest.mark.parity
@pytest.mark.parametrize("scenario", ["prompt17", "noprompt180"])
def test_streamed_audio_equals_the_official_stream(fresh: CosyVoice2Engine, scenario: str) -> None:
    """The official schedule through the engine: the official runtime's chunks, for the same
    tokens and HiFT draws, chunk for chunk."""
    fresh.add_voice(_official_voice(scenario))
    _force(fresh, CASES[f"{scenario}/in_source_speech_token"][0].tolist())
    run = f"{scenario}/stream"
    fresh.hift_noise = lambda seed: ReplayNoise(run)
    options = SynthesisOptions(speaker=scenario, stream=True, schedule=OFFICIAL_SCHEDULE, seed=0)
    chunks = list(fresh.synthesize("Hello.", options))
    expected = _official_chunks(run)
    assert [len(c.samples) for c in chunks] == [len(e) for e in expected]
    atols = stream_atols([len(e) for e in expected], 24000)
    for i, (got, want) in enumerate(zip(chunks, expected, strict=True)):
        assert got.sample_rate == 24000
        atol = atols[i]
        torch.testing.assert_close(
            torch.from_numpy(got.samples), want, atol=atol, rtol=0, msg=f"chunk {i}"
        )


@pytest.mark.parity
def test_whole_audio_equals_the_official_non_streaming_call(fresh: CosyVoice2Engine) -> None:
    fresh.add_voice(_official_voice("prompt17"))
    _force(fresh, CASES["prompt17/in_source_speech_token"][0].tolist())
    fresh.hift_noise = lambda seed: ReplayNoise("prompt17/nonstream")
    chunks = list(fresh.synthesize("Hello.", SynthesisOptions(speaker="prompt17", stream=False)))
    (want,) = _official_chunks("prompt17/nonstream")
    assert len(chunks) == 1
    atol = waveform_atol(len(want), 24000)
    torch.testing.assert_close(torch.from_numpy(chunks[0].samples), want, atol=atol, rtol=0)


def test_low_latency_stream_starts_after_its_first_hop_and_the_look_ahead(
    fresh: CosyVoice2Engine,
) -> None:
    """The default schedule's first hop is 21 units of 20 ms: 11 CosyVoice2 tokens. The 60-token
    prompt is cut to one whole chunk and 14 tokens of the next, so the first chunk (14 prompt
    tokens, 11 new) needs 11 tokens plus 3 of look-ahead; then hops end on chunk boundaries,
    growing to the schedule's 100 units (50 tokens)."""
    forced = _force(fresh, _random_tokens(190))
    stream = fresh.synthesize("Hello.", SynthesisOptions(speaker="tester", seed=3))
    first = next(stream)
    assert forced.yielded == 11 + 3
    rest = list(stream)
    lengths = [len(c.samples) for c in [first, *rest]]
    tokens = [11, 25, 50, 50, 50, 4]
    held = [-HELD_BACK, 0, 0, 0, 0, HELD_BACK]
    assert lengths == [n * SAMPLES_PER_TOKEN + h for n, h in zip(tokens, held, strict=True)]


class SlowTokens(ForcedTokens):
    """Forced tokens that each take ``token_s`` on ``clock``: an LM as slow as a real one."""

    def __init__(self, tokens: list[int], clock: list[float], token_s: float) -> None:
        super().__init__(tokens)
        self.clock, self.token_s = clock, token_s

    def __call__(self, *args: object, **kwargs: object) -> Iterator[int]:
        for token in super().__call__():
            self.clock[0] += self.token_s
            yield token


@pytest.mark.parametrize(("seed", "tokens"), [(None, [11, 25, 25, 25, 25, 25, 50, 4]),
                                              (3, [11, 25, 50, 50, 50, 4])])  # fmt: skip
def test_a_paced_stream_cuts_what_the_listeners_buffer_covers(
    fresh: CosyVoice2Engine, monkeypatch: pytest.MonkeyPatch, seed: int | None, tokens: list[int]
) -> None:
    """A token costs 30 ms of its 40 ms of audio (a simulated clock): the schedule's 50-token
    hop would cost 1.5 s while 1 s of audio waits, so a paced stream keeps to 25-token hops
    until the listener's buffer covers one; a fixed seed asks for the same audio every time
    and is cut at the schedule's hops."""
    clock = [0.0]

    class Clocked(ChunkPacer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "clock": lambda: clock[0]})

    monkeypatch.setattr("engine.core.pacing.ChunkPacer", Clocked)
    fresh.models.llm.generate = SlowTokens(_random_tokens(190), clock, 0.03)  # type: ignore[method-assign]
    paced = replace(LOW_LATENCY_SCHEDULE, paced=True)
    options = SynthesisOptions(speaker="tester", seed=seed, schedule=paced)
    lengths = [len(c.samples) for c in fresh.synthesize("Hello.", options)]
    held = [-HELD_BACK] + [0] * (len(tokens) - 2) + [HELD_BACK]
    assert lengths == [n * SAMPLES_PER_TOKEN + h for n, h in zip(tokens, held, strict=True)]


def test_a_seed_gives_the_same_audio_and_streams_share_the_primed_prompt(
    fresh: CosyVoice2Engine,
) -> None:
    """Twice the same request: the second forks the prompt stream the first computed."""
    tokens = _random_tokens(80)

    def audio() -> np.ndarray:
        _force(fresh, tokens)
        options = SynthesisOptions(speaker="tester", seed=5)
        return np.concatenate([c.samples for c in fresh.synthesize("Hello.", options)])

    first = audio()
    assert fresh.primed.keys() == [("tester", 10, 0.7, 39, "fp32", "euler")]
    np.testing.assert_array_equal(audio(), first)
    assert len(first) == 80 * SAMPLES_PER_TOKEN


def test_the_last_voice_stays_primed_for_every_setting_it_was_asked_in(
    fresh: CosyVoice2Engine,
) -> None:
    """A server choosing among profiles per request finds each one's prompt computed; another
    voice takes the place of the first."""
    realtime, fastest = (
        SynthesisOptions(speaker="tester"),
        SynthesisOptions(speaker="tester", n_timesteps=4, cfg_rate=0.0),
    )
    fresh.prime_voice(realtime)
    fresh.prime_voice(fastest)
    streams = {key: fresh.primed.stream(key) for key in fresh.primed.keys()}
    assert [key[:3] for key in streams] == [("tester", 10, 0.7), ("tester", 4, 0.0)]
    fresh.prime_voice(realtime)  # found, not computed again
    assert {key: fresh.primed.stream(key) for key in fresh.primed.keys()} == streams

    fresh.add_voice(_voice("other", 60))
    fresh.prime_voice(SynthesisOptions(speaker="other"))
    assert [key[:3] for key in fresh.primed.keys()] == [("other", 10, 0.7)]


def test_a_setting_no_request_will_use_lets_go_of_its_primed_prompt(
    fresh: CosyVoice2Engine,
) -> None:
    realtime = SynthesisOptions(speaker="tester")
    fastest = SynthesisOptions(speaker="tester", n_timesteps=4, cfg_rate=0.0)
    fresh.prime_voice(realtime)
    fresh.prime_voice(fastest)
    fresh.unprime_voice(realtime)
    assert [key[:3] for key in fresh.primed.keys()] == [("tester", 4, 0.0)]
    fresh.unprime_voice(realtime)  # nothing primed for it: nothing to do
    assert [key[:3] for key in fresh.primed.keys()] == [("tester", 4, 0.0)]


def test_the_warm_up_leaves_no_voice_primed(fresh: CosyVoice2Engine) -> None:
    """What the server primes (its profiles' settings) is all the primed memory it holds."""
    fresh.prime_voice(SynthesisOptions(speaker="tester"))
    fresh.warmup()
    assert not fresh.primed.keys()


def test_the_default_stream_keeps_its_keys_and_values_in_half_precision(
    fresh: CosyVoice2Engine,
) -> None:
    """Half the stream's largest memory by default; the deviation is bounded in
    tests/engine_tests/cosyvoice2/test_cosyvoice2_flow.py."""
    assert fresh.flow_cache_dtype == torch.float16
    fresh.prime_voice(SynthesisOptions(speaker="tester"))
    primed = fresh.primed.stream(("tester", 10, 0.7, 39, "fp32", "euler"))
    assert primed is not None
    pages = [page for state in primed.step_states for kv in state.kv for page in kv.pages]
    assert pages and all(k.dtype == v.dtype == torch.float16 for k, v in pages)


def test_a_new_request_stops_at_a_set_cancel_event(fresh: CosyVoice2Engine) -> None:
    forced = _force(fresh, _random_tokens(400))
    cancel = threading.Event()
    stream = fresh.synthesize("Hello.", SynthesisOptions(speaker="tester", seed=0), cancel)
    next(stream)
    cancel.set()
    with pytest.raises(SynthesisCancelled):
        list(stream)
    assert forced.yielded < 400  # the LM stopped too


def test_cancellation_is_checked_per_token(fresh: CosyVoice2Engine) -> None:
    """Set before the first chunk is complete: no audio at all."""
    cancel = threading.Event()
    tokens = _random_tokens(400)

    def set_midway(*args: object, **kwargs: object) -> Iterator[int]:
        for index, token in enumerate(tokens):
            if index == 10:
                cancel.set()
            yield token

    fresh.models.llm.generate = set_midway  # type: ignore[method-assign]
    with pytest.raises(SynthesisCancelled):
        next(fresh.synthesize("Hello.", SynthesisOptions(speaker="tester"), cancel))


def test_the_real_lm_speaks_every_mode(fresh: CosyVoice2Engine) -> None:
    """Zero-shot (English text, English transcript), cross-lingual and instruct2, whole and
    streamed, on the tiny LM with a fixed token count."""
    for text, instruct, stream in (
        ("Hello world.", None, True),
        ("你好，世界。", None, False),
        ("你好，世界。", "用四川话说这句话", True),
    ):
        options = SynthesisOptions(
            speaker="tester", stream=stream, seed=1, force_tokens=40, instruct=instruct
        )
        audio = np.concatenate([c.samples for c in fresh.synthesize(text, options)])
        assert len(audio) == 40 * SAMPLES_PER_TOKEN
        assert np.isfinite(audio).all() and np.abs(audio).max() > 0


def test_a_voice_must_be_known(fresh: CosyVoice2Engine, tmp_path: Path) -> None:
    with pytest.raises(UnknownSpeakerError, match="unknown voice 'nobody'; available: tester$"):
        next(fresh.synthesize("Hello.", SynthesisOptions(speaker="nobody")))
    bare = CosyVoice2Engine(fresh.models, frontend=fresh.frontend)
    with pytest.raises(UnknownSpeakerError, match="no built-in speakers and no voice was given"):
        next(bare.synthesize("Hello."))
    bare.warmup()  # nothing to warm up with: skipped, not an error


def test_the_engine_is_picked_by_the_model_directory() -> None:
    from engine.cosyvoice1.engine import CosyVoiceEngine

    assert model_family(TINY).engine_class() is CosyVoice2Engine
    assert model_family(V1_TINY).engine_class() is CosyVoiceEngine
    with pytest.raises(
        ModelLoadError, match=r"missing cosyvoice\.yaml \(CosyVoice v1\) or cosyvoice2\.yaml"
    ):
        load_engine(DATA)


class RecordingLM:
    """Stands in for the LM's ``generate``: records its inputs, yields planned tokens."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.calls: list[tuple[list[int], list[int], list[int]]] = []

    def __call__(
        self, text_ids: list[int], prompt_text_ids: list[int], prompt_speech: list[int], **_: object
    ) -> Iterator[int]:
        self.calls.append((list(text_ids), list(prompt_text_ids), list(prompt_speech)))
        yield from self.tokens


def test_the_callers_split_and_language_are_used(fresh: CosyVoice2Engine) -> None:
    """A sentence the caller split off is one segment; the caller's language chooses the mode
    (the voice's transcript is English: zero-shot for English, cross-lingual otherwise)."""
    lm = RecordingLM(_random_tokens(30))
    fresh.models.llm.generate = lm  # type: ignore[method-assign]
    text = (
        "The first sentence is here, and it is a rather long one with many words in it. And "
        "the second one follows it, also with plenty of words to make it long enough. A third "
        "sentence closes the paragraph with a few more words than needed."
    )
    list(fresh.synthesize(text, SynthesisOptions(speaker="tester", stream=False)))
    list(fresh.synthesize(text, SynthesisOptions(speaker="tester", stream=False, split=False)))
    assert len(lm.calls) == 3  # split in two, then kept whole
    zero_shot = lm.calls[-1]
    assert zero_shot[1] and zero_shot[2]  # transcript ids and prompt speech tokens
    lm.calls.clear()
    options = SynthesisOptions(speaker="tester", stream=False, split=False, language="zh")
    list(fresh.synthesize(text, options))
    (cross_lingual,) = lm.calls
    assert cross_lingual[1:] == ([], [])


# --- the synthesize command --------------------------------------------------------------------

ONNX = TESTS / "data" / "zero_shot" / "onnx"
PROMPT_16K = TESTS / "data" / "zero_shot" / "prompt16k_pcm16.wav"


def test_synthesize_without_a_voice_says_how_to_give_one(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = model.parent / "out.wav"
    argv = ["synthesize", "--model-dir", str(model), "--text", "Hello.", "--out", str(out)]
    assert main(argv) == 2
    assert "has no built-in speakers: give it a voice with --voices-dir" in caplog.text
    assert not out.exists()


def test_synthesize_speaks_with_a_voice_from_a_recording(model: Path) -> None:
    """The tiny model with stand-in prompt models: a voices folder, a 24 kHz WAV."""
    shutil.copy(ONNX / "tiny_campplus.onnx", model / "campplus.onnx")
    shutil.copy(ONNX / "tiny_speech_tokenizer_v2.onnx", model / "speech_tokenizer_v2.onnx")
    voices = model.parent / "voices"
    voices.mkdir()
    with wave.open(str(PROMPT_16K), "rb") as recording:
        pcm, params = recording.readframes(recording.getnframes()), recording.getparams()
    with wave.open(str(voices / "anna.wav"), "wb") as doubled:  # 5 s: long enough for a voice
        doubled.setparams(params)
        doubled.writeframes(pcm + pcm)
    (voices / "anna.txt").write_text("希望你以后能够做的比我还好呦。", encoding="utf-8")
    out = model.parent / "out.wav"
    argv = ["synthesize", "--model-dir", str(model), "--voices-dir", str(voices)]
    argv += ["--speaker", "anna", "--text", "你好。", "--out", str(out), "--seed", "1", "--stream"]
    assert main(argv) == 0
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getframerate()) == (1, 24000)
        assert wav.getnframes() > 0
    assert (voices / "anna.cosyvoice2.prompt.pt").is_file()


def test_the_float_estimator_runs_its_transformer_layers_on_onednn(
    engine: CosyVoice2Engine,
) -> None:
    """As v1's: every Linear of its transformer blocks, where torch has oneDNN's matmul (the
    official-stream test above holds with them)."""
    from engine.core.estimator_blocks import TransformerBlock
    from engine.core.onednn_layers import OneDnnLinear, onednn_linear_available

    blocks = [
        m for m in engine.models.flow.decoder.estimator.modules() if isinstance(m, TransformerBlock)
    ]
    layers = [
        m for block in blocks for m in block.modules() if isinstance(m, (nn.Linear, OneDnnLinear))
    ]
    assert blocks and layers
    assert all(isinstance(m, OneDnnLinear) == onednn_linear_available() for m in layers)


def test_hops_are_whole_attention_chunks() -> None:
    # In the schedule's own 20 ms units (50 a second): hops are its values, rounded to chunks.
    low_latency = chunk_hops(LOW_LATENCY_SCHEDULE, 25)
    assert list(itertools.islice(low_latency, 5)) == [25, 50, 100, 100, 100]
    custom = StreamSchedule(first_hop=60, growth=1.5, max_hop=140)
    assert list(itertools.islice(chunk_hops(custom, 25), 4)) == [75, 100, 125, 125]
    # A prompt 3 tokens into its last chunk: the first hop ends on the chunk's end.
    assert list(itertools.islice(chunk_hops(LOW_LATENCY_SCHEDULE, 25, 53), 3)) == [22, 50, 100]
    # CosyVoice2's 25 tokens a second: the same durations in half as many tokens.
    v2 = chunk_hops(LOW_LATENCY_SCHEDULE, 25, 39, token_rate=25)
    assert list(itertools.islice(v2, 5)) == [11, 25, 50, 50, 50]


def test_the_prompt_keeps_what_the_first_hop_does_not_fill() -> None:
    """The first chunk holds the first hop's new tokens; the prompt fills the rest of it, and
    at least the look-ahead of its last whole chunk."""
    assert prompt_tail(LOW_LATENCY_SCHEDULE, 25, 3, token_rate=25) == 25 - 11
    assert prompt_tail(StreamSchedule(first_hop=44), 25, 3, token_rate=25) == 3  # 22 new tokens
    assert prompt_tail(StreamSchedule(first_hop=46), 25, 3, token_rate=25) == 3  # 23: one chunk on
    assert prompt_tail(StreamSchedule(first_hop=1), 25, 3, token_rate=25) == 24


def test_a_gapless_start_holds_chunks_back_but_changes_no_sample(
    fresh: CosyVoice2Engine,
) -> None:
    tokens = _random_tokens(120)

    def audio(policy: str) -> np.ndarray:
        _force(fresh, tokens)
        options = SynthesisOptions(speaker="tester", seed=2, start_policy=policy)
        return np.concatenate([c.samples for c in fresh.synthesize("Hello.", options)])

    np.testing.assert_array_equal(audio("gapless"), audio("eager"))


def test_the_heap_is_given_back_once_the_answers_flow_state_is_gone(
    fresh: CosyVoice2Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last trim of a request runs after its speech stream (the flow's keys and values) is
    garbage, so an idle server does not hold the last answer's state."""
    import weakref

    import engine.cosyvoice2.engine as module

    streams: list[weakref.ref[object]] = []
    trims: list[bool] = []  # per trim: were all streams so far already gone?

    class Recorded(module.SpeechStream):  # type: ignore[misc,name-defined]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)
            streams.append(weakref.ref(self))

    monkeypatch.setattr(module, "SpeechStream", Recorded)
    monkeypatch.setattr(
        module, "give_back_free_heap", lambda: trims.append(all(r() is None for r in streams))
    )
    _force(fresh, _random_tokens(60))
    chunks = list(fresh.synthesize("Hello.", SynthesisOptions(speaker="tester", seed=1)))
    assert chunks and streams
    assert trims and trims[-1] is True
