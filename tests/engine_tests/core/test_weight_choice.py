"""An engine loaded with extra weight formats serves each request in the format it asks for,
and tells a listener what each stage cost (engine.core.stage_times).

The `auto` profile rests on both: one process holds the float32 and int8 flows (and HiFT in
float32 and bfloat16), and the costs it chooses by are the ones the engine measured.
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DATA, INT8_KERNELS_NEEDED

from engine.core import int4
from engine.core.cpu import detect
from engine.core.int4 import Int4Linear
from engine.core.lm_thread import LmTokens
from engine.core.prepared import PREPARED_DIR
from engine.core.runtime import weight_combinations
from engine.core.stage_times import StageTime
from engine.core.types import SynthesisOptions
from engine.cosyvoice1.engine import CosyVoiceEngine
from engine.family import load_engine
from engine.prompt.extract import PromptFeatures
from engine.prompt.voices import CustomVoice

TINY = DATA / "tiny_model"
V2_TINY = DATA / "cosyvoice2" / "tiny"
EXTRAS = ("flow.int8", "hift.bf16")
CPU = detect()


def _copy(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    return target


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> CosyVoiceEngine:
    """The tiny v1 model with its float32 flow and HiFT, and the int8 flow and bfloat16 HiFT."""
    torch.set_num_threads(1)
    target = _copy(TINY, tmp_path_factory.mktemp("both") / "CosyVoice-300M-SFT")
    return CosyVoiceEngine.load(target, threads=1, extra_formats=EXTRAS)


def _audio(engine: object, options: SynthesisOptions, text: str = "Hello there.") -> torch.Tensor:
    chunks = engine.synthesize(text, options)  # type: ignore[attr-defined]
    return torch.cat([torch.from_numpy(chunk.samples) for chunk in chunks])


def test_the_extra_formats_are_loaded_beside_the_primary_ones(both: CosyVoiceEngine) -> None:
    flows = ("fp32", "int8") if CPU.int8_kernels is not None else ("fp32",)
    hifts = ("fp32", "bf16") if CPU.bfloat16 else ("fp32",)
    assert both.weight_formats == {"llm": ("fp32",), "flow": flows, "hift": hifts}
    assert both.models.flow is both.flows["fp32"]  # the primary ones stay the models'


@pytest.mark.skipif(CPU.int8_kernels is None, reason=INT8_KERNELS_NEEDED)
def test_a_request_runs_the_flow_format_it_asks_for(both: CosyVoiceEngine, tmp_path: Path) -> None:
    options = SynthesisOptions(seed=3, force_tokens=60, stream=False)
    int8_only = CosyVoiceEngine.load(_copy(TINY, tmp_path / "m"), threads=1, flow_int8=True)
    asked = _audio(both, SynthesisOptions(**{**options.__dict__, "flow_weights": "int8"}))
    torch.testing.assert_close(asked, _audio(int8_only, options))
    assert not torch.equal(asked, _audio(both, options))  # the default is the primary fp32
    # A format the engine did not load falls back to the primary one, as a CPU without its
    # kernels does at load.
    fp32_only = CosyVoiceEngine.load(_copy(TINY, tmp_path / "f"), threads=1)
    absent = SynthesisOptions(**{**options.__dict__, "flow_weights": "int8"})
    torch.testing.assert_close(_audio(fp32_only, absent), _audio(fp32_only, options))


def test_each_stage_reports_its_cost_in_the_format_it_ran(both: CosyVoiceEngine) -> None:
    heard: list[StageTime] = []
    flow, hift = both.weight_formats["flow"][-1], both.weight_formats["hift"][-1]
    options = SynthesisOptions(seed=1, force_tokens=80, n_timesteps=3, cfg_rate=0.7,
                               flow_weights=flow, hift_weights=hift,
                               on_stage=heard.append)  # fmt: skip
    audio_s = len(_audio(both, options)) / both.sample_rate
    stages = {t.stage for t in heard}
    assert stages == {"lm_prefill", "lm_token", "flow", "hift"}
    assert all(t.seconds >= 0 for t in heard)
    assert {t.weights for t in heard if t.stage == "flow"} == {flow}
    assert {t.weights for t in heard if t.stage == "hift"} == {hift}
    assert {t.weights for t in heard if t.stage.startswith("lm")} == {"fp32"}
    # The first chunk's 41 tokens are sampled in the caller's thread: the first one is the
    # prefill, the 40 others are timed per token (the LM thread beside the vocoder is not).
    assert [t.units for t in heard if t.stage.startswith("lm")] == [1, 40]
    # The flow's units: frames × steps × 2 rows with guidance; the first chunk's 41 tokens
    # are 70 frames.
    first_flow = next(t for t in heard if t.stage == "flow")
    assert first_flow.units == 70 * 3 * 2
    # HiFT is fed each second of audio once, plus the 20 frames of context of each later chunk.
    fed = sum(t.units for t in heard if t.stage == "hift")
    chunks = sum(t.stage == "hift" for t in heard)
    assert fed == pytest.approx(audio_s + (chunks - 1) * 20 * 256 / 22050, abs=0.05)


def test_without_guidance_the_flow_counts_one_row(both: CosyVoiceEngine) -> None:
    heard: list[StageTime] = []
    options = SynthesisOptions(seed=1, force_tokens=30, stream=False, n_timesteps=2,
                               cfg_rate=0.0, on_stage=heard.append)  # fmt: skip
    _audio(both, options)
    (flow,) = [t for t in heard if t.stage == "flow"]
    assert flow.units == 51 * 2  # 30 tokens: 51 frames, one row
    # Not streamed: every token is sampled in the caller's thread.
    assert [t.units for t in heard if t.stage == "lm_token"] == [29]


def test_the_warm_up_runs_every_loaded_format(both: CosyVoiceEngine) -> None:
    ran: list[tuple[str | None, ...]] = []
    synthesize = both.synthesize

    def recording(text: str, options: SynthesisOptions | None = None, cancel=None):  # type: ignore[no-untyped-def]
        assert options is not None
        ran.append((options.lm_weights, options.flow_weights, options.hift_weights))
        return synthesize(text, options, cancel)

    both.synthesize = recording  # type: ignore[method-assign]
    try:
        both.warmup()
    finally:
        del both.synthesize
    assert ran == weight_combinations(both.lms, both.flows, both.hifts)
    for index, loaded in enumerate((both.lms, both.flows, both.hifts)):
        assert {formats[index] for formats in ran} == set(loaded)


def test_weight_combinations_cover_each_format_once_beside_a_primary() -> None:
    assert weight_combinations(["fp32"], ["fp32"]) == [("fp32", "fp32")]
    assert weight_combinations(["fp32", "int8"], ["fp32", "bf16"]) == [
        ("fp32", "fp32"),
        ("int8", "bf16"),
    ]
    assert weight_combinations(["int8", "int4"], ["int8", "fp32"], ["bf16"]) == [
        ("int8", "int8", "bf16"),
        ("int4", "fp32", "bf16"),
    ]


@pytest.mark.parametrize("extra", ["llm.int2", "vocoder.int8"])
def test_an_unknown_extra_format_is_refused(tmp_path: Path, extra: str) -> None:
    with pytest.raises(ValueError, match=f"'{extra}'"):
        CosyVoiceEngine.load(_copy(TINY, tmp_path / "m"), extra_formats=[extra])


@pytest.fixture
def int4_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The int4 LM loads whether or not it beats int8 on this CPU (another test's question)."""
    if CPU.int8_kernels is None or int4.choose_int4_kernel() is None:
        pytest.skip("no int8 or int4 kernel on this CPU")
    monkeypatch.setattr(int4, "int4_fast_here", lambda: True)


def _load_tiny(family: str, target: Path, **weights: object) -> object:
    """The tiny model of ``family`` (v2: with a random voice, ``tester``)."""
    source, name = (TINY, "CosyVoice-300M-SFT") if family == "v1" else (V2_TINY, "CosyVoice2-0.5B")
    model = target / name
    if not model.exists():
        _copy(source, model)
    engine = load_engine(model, threads=1, cache_dir=target / "cache", **weights)
    if family == "v2":
        engine.add_voice(_v2_voice())
    return engine


@pytest.mark.usefixtures("int4_runs")
@pytest.mark.parametrize("family", ["v1", "v2"])
def test_a_request_runs_the_lm_format_it_asks_for(family: str, tmp_path: Path) -> None:
    """An int8 LM with the int4 one beside it: a request asking for int4 gets the audio an
    int4-only engine makes, and the two LMs hold their common layers once."""
    both = _load_tiny(family, tmp_path, lm_int8=True, extra_formats=["llm.int4"])
    assert both.weight_formats["llm"] == ("int8", "int4")  # type: ignore[attr-defined]
    heard: list[StageTime] = []
    speaker = None if family == "v1" else "tester"
    options = SynthesisOptions(speaker=speaker, seed=5, force_tokens=40, stream=False)
    asking = SynthesisOptions(
        **{**options.__dict__, "lm_weights": "int4", "on_stage": heard.append}
    )
    int4_only = _load_tiny(family, tmp_path, lm_int4=True)
    asked = _audio(both, asking)
    torch.testing.assert_close(asked, _audio(int4_only, options), rtol=0, atol=0)
    assert not torch.equal(asked, _audio(both, options))  # the default is the primary int8
    assert {t.weights for t in heard if t.stage.startswith("lm")} == {"int4"}
    # Shared: every layer but the 4-bit ones is the int8 LM's own object.
    lms = both.lms  # type: ignore[attr-defined]
    int8_layers = dict(lms["int8"].named_modules())
    leaves = [(n, m) for n, m in lms["int4"].named_modules() if n and not list(m.children())]
    four = [n for n, m in leaves if isinstance(m, Int4Linear)]
    assert four and all(not isinstance(int8_layers[n], Int4Linear) for n in four)
    assert all(m is int8_layers[n] for n, m in leaves if n not in four)


def test_a_custom_voice_counts_its_prompt_frames(both: CosyVoiceEngine) -> None:
    features = PromptFeatures(torch.zeros(1, 192), torch.zeros(1, 50, dtype=torch.int32),
                              torch.zeros(1, 86, 80))  # fmt: skip
    voice = CustomVoice("mine", "Hello.", "en", features, 1.0)
    both.custom_voices = SimpleNamespace(get={"mine": voice}.get)  # type: ignore[assignment]
    try:
        assert both.flow_prompt_frames("mine") == 86  # computed again in every chunk
        assert both.flow_prompt_frames(None) == 0 and both.flow_prompt_frames("中文女") == 0
    finally:
        both.custom_voices = None


def test_the_lm_time_is_its_own_not_the_consumers() -> None:
    """Only the time inside the LM's steps counts, not what the consumer does between tokens
    (it vocodes the first chunk before it asks for the next token)."""
    clock = [0.0]
    heard: list[StageTime] = []

    def tokens() -> Iterator[int]:
        clock[0] += 0.5  # the prefill
        yield 1
        for token in (2, 3, 4):
            clock[0] += 0.1
            yield token

    import engine.core.lm_thread as lm_thread

    real = lm_thread.time.perf_counter
    lm_thread.time.perf_counter = lambda: clock[0]  # type: ignore[assignment]
    try:
        for _ in LmTokens(tokens, threading.Event(), inline=None, on_stage=heard.append):
            clock[0] += 7.0  # the consumer's own work
    finally:
        lm_thread.time.perf_counter = real  # type: ignore[assignment]
    assert [(t.stage, t.units) for t in heard] == [("lm_prefill", 1), ("lm_token", 3)]
    assert [t.seconds for t in heard] == pytest.approx([0.5, 0.3])


def _v2_voice() -> CustomVoice:
    g = torch.Generator().manual_seed(0)
    features = PromptFeatures(
        torch.randn(1, 192, generator=g),
        torch.randint(0, 6561, (1, 60), generator=g, dtype=torch.int32),
        torch.randn(1, 120, 80, generator=g),
    )
    return CustomVoice("tester", "Hello there, my friend.", "en", features, 2.0,
                       family="cosyvoice2")  # fmt: skip


@pytest.mark.skipif(CPU.int8_kernels is None, reason=INT8_KERNELS_NEEDED)
def test_cosyvoice2_serves_and_times_the_format_asked_for(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    engine = load_engine(
        _copy(V2_TINY, tmp_path / "CosyVoice2-0.5B"), threads=1, extra_formats=EXTRAS
    )
    engine.add_voice(_v2_voice())
    assert engine.weight_formats["flow"] == ("fp32", "int8")
    heard: list[StageTime] = []
    base = SynthesisOptions(speaker="tester", seed=2, force_tokens=60, n_timesteps=2)
    fp32 = _audio(engine, base)
    int8 = _audio(engine, SynthesisOptions(**{**base.__dict__, "flow_weights": "int8",
                                              "on_stage": heard.append}))  # fmt: skip
    assert fp32.shape == int8.shape and not torch.equal(fp32, int8)
    assert {t.weights for t in heard if t.stage == "flow"} == {"int8"}
    assert {t.stage for t in heard} == {"lm_prefill", "lm_token", "flow", "hift"}
    assert engine.flow_prompt_frames("tester") == 0  # its prompt chunks are primed once
