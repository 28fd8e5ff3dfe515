"""The `auto` profile: per request, the most exact profile this machine speaks in time.

The rule (wyoming_cosyvoice.auto.profile.choose_profile) is checked with made-up costs; the
chunk plan it predicts from against the chunks the real engines cut; the measured costs
(wyoming_cosyvoice.auto.stage_costs) with scripted measurements; and the whole path through the
real server: a fake engine whose reported costs make a fast, a slow and a busy machine, and
the real engine on the tiny model.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import DATA, ROOT, FakeEngine
from fake_surface import FakeSurface

from engine.api import PrimesVoices, StreamGeometry
from engine.core.cpu import detect
from engine.core.stage_times import StageTime, flow_passes, flow_units
from engine.core.types import SynthesisOptions
from engine.cosyvoice1.engine import STREAM_GEOMETRY as V1_GEOMETRY
from engine.cosyvoice2.engine import ChunkedStreamGeometry
from wyoming_cosyvoice.auto.profile import (
    CALIBRATION_TEXT,
    GROWING_SPEECH_S,
    STALL_TOLERANCE_S,
    AutoProfile,
    calibration_tokens,
    choose_profile,
    plan_chunks,
    playback_stall,
    predict,
    speech_seconds,
)
from wyoming_cosyvoice.auto.stage_costs import LM_STAGES, CostMeter, StageCosts
from wyoming_cosyvoice.config import (
    AUTO_PROFILE,
    ConfigError,
    ProfileNotLoadedError,
    load_config,
)

CONFIG = load_config(None)
CANDIDATES = CONFIG.auto_candidates  # realtime, fast, faster, fastest
REALTIME, FAST, FASTER, FASTEST = CANDIDATES


# The LM formats' costs relative to the int8 LM's (the meter's prior ratios).
LM_RATIOS = {"int8": 1.0, "int4": 0.75, "fp32": 3.0}


def costs(scale: float = 1.0, cores: int = 2, **changes: Any) -> StageCosts:
    """The full-size model's stage costs on the reference machine (docs/performance.md:
    12.8 ms a token with the int8 LM, the flow 1.45 s and HiFT 0.32 s per audio second with
    realtime), times ``scale`` (2: a machine half as fast); the other LM formats by
    ``LM_RATIOS``."""
    base = StageCosts(
        lm_prefill_s={lm: 0.074 * scale * ratio for lm, ratio in LM_RATIOS.items()},
        lm_token_s={lm: 0.0128 * scale * ratio for lm, ratio in LM_RATIOS.items()},
        flow_s={"fp32": 0.00084 * scale, "int8": 0.00063 * scale},
        # HiFT 0.16 s in bf16 there; the int8 HiFT the fast profiles now run is given as much.
        hift_s={"fp32": 0.32 * scale, "bf16": 0.16 * scale, "int8": 0.16 * scale},
        cores=cores,
    )
    return replace(base, **changes)


# The candidates on the int8 LM, as the reference machine's figures were measured: the rule's
# tests below are about the rule, not the LM's format.
INT8_LM_CANDIDATES = [replace(c, lm_weights="int8") for c in CANDIDATES]


def choose(
    speech_s: float,
    stage_costs: StageCosts | None,
    target_s: float = 1.5,
    candidates: list[Any] = INT8_LM_CANDIDATES,
) -> Any:
    return choose_profile(candidates, stage_costs, speech_s, target_s, V1_GEOMETRY)


# --- the prediction ---------------------------------------------------------------------------


def test_the_prediction_reproduces_the_reference_machines_first_audio() -> None:
    """With the stage costs measured on the reference machine, the first audio it predicts
    is the one the benchmark measured there: realtime 1.89 s, and 0.83 s for the one Heun step
    with guidance that fastest then took (two flow evaluations), both with the int8 LM."""
    n_tokens = 400
    realtime = predict(REALTIME, costs(), n_tokens, V1_GEOMETRY)
    fastest = predict(replace(FASTER, lm_weights="int8"), costs(), n_tokens, V1_GEOMETRY)
    assert realtime.first_audio_s == pytest.approx(1.89, abs=0.05)
    assert fastest.first_audio_s == pytest.approx(0.83, abs=0.05)
    # Slower than real time: the 8 s answer pauses, realtime's far more than fastest's.
    assert realtime.stall_s > 5 * fastest.stall_s > 0


@pytest.mark.parametrize(("family", "scale"), [("v1", 1.0), ("v2", 1.5)])
def test_a_paced_schedule_is_predicted_as_the_engine_paces_it(family: str, scale: float) -> None:
    """A machine a little faster than real time stalls at each step up of the schedule's
    doubling hops; the prediction of a paced schedule cuts the hops the engine's pacer would
    (smaller where the buffer is short) and says so in its stall. A machine slower than real
    time keeps the schedule's hops."""
    geometry = V1_GEOMETRY if family == "v1" else V2_GEOMETRY
    unpaced = replace(FASTEST, schedule=replace(FASTEST.schedule, paced=False))
    paced = replace(FASTEST, schedule=replace(FASTEST.schedule, paced=True))
    plain = predict(unpaced, costs(scale), 400, geometry)
    kept = predict(paced, costs(scale), 400, geometry)
    assert plain.stall_s > 0.4
    assert kept.stall_s < 0.6 * plain.stall_s
    assert kept.first_audio_s == plain.first_audio_s  # the first hop is the schedule's
    slow = costs(3 * scale)
    assert predict(paced, slow, 400, geometry) == predict(unpaced, slow, 400, geometry)


def test_a_whole_request_is_every_stage_one_after_the_other() -> None:
    batch = CONFIG.profiles["batch"]  # not streamed: one chunk
    c = costs()
    p = predict(batch, c, 100, V1_GEOMETRY)
    frames = 100 * 22050 / 256 / 50
    expected = 0.074 + 99 * 0.0128 + frames * 10 * 2 * 0.00084 + 2.0 * 0.32
    assert p.first_audio_s == pytest.approx(expected) == p.compute_s
    assert p.stall_s == 0 and p.audio_s == pytest.approx(2.0)


def test_playback_stalls_when_a_chunk_is_late() -> None:
    assert playback_stall([1.0, 1.5, 2.0], [1.0, 1.0, 1.0]) == 0.0
    assert playback_stall([1.0, 2.5, 3.0], [1.0, 1.0, 1.0]) == pytest.approx(0.5)
    assert playback_stall([], []) == 0.0


def test_a_custom_voices_prompt_makes_every_v1_chunk_dearer() -> None:
    plain = predict(REALTIME, costs(), 200, V1_GEOMETRY)
    prompted = predict(REALTIME, costs(), 200, V1_GEOMETRY, prompt_frames=430)
    assert prompted.first_audio_s > plain.first_audio_s + 430 * 20 * 0.00084 * 0.99


def test_a_format_the_cpu_lacks_costs_what_the_engine_runs_instead() -> None:
    """A CPU without fast int8 convolutions runs HiFT in float32 whatever the profile asks,
    one without a fast int4 kernel the LM in int8."""
    without_int8 = {"llm": ("int8", "int4"), "flow": ("fp32", "int8"), "hift": ("fp32",)}
    asked = predict(FASTEST, costs(), 200, V1_GEOMETRY, loaded=without_int8)
    as_fp32 = predict(replace(FASTEST, hift_weights="fp32"), costs(), 200, V1_GEOMETRY)
    assert asked == as_fp32
    without_int4 = {"llm": ("int8",), "flow": ("fp32", "int8"), "hift": ("fp32", "int8")}
    asked = predict(FASTEST, costs(), 200, V1_GEOMETRY, loaded=without_int4)
    as_int8 = predict(replace(FASTEST, lm_weights="int8"), costs(), 200, V1_GEOMETRY)
    assert asked == as_int8


def test_a_profile_is_predicted_with_its_lm_formats_costs() -> None:
    """fastest's tokens cost the int4 LM's, realtime's the int8 LM's: the same profile on the
    int8 LM is later by the difference of their tokens' costs."""
    c = costs()
    int4 = predict(FASTEST, c, 200, V1_GEOMETRY)
    int8 = predict(replace(FASTEST, lm_weights="int8"), c, 200, V1_GEOMETRY)
    first_tokens = plan_chunks(FASTEST, 200, V1_GEOMETRY)[0].tokens - 1
    saved = 0.074 * 0.25 + first_tokens * 0.0128 * 0.25
    assert int8.first_audio_s - int4.first_audio_s == pytest.approx(saved)
    assert int4.compute_s < int8.compute_s


# --- the plan follows the engine's chunks -----------------------------------------------------


@pytest.fixture(scope="module")
def v1_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from engine.cosyvoice1.engine import CosyVoiceEngine

    torch.set_num_threads(1)
    target = tmp_path_factory.mktemp("v1") / "CosyVoice-300M-SFT"
    shutil.copytree(DATA / "tiny_model", target, ignore=shutil.ignore_patterns("prepared"))
    return CosyVoiceEngine.load(target, threads=1)


def _durations(engine: Any, profile: Any, tokens: int, speaker: str | None = None) -> list[float]:
    options = profile.options(speaker=speaker, seed=0, instruct=None, force_tokens=tokens)
    return [chunk.duration_s for chunk in engine.synthesize("Hello.", options)]


@pytest.mark.parametrize("tokens", [30, 41, 100, 333])
@pytest.mark.parametrize("name", ["realtime", "fast", "quality", "batch"])
def test_the_v1_plan_cuts_the_chunks_the_engine_cuts(
    v1_engine: Any, name: str, tokens: int
) -> None:
    profile = CONFIG.profiles[name]
    made = _durations(v1_engine, profile, tokens)
    planned = [chunk.audio_s for chunk in plan_chunks(profile, tokens, v1_engine.stream_geometry)]
    assert len(planned) == len(made)
    assert planned == pytest.approx(made, abs=0.025)  # a mel frame's rounding per chunk


def _v2_engine(tmp_path: Path) -> Any:
    """The tiny CosyVoice2 model, without a voice."""
    from engine.family import load_engine

    torch.set_num_threads(1)
    target = tmp_path / "CosyVoice2-0.5B"
    shutil.copytree(DATA / "cosyvoice2" / "tiny", target, ignore=shutil.ignore_patterns("prepared"))
    return load_engine(target, threads=1)


def _add_v2_voice(engine: Any) -> None:
    """A 2.4 s prompt voice named ``tester``."""
    from engine.prompt.extract import PromptFeatures
    from engine.prompt.voices import CustomVoice

    g = torch.Generator().manual_seed(0)
    features = PromptFeatures(torch.randn(1, 192, generator=g),
                              torch.randint(0, 6561, (1, 60), generator=g, dtype=torch.int32),
                              torch.randn(1, 120, 80, generator=g))  # fmt: skip
    engine.add_voice(CustomVoice("tester", "Hello.", "en", features, 2.0, family="cosyvoice2"))


@pytest.fixture(scope="module")
def v2_engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = _v2_engine(tmp_path_factory.mktemp("v2"))
    _add_v2_voice(engine)
    return engine


def test_the_cosyvoice2_plan_cuts_the_chunks_the_engine_cuts(v2_engine: Any) -> None:
    engine = v2_engine
    geometry = engine.stream_geometry
    assert isinstance(geometry, ChunkedStreamGeometry) and geometry.token_rate == engine.token_rate
    for profile in (REALTIME, FASTEST):
        for tokens in (20, 90):
            made = _durations(engine, profile, tokens, speaker="tester")
            planned = [chunk.audio_s for chunk in plan_chunks(profile, tokens, geometry)]
            assert planned == pytest.approx(made, abs=0.045), (profile.name, tokens)


def _heard(engine: Any, profile: Any, tokens: int, speaker: str | None = None) -> list[StageTime]:
    options = profile.options(speaker=speaker, seed=0, instruct=None, force_tokens=tokens)
    heard: list[StageTime] = []
    for _ in engine.synthesize(CALIBRATION_TEXT, replace(options, on_stage=heard.append)):
        pass
    return heard


def _planned_work(
    profile: Any, tokens: int, geometry: StreamGeometry
) -> tuple[list[float], list[float]]:
    """Each planned chunk's flow units and HiFT seconds."""
    per_frame = flow_units(1, profile.n_timesteps, profile.cfg_rate, profile.solver)
    chunks = plan_chunks(profile, tokens, geometry)
    return [c.flow_frames * per_frame for c in chunks], [c.hift_s for c in chunks]


@pytest.mark.parametrize("family", ["cosyvoice", "cosyvoice2"])
def test_the_engine_reports_each_calls_work_as_the_plan_counts_it(
    v1_engine: Any, v2_engine: Any, family: str
) -> None:
    """A streamed request's flow and HiFT calls report the units the plan costs them in: the
    frames the flow computes (CosyVoice2's first chunk computes the prompt's unfinished
    attention chunk too), the seconds HiFT is fed."""
    engine, speaker = (v1_engine, None) if family == "cosyvoice" else (v2_engine, "tester")
    geometry = engine.stream_geometry
    assert geometry == GEOMETRIES[family]  # the fake engine below cuts as this one does
    for profile in (REALTIME, FAST, FASTEST):
        tokens = calibration_tokens(profile, geometry)
        heard = _heard(engine, profile, tokens, speaker)
        flow, hift = _planned_work(profile, tokens, geometry)
        per_frame = flow_units(1, profile.n_timesteps, profile.cfg_rate, profile.solver)
        reported = [t.units for t in heard if t.stage == "flow"]
        assert reported == pytest.approx(flow, abs=per_frame), profile.name  # a frame's rounding
        fed = [t.units for t in heard if t.stage == "hift"]
        assert fed == pytest.approx(hift, abs=0.025), profile.name


# --- the calibration --------------------------------------------------------------------------


V2_GEOMETRY = ChunkedStreamGeometry(
    token_rate=25,
    frames_per_token=2,
    overlap_tokens=0,
    lookahead_tokens=3,
    chunk_tokens=25,
    held_back_s=0.16,
    hift_context_s=0.16,
)
# The default voice's prompt: 5 s, whose 250 mel frames the CosyVoice2 flow attends to.
PROMPT_FRAMES = 250


class TimedEngine(FakeSurface):
    """A fake engine that reports what a request's stages would cost on a small machine,
    modelled beyond the meter's lines: the LM's way to its first token grows with the text,
    each flow pass (ODE step and batch row) costs a fixed part and, per frame, more the more
    frames it attends to (CosyVoice2: the prompt's and the earlier chunks'). Its chunks are the
    engine's (the test above ties the plan to them). Keeps each request's text and options."""

    weight_formats = {
        "llm": ("int8", "int4"),
        "flow": ("fp32", "int8"),
        "hift": ("fp32", "int8"),
    }
    FLOW_PASS_S = 0.01  # per ODE step and batch row
    FLOW_FRAME_S = {"fp32": 0.9e-3, "int8": 0.65e-3}  # per frame and pass
    HIFT = {"fp32": (0.03, 0.3), "int8": (0.02, 0.15)}  # per call, per second fed
    LM_TOKEN_S = {"int8": 0.03, "int4": 0.022}

    def __init__(self, geometry: StreamGeometry) -> None:
        self.geometry = geometry
        self.kind = "sft" if geometry is V1_GEOMETRY else "cosyvoice2"
        self.speakers = ["tester"]
        self.requests: list[tuple[str, SynthesisOptions]] = []

    @property
    def stream_geometry(self) -> StreamGeometry:
        return self.geometry

    def prefill_s(self, text: str, lm: str = "int8") -> float:
        return (0.25 + 0.005 * len(text)) * (0.8 if lm == "int4" else 1.0)

    def flow_s(
        self, weights: str, options: SynthesisOptions, frames: float, context: float
    ) -> float:
        rows = 2 if options.cfg_rate > 0 else 1
        per_frame = self.FLOW_FRAME_S[weights] * (1 + context / 500)
        return options.n_timesteps * rows * (self.FLOW_PASS_S + frames * per_frame)

    def synthesize(self, text: str, options: SynthesisOptions) -> Iterator[None]:
        self.requests.append((text, options))
        report = options.on_stage or (lambda time: None)
        flow_weights, hift_weights = options.flow_weights or "fp32", options.hift_weights or "fp32"
        lm = options.lm_weights or "int8"
        profile = replace(REALTIME, stream_audio=options.stream, schedule=options.schedule)
        assert options.force_tokens is not None
        chunks = plan_chunks(profile, options.force_tokens, self.geometry)
        # CosyVoice2 streams attend to the prompt; its non-streamed call computes it again.
        v2 = self.kind == "cosyvoice2"
        context = PROMPT_FRAMES if v2 and options.stream else 0.0
        extra = PROMPT_FRAMES if v2 and not options.stream else 0
        report(StageTime("lm_prefill", lm, self.prefill_s(text, lm), 1))
        for index, chunk in enumerate(chunks):
            if index == 1 or len(chunks) == 1:  # the first chunk's tokens, sampled inline
                inline = chunks[0].tokens - 1
                report(StageTime("lm_token", lm, inline * self.LM_TOKEN_S[lm], inline))
            frames = chunk.flow_frames + extra
            passes = flow_passes(options.n_timesteps, options.cfg_rate, options.solver)
            seconds = self.flow_s(flow_weights, options, frames, context)
            report(StageTime("flow", flow_weights, seconds, passes * frames, passes))
            call_s, per_s = self.HIFT[hift_weights]
            report(StageTime("hift", hift_weights, call_s + per_s * chunk.hift_s, chunk.hift_s))
            context += frames if v2 and options.stream else 0  # v1: each chunk on its own
            yield None


GEOMETRIES = {"cosyvoice": V1_GEOMETRY, "cosyvoice2": V2_GEOMETRY}


def _calibrated(geometry: StreamGeometry) -> tuple[TimedEngine, AutoProfile]:
    engine = TimedEngine(geometry)
    auto = AutoProfile(CONFIG.auto, CANDIDATES, CostMeter(lambda: 2))  # type: ignore[arg-type]
    auto.calibrate(engine)
    return engine, auto


@pytest.mark.parametrize("family", GEOMETRIES)
def test_the_calibration_is_a_streamed_request_of_an_answers_length(family: str) -> None:
    """Per combination of formats, the first profile's streamed request: its schedule and
    steps, the default voice, a sentence of an answer's length, its first chunk and the next."""
    geometry = GEOMETRIES[family]
    engine, _ = _calibrated(geometry)
    assert [(o.lm_weights, o.flow_weights, o.hift_weights) for _, o in engine.requests] == [
        ("int8", "fp32", "fp32"),
        ("int4", "int8", "int8"),
    ]
    for (text, options), profile in zip(engine.requests, (REALTIME, FAST), strict=True):
        assert text == CALIBRATION_TEXT and len(text) >= 30
        assert options.stream and options.schedule == profile.schedule
        assert (options.n_timesteps, options.cfg_rate) == (profile.n_timesteps, profile.cfg_rate)
        assert options.speaker is None
        chunks = plan_chunks(profile, 10_000, geometry)
        assert options.force_tokens == chunks[1].tokens


@pytest.mark.parametrize("family", GEOMETRIES)
def test_the_first_audio_predicted_is_what_a_streamed_request_pays(family: str) -> None:
    """After the calibration, a request's predicted first audio is what a streamed request's
    records say its first chunk took: the LM's way to the first token (for a sentence of an
    answer's length, not for a word's), the tokens up to the chunk, the chunk's flow call and
    its HiFT call."""
    geometry = GEOMETRIES[family]
    engine, auto = _calibrated(geometry)
    costs = auto.meter.costs()
    # No candidate runs the bfloat16 HiFT or the float32 LM.
    assert costs is not None
    assert costs.estimated == ("hift.bf16", "lm_prefill.fp32", "lm_token.fp32")
    assert costs.lm_prefill_s["int8"] == pytest.approx(engine.prefill_s(CALIBRATION_TEXT))
    assert costs.lm_prefill_s["int8"] > engine.prefill_s("Hello.") + 0.1
    assert costs.lm_token_s == pytest.approx(
        {**engine.LM_TOKEN_S, "fp32": 3.0 * engine.LM_TOKEN_S["int8"]}
    )
    for profile in (REALTIME, FAST):  # the first of each combination of formats
        heard: list[StageTime] = []
        options = profile.options(speaker=None, seed=0, instruct=None, force_tokens=200)
        for _ in engine.synthesize(CALIBRATION_TEXT, replace(options, on_stage=heard.append)):
            pass
        # The first record of each stage: the prefill, the first chunk's tokens, flow, HiFT.
        firsts = {t.stage: t.seconds for t in reversed(heard)}
        paid = sum(firsts.values())
        predicted = predict(profile, costs, 200, geometry).first_audio_s
        assert predicted == pytest.approx(paid, rel=0.02), profile.name


def test_a_calls_cost_is_a_fixed_part_and_a_part_per_unit() -> None:
    """The flow and HiFT calls of a streamed request, small and large, fit a line (the flow's
    per pass); calls of one size cannot tell its parts apart and cost per unit."""
    meter = CostMeter(lambda: 2)
    meter.record(StageTime("lm_prefill", "int8", 0.4, 1))
    meter.record(StageTime("lm_token", "int8", 0.3, 10))
    for units, hift_s in ((1000, 0.44), (1000, 1.16), (120, 0.28)):  # 20 passes: realtime's
        meter.record(StageTime("flow", "fp32", 20 * 0.01 + 1e-3 * units, units, 20))
        meter.record(StageTime("hift", "fp32", 0.03 + 0.3 * hift_s, hift_s))
    measured = meter.costs()
    assert measured is not None
    assert measured.flow("fp32") == pytest.approx((0.01, 1e-3))
    assert measured.hift("fp32") == pytest.approx((0.03, 0.3))
    assert measured.flow("int8") == pytest.approx((0.01 * 0.75, 1e-3 * 0.75))  # guessed alike
    assert measured.as_dict()["flow_ms_per_pass"]["fp32"] == pytest.approx(10.0)
    # The first chunk pays the flow's fixed part, once per pass.
    with_call = predict(REALTIME, measured, 100, V1_GEOMETRY).first_audio_s
    without = predict(REALTIME, replace(measured, flow_call_s={}), 100, V1_GEOMETRY).first_audio_s
    assert with_call == pytest.approx(without + 20 * 0.01)
    same = CostMeter(lambda: 2)
    for seconds in (1.2, 1.4):
        same.record(StageTime("flow", "fp32", seconds, 1000))
    assert same.measured()[2]["flow.fp32"] == pytest.approx((0.0, 1.22e-3))  # 0.9 : 0.1


def test_a_profile_without_guidance_is_predicted_from_one_with_it() -> None:
    """The flow's fit is per pass (ODE step and batch row): a profile with other steps and no
    guidance pays its own number of passes of the fixed part."""
    meter = CostMeter(lambda: 2)
    assert flow_passes(FAST.n_timesteps, FAST.cfg_rate) == 10
    for frames in (50, 50, 6):  # the calibration's calls: first chunk, next one, the last
        passes = flow_passes(FAST.n_timesteps, FAST.cfg_rate)
        seconds = passes * (0.03 + 1e-3 * frames)
        meter.record(StageTime("flow", "int8", seconds, passes * frames, passes))
    costs = meter.measured()[2]["flow.int8"]
    passes = flow_passes(4, 0.0)  # 4 steps without guidance: a profile of one's own
    assert passes == 4
    assert costs.seconds(passes * 50, passes) == pytest.approx(4 * (0.03 + 1e-3 * 50))


def test_a_fit_with_a_negative_fixed_part_costs_per_unit() -> None:
    """Noise that tilts the line below zero at no units: the average cost per unit instead."""
    meter = CostMeter(lambda: 2, call_alpha=0.5)
    meter.record(StageTime("flow", "fp32", 0.05, 100))
    meter.record(StageTime("flow", "fp32", 1.5, 1000))
    call_s, unit_s = meter.measured()[2]["flow.fp32"]
    assert call_s == 0.0 and unit_s == pytest.approx((0.05 + 1.5) / (100 + 1000))


def test_without_a_voice_the_calibration_is_skipped_until_one_is_added(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The real CosyVoice2 engine: no voice, no measurement (the first request measures);
    with one, its streamed calibration measures every stage."""
    caplog.set_level(logging.INFO, logger="wyoming_cosyvoice.auto.profile")
    engine = _v2_engine(tmp_path)
    auto = AutoProfile(CONFIG.auto, CANDIDATES, CostMeter(lambda: 1))  # type: ignore[arg-type]
    auto.calibrate(engine)
    assert auto.meter.measured() == {}
    assert "Stage costs not measured before the first request" in caplog.text
    _add_v2_voice(engine)
    auto.calibrate(engine)
    measured = auto.meter.costs()
    assert measured is not None and "Measured the stage costs" in caplog.text
    # Only the float32 flow and HiFT are loaded, and one LM.
    lm = engine.weight_formats["llm"][0]
    unrun_lm = [f"{stage}.{f}" for stage in LM_STAGES for f in ("int8", "int4", "fp32") if f != lm]
    assert measured.estimated == tuple(sorted(["flow.int8", "hift.bf16", "hift.int8", *unrun_lm]))


# --- the rule ---------------------------------------------------------------------------------


def test_a_fast_machine_gets_the_exact_profile() -> None:
    """Ten times the reference machine's speed keeps pace with realtime's maths."""
    choice = choose(3.0, costs(scale=0.1))
    assert choice.profile.name == "realtime"
    assert "within 1.5 s and no stall" in choice.reason
    assert set(choice.predictions) == {"realtime", "fast", "faster", "fastest"}


def test_realtime_is_passed_over_when_its_first_audio_is_late() -> None:
    """On the reference machine realtime's first audio (1.75 s for a short answer) misses
    1.5 s; fast's makes it and plays through."""
    choice = choose(0.7, costs())
    assert choice.profile.name == "fast", choice.reason
    assert "(realtime: first audio 1.75 s)" in choice.reason


def test_realtime_is_passed_over_when_it_would_stall() -> None:
    choice = choose(1.0, costs(scale=0.3))
    assert choice.profile.name == "fast", choice.reason
    assert "(realtime: stall 0.18 s)" in choice.reason


def test_a_longer_answer_on_the_same_machine_takes_a_cheaper_profile() -> None:
    """The same machine keeps pace with a short answer at fast's cost, not with a long one."""
    short, long = choose(1.0, costs(scale=0.45)), choose(3.0, costs(scale=0.45))
    assert (short.profile.name, long.profile.name) == ("fast", "faster")


def test_the_int4_lm_lets_a_more_exact_profile_keep_pace() -> None:
    """With the fast profiles' own int4 LM (0.75× the int8 LM's costs) fast keeps pace with
    the 3 s answer that needed faster on the int8 LM."""
    assert choose(3.0, costs(scale=0.45)).profile.name == "faster"
    long = choose(3.0, costs(scale=0.45), candidates=CANDIDATES)
    assert [c.lm_weights for c in CANDIDATES] == ["int8", "int4", "int4", "int4"]
    assert long.profile.name == "fast", long.reason
    assert long.predictions["fast"].stall_s <= STALL_TOLERANCE_S


def test_when_nothing_plays_through_the_least_stalling_in_time_wins() -> None:
    choice = choose(20.0, costs(scale=1.2))
    assert choice.profile.name == "fastest"
    assert "without a stall" in choice.reason and "stalls least" in choice.reason


def test_stalling_alike_the_more_exact_wins() -> None:
    """A 1 s answer on the reference machine: fast waits 0.18 s, fastest 0.12 s; closer than
    STALL_TOLERANCE_S, so they stall alike."""
    choice = choose(1.0, costs())
    stalls = [choice.predictions[name].stall_s for name in ("fast", "fastest")]
    assert stalls == pytest.approx([0.18, 0.12], abs=0.01)
    assert choice.profile.name == "fast"


def test_when_nothing_is_in_time_the_soonest_wins() -> None:
    choice = choose(2.0, costs(scale=3.0))
    assert choice.profile.name == "fastest"
    assert "no profile gets first audio within 1.5 s" in choice.reason


def test_a_longer_target_lets_the_exact_profile_through() -> None:
    assert choose(0.7, costs(), target_s=2.5).profile.name == "realtime"


def test_unmeasured_it_runs_the_most_exact_profile() -> None:
    choice = choose(2.0, None)
    assert choice.profile.name == "realtime" and "not measured" in choice.reason


def test_the_texts_length_is_its_estimated_speech() -> None:
    assert speech_seconds("Hello there, how are you?", None, V1_GEOMETRY) == pytest.approx(1.65)
    assert speech_seconds("你好世界", None, V1_GEOMETRY) == pytest.approx(0.88)
    assert speech_seconds("123", None, V1_GEOMETRY) == 0.5  # counted as a short word
    assert speech_seconds("whatever", 100, V1_GEOMETRY) == 2.0  # forced: exact


# --- the measured costs -----------------------------------------------------------------------


def _feed(
    meter: CostMeter, scale: float = 1.0, flow: str = "fp32", hift: str = "fp32", lm: str = "int8"
) -> None:
    meter.record(StageTime("lm_prefill", lm, 0.07 * scale, 1))
    meter.record(StageTime("lm_token", lm, 0.5 * scale, 40))
    meter.record(StageTime("flow", flow, 1.0 * scale, 1000))
    meter.record(StageTime("hift", hift, 0.3 * scale, 1.0))


def test_costs_are_unknown_until_every_stage_ran() -> None:
    meter = CostMeter(lambda: 2)
    assert meter.costs() is None
    meter.record(StageTime("lm_prefill", "int8", 0.07, 1))
    meter.record(StageTime("flow", "fp32", 1.0, 1000))
    assert meter.costs() is None
    meter.record(StageTime("lm_token", "int8", 0.5, 40))
    meter.record(StageTime("hift", "fp32", 0.3, 1.0))
    measured = meter.costs()
    assert measured is not None and measured.lm_token_s["int8"] == pytest.approx(0.0125)
    assert measured.flow_s["fp32"] == pytest.approx(0.001)


def test_the_lm_is_measured_once_a_format_has_both_its_stages() -> None:
    meter = CostMeter(lambda: 2)
    meter.record(StageTime("flow", "fp32", 1.0, 1000))
    meter.record(StageTime("hift", "fp32", 0.3, 1.0))
    meter.record(StageTime("lm_prefill", "int8", 0.07, 1))
    meter.record(StageTime("lm_token", "int4", 0.4, 40))
    assert meter.costs() is None  # the prefill of one format, the tokens of another
    meter.record(StageTime("lm_token", "int8", 0.5, 40))
    measured = meter.costs()
    assert measured is not None
    # The int4 LM's own tokens measured, but not its prefill: both guessed from the int8 LM's.
    assert measured.lm("int4") == pytest.approx((0.07 * 0.75, 0.0125 * 0.75))
    assert {"lm_prefill.int4", "lm_token.int4"} <= set(measured.estimated)


def test_the_lm_costs_are_kept_per_format() -> None:
    meter = CostMeter(lambda: 2)
    _feed(meter, lm="int8")
    _feed(meter, lm="int4", scale=0.72)
    measured = meter.costs()
    assert measured is not None
    assert measured.lm("int8") == pytest.approx((0.07, 0.0125))
    assert measured.lm("int4") == pytest.approx((0.07 * 0.72, 0.0125 * 0.72))
    assert measured.lm("fp32") == pytest.approx((0.07 * 3, 0.0125 * 3))  # the prior
    assert measured.estimated == (
        "flow.int8", "hift.bf16", "hift.int8", "lm_prefill.fp32", "lm_token.fp32"
    )  # fmt: skip
    shown = measured.as_dict()
    assert shown["lm_token_ms"] == pytest.approx({"int8": 12.5, "int4": 9.0, "fp32": 37.5})
    assert shown["lm_prefill_ms"] == pytest.approx({"int8": 70.0, "int4": 50.4, "fp32": 210.0})


def test_a_running_average_follows_the_machine() -> None:
    meter = CostMeter(lambda: 2, alpha=0.5)
    _feed(meter)
    _feed(meter, scale=3.0)
    measured = meter.costs()
    assert measured is not None
    assert measured.lm_token_s["int8"] == pytest.approx(0.0125 * 2)  # halfway from 1x to 3x


def test_an_unrun_format_is_guessed_from_its_parts_other() -> None:
    meter = CostMeter(lambda: 2)
    _feed(meter)
    measured = meter.costs()
    assert measured is not None
    assert measured.flow_s["int8"] == pytest.approx(0.001 * 0.75)
    assert measured.hift_s["bf16"] == pytest.approx(0.3 * 0.5)
    assert measured.hift_s["int8"] == pytest.approx(0.3 * 0.7)
    assert measured.lm_token_s["int4"] == pytest.approx(0.0125 * 0.75)
    assert measured.lm_token_s["fp32"] == pytest.approx(0.0125 * 3.0)
    assert measured.lm_prefill_s["int4"] == pytest.approx(0.07 * 0.75)
    assert measured.estimated == ("flow.int8", "hift.bf16", "hift.int8", "lm_prefill.fp32",
                                  "lm_prefill.int4", "lm_token.fp32", "lm_token.int4")  # fmt: skip
    _feed(meter, flow="int8", hift="bf16", lm="int4")  # measured once it runs
    _feed(meter, flow="int8", hift="int8", lm="fp32")
    assert meter.costs().estimated == ()  # type: ignore[union-attr]


def test_fewer_free_cores_scale_the_costs_until_measured() -> None:
    free = [2]
    meter = CostMeter(lambda: free[0])
    _feed(meter)
    free[0] = 1  # a neighbour takes a core
    busy = meter.costs()
    assert busy is not None and busy.cores == 1
    assert busy.lm_token_s["int8"] == pytest.approx(0.0125 * 2)  # twice the cost: a guess
    assert "lm_token.int8" in busy.estimated
    _feed(meter, scale=1.5)  # the busy box measures its own
    assert meter.costs().lm_token_s["int8"] == pytest.approx(0.0125 * 1.5)  # type: ignore[union-attr]
    free[0] = 2
    assert meter.costs().lm_token_s["int8"] == pytest.approx(0.0125)  # type: ignore[union-attr]


def _measure_every_format(meter: CostMeter, reference: StageCosts) -> None:
    """Give ``meter`` the ``reference`` costs of every stage and weight format."""
    for weights in ("fp32", "int8"):
        meter.record(StageTime("flow", weights, reference.flow_s[weights] * 1000, 1000))
    for weights in ("fp32", "bf16", "int8"):
        meter.record(StageTime("hift", weights, reference.hift_s[weights], 1))
    for weights in ("int8", "int4", "fp32"):
        meter.record(StageTime("lm_prefill", weights, reference.lm_prefill_s[weights], 1))
        meter.record(StageTime("lm_token", weights, reference.lm_token_s[weights] * 40, 40))


class ChoosingEngine(FakeSurface):
    """What auto's choice reads of an engine: v1's, with every weight format loaded."""

    speakers = ["tester"]
    weight_formats = {
        "llm": ("int8", "int4"),
        "flow": ("fp32", "int8"),
        "hift": ("fp32", "int8"),
    }

    def synthesize(self, text: str, options: Any = None, cancel: Any = None) -> Iterator[Any]:
        raise AssertionError("auto's choice speaks nothing")


def test_a_busy_box_makes_auto_choose_a_cheaper_profile() -> None:
    free = [2]
    meter = CostMeter(lambda: free[0])
    auto = AutoProfile(CONFIG.auto, CANDIDATES, meter)  # type: ignore[arg-type]
    _measure_every_format(meter, costs(scale=0.1))
    engine = ChoosingEngine()
    quiet = auto.choose("Turning on the kitchen light.", engine=engine, speaker=None, client="t")
    free[0] = 1
    busy = auto.choose("Turning on the kitchen light.", engine=engine, speaker=None, client="t")
    assert (quiet.name, busy.name) == ("realtime", "fast")  # twice the cost: realtime stalls
    assert auto.report()["last_choice"]["cores"] == 1


# --- the settings -----------------------------------------------------------------------------


def test_auto_is_the_default_and_loads_every_format_it_chooses_from() -> None:
    assert CONFIG.profile.name == AUTO_PROFILE and CONFIG.auto is not None
    assert CONFIG.auto.first_audio_s == 1.5
    assert [p.name for p in CANDIDATES] == ["realtime", "fast", "faster", "fastest"]
    weights = CONFIG.load.weights
    assert (weights.lm, weights.flow, weights.hift, weights.extra) == (
        "int8",
        "fp32",
        "fp32",
        ("flow.int8", "hift.int8", "llm.int4"),
    )
    # Until it has chosen it runs the most exact one's settings.
    assert replace(CONFIG.profile, name="realtime", streaming=True) == REALTIME
    assert CONFIG.servable_profiles == [
        "auto",
        "realtime",
        "fast",
        "faster",
        "fastest",
        "quality",
        "batch",
    ]
    assert CONFIG.request_profile("fastest").name == "fastest"
    # A fixed profile loads only its own formats and cannot be asked for auto.
    fixed = load_config(None, [("server.profile", "fast")])
    assert fixed.load.weights.extra == () and fixed.auto_candidates == []
    with pytest.raises(ProfileNotLoadedError, match="--profile auto"):
        fixed.request_profile("auto")


def test_auto_chooses_only_from_the_profiles_it_names() -> None:
    config = load_config(None, [("auto.profiles", ["fast", "fastest"])])
    assert config.load.weights == replace(config.load.weights, flow="int8", hift="int8", extra=())
    with pytest.raises(ConfigError) as err:
        load_config(None, [("auto.profiles", ["realtime", "turbo"])])
    assert err.value.key == "auto.profiles" and "turbo" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, [("auto.first_audio_s", 0)])
    assert err.value.key == "auto.first_audio_s"
    with pytest.raises(ConfigError) as err:
        load_config(None, [("profiles.auto.n_timesteps", 3)])
    assert err.value.key == "profiles.auto" and "reserved" in str(err.value)


def test_no_streaming_applies_to_auto() -> None:
    from wyoming_cosyvoice.__main__ import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args(["--no-streaming"]))
    assert config.profile.name == AUTO_PROFILE and config.profile.streaming is False
    assert config.profiles["realtime"].streaming  # the profiles it chooses from untouched


def test_the_file_command_runs_autos_most_exact_profile() -> None:
    """A WAV file has no first audio to wait for: nothing more is loaded than realtime's."""
    from wyoming_cosyvoice.synthesize import build_parser, settings

    for argv in (["hello"], ["--profile", "auto", "hello"]):
        config = settings(build_parser().parse_args(argv))
        assert config.profile.name == "realtime" and config.load.weights.extra == ()


# --- end to end through the real server -------------------------------------------------------


class CostEngine(FakeEngine):
    """The fake engine, reporting made-up stage costs as the real one measures them: those
    of the reference machine times ``scale``. Keeps each request's options."""

    weight_formats = {
        "llm": ("int8", "int4"),
        "flow": ("fp32", "int8"),
        "hift": ("fp32", "int8"),
    }

    def __init__(self, model_dir: Path, threads: int | None = None, *, scale: float) -> None:
        super().__init__(model_dir, threads)
        self.costs = costs(scale)
        self.options: list[SynthesisOptions] = []

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
        self.options.append(options)
        report = options.on_stage or (lambda time: None)
        lm = options.lm_weights or "int8"
        report(StageTime("lm_prefill", lm, self.costs.lm_prefill_s[lm], 1))
        report(StageTime("lm_token", lm, self.costs.lm_token_s[lm] * 40, 40))
        flow, hift = options.flow_weights or "fp32", options.hift_weights or "fp32"
        report(StageTime("flow", flow, self.costs.flow_s[flow] * 1000, 1000))
        report(StageTime("hift", hift, self.costs.hift_s[hift], 1.0))
        speaker = options.speaker or self.speakers[0]
        return super().synthesize(text, replace(options, speaker=speaker), cancel)


def _serve(wy: SimpleNamespace, scale: float, texts: list[str], **settings: Any) -> Any:
    async def main() -> tuple[list[Any], Any]:
        engine = partial(CostEngine, scale=scale)
        overrides = {"server.warmup": True, **settings}
        async with wy.fake_server(overrides, engine=engine) as srv:
            for text in texts:
                reply = await wy.synthesize(srv.port, text)
                assert reply.error() is None and reply.samples > 0
            return srv.engines[0].options, srv.running.scheduler.auto

    return asyncio.run(main())


def test_the_server_measures_after_the_warm_up_and_chooses_per_request(
    wy: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wyoming_cosyvoice.auto.profile")
    options, auto = _serve(wy, 1.0, ["Hello there.", "A long announcement. " * 12])
    # The calibration: one streamed request per distinct combination of formats, then the two
    # requests.
    calibration = [(o.lm_weights, o.flow_weights, o.hift_weights) for o in options[:2]]
    assert calibration == [("int8", "fp32", "fp32"), ("int4", "int8", "int8")]
    assert all(o.stream for o in options[:2])
    short, long = options[2], options[-1]
    assert (short.n_timesteps, short.lm_weights, short.flow_weights) == (5, "int4", "int8")
    assert short.hift_weights == "int8"
    assert (long.n_timesteps, long.cfg_rate, long.flow_weights) == (1, 0.7, "int8")  # fastest
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Profile auto")]
    assert len(lines) == 2  # one line per request, not per sentence
    assert "fast, first audio 0.83 s" in lines[0] and "(realtime: first audio 1.65 s)" in lines[0]
    assert "fastest, no profile plays 11.9 s of speech without a stall" in lines[1]
    report = auto.report()
    # The loaded formats measured: the float32 LM's figures and bfloat16 HiFT's guessed.
    assert report["stage_costs"]["estimated"] == ["hift.bf16", "lm_prefill.fp32", "lm_token.fp32"]
    assert report["last_choice"]["profile"] == "fastest"


def test_a_fast_machine_serves_the_exact_profile(wy: SimpleNamespace) -> None:
    options, _ = _serve(wy, 0.1, ["Turn on the kitchen light, please."])
    request = options[-1]
    assert (request.n_timesteps, request.cfg_rate, request.flow_weights) == (10, 0.7, "fp32")
    assert request.hift_weights == "fp32"


def test_a_server_without_warm_up_speaks_the_exact_profile_until_measured(
    wy: SimpleNamespace,
) -> None:
    options, auto = _serve(wy, 1.0, ["Hello there.", "Hello there."], **{"server.warmup": False})
    assert [o.n_timesteps for o in options] == [10, 5]  # the first request measured the costs
    assert "not measured" not in auto.report()["last_choice"]["reason"]


def test_health_shows_the_costs_and_the_last_choice() -> None:
    from test_http import BackgroundServer

    engine = partial(CostEngine, scale=1.0)
    with BackgroundServer({"server.warmup": True}, engine_factory=engine,
                          wyoming=False) as srv, srv.client() as http:  # fmt: skip
        before = http.get("/health").json()["auto"]
        assert before["last_choice"] is None and before["first_audio_target_s"] == 1.5
        assert before["stage_costs"]["lm_token_ms"] == pytest.approx(
            {"int8": 12.8, "int4": 9.6, "fp32": 38.4}
        )
        assert before["stage_costs"]["estimated"] == ["hift.bf16", "lm_prefill.fp32",
                                                      "lm_token.fp32"]  # fmt: skip
        assert set(before["stage_costs"]["flow_us_per_frame_step"]) == {"fp32", "int8"}
        spoken = http.post("/tts", json={"text": "Hello there."})
        assert spoken.status_code == 200 and spoken.headers["x-profile"] == "auto"
        last = http.get("/health").json()["auto"]["last_choice"]
        assert last["profile"] == "fast" and "realtime" in last["predicted"]
        assert http.get("/voices").json()["default_profile"] == "auto"
        # A request may still name a fixed profile: its formats are loaded.
        assert http.post("/tts", json={"text": "Hi.", "profile": "realtime"}).status_code == 200
    assert srv.engines[0].options[-1].n_timesteps == 10


@pytest.mark.long
def test_the_real_engine_measures_and_chooses(tmp_path: Path) -> None:
    """The real server process on the tiny model: the warm-up measures every stage in both
    formats, /health shows them, and a target no profile can meet makes the soonest win."""
    import os
    import subprocess
    import sys

    import httpx
    from conftest import free_port, synthesize, terminate, wait_for_port, wait_until

    model = tmp_path / "CosyVoice-300M-SFT"
    shutil.copytree(DATA / "tiny_model", model, ignore=shutil.ignore_patterns("prepared"))
    port, http_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "wyoming_cosyvoice", "--uri", f"tcp://127.0.0.1:{port}",
         "--model-dir", str(model), "--threads", "1", "--http-port", str(http_port),
         "--http-host", "127.0.0.1", "--set", "auto.first_audio_s=0.00001"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_port(port, process)
        wait_for_port(http_port, process)  # the HTTP server starts after the Wyoming one
        url = f"http://127.0.0.1:{http_port}/health"
        status = lambda: httpx.get(url, timeout=10).json()["status"]  # noqa: E731
        # The load, warm-up and measurement run in the background.
        wait_until(lambda: status() != "loading", "the model is measured", timeout=120)
        health = httpx.get(url, timeout=10).json()
        assert health["status"] == "ready", health
        measured = health["auto"]["stage_costs"]
        for stage in ("lm_token_ms", "lm_prefill_ms"):
            assert set(measured[stage]) == {"int8", "int4", "fp32"}
            assert all(ms > 0 for ms in measured[stage].values()), measured
        assert sorted(measured["flow_us_per_frame_step"]) == ["fp32", "int8"]
        # Both flows ran in the measurement (a CPU without int8 kernels loads only fp32's).
        unmeasured = [] if detect().int8_kernels is not None else ["flow.int8"]
        assert [e for e in measured["estimated"] if e.startswith("flow")] == unmeasured
        reply = asyncio.run(synthesize(port, "Hello there, this is a test."))
        assert reply.error() is None and reply.samples > 0
        last = httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=10).json()["auto"]
        assert last["last_choice"]["profile"] == "fastest"
        assert "no profile gets first audio" in last["last_choice"]["reason"]
    finally:
        log = terminate(process)
    assert "Measured the stage costs" in log and "Profile auto for" in log
    assert "Traceback" not in log


class PrimingCostEngine(CostEngine, PrimesVoices):
    """The cost engine with CosyVoice2's primed voices: records what it primes and lets go."""

    def __init__(self, model_dir: Path, threads: int | None = None, *, scale: float) -> None:
        super().__init__(model_dir, threads, scale=scale)
        self.primed: list[tuple[int, float, str]] = []
        self.let_go: list[tuple[int, float, str]] = []

    def prime_voice(self, options: SynthesisOptions) -> None:
        self.primed.append((options.n_timesteps, options.cfg_rate, options.flow_weights or ""))

    def unprime_voice(self, options: SynthesisOptions) -> None:
        self.let_go.append((options.n_timesteps, options.cfg_rate, options.flow_weights or ""))


@pytest.mark.parametrize(("scale", "let_go"), [(1.5, [(10, 0.7, "fp32")]), (1.0, [])])
def test_a_profile_that_cannot_start_in_time_lets_go_of_its_primed_voice(
    wy: SimpleNamespace, scale: float, let_go: list[tuple[int, float, str]]
) -> None:
    """On a machine 1.5× slower than the reference one, realtime's first audio is late even for
    a word: auto never chooses it, and its primed voice (half a gigabyte with CosyVoice2) is
    let go after the calibration; on the reference machine realtime still answers a word in
    time, and every profile stays primed."""

    async def main() -> PrimingCostEngine:
        engine = partial(PrimingCostEngine, scale=scale)
        async with wy.fake_server({"server.warmup": True}, engine=engine) as srv:
            made: PrimingCostEngine = srv.engines[0]
            return made

    engine = asyncio.run(main())
    assert engine.primed == [
        (10, 0.7, "fp32"),
        (5, 0.7, "int8"),
        (1, 0.7, "int8"),
        (1, 0.7, "int8"),
    ]
    assert engine.let_go == let_go


def test_a_sentence_still_arriving_is_chosen_for_as_a_long_one() -> None:
    """Its first words say nothing of its length: it is taken to be several seconds long (it
    starts early only then), so a machine that keeps pace with a short answer only at fast's
    cost takes faster for it, as for a long answer."""
    meter = CostMeter(lambda: 2)
    auto = AutoProfile(CONFIG.auto, INT8_LM_CANDIDATES, meter)  # type: ignore[arg-type]
    _measure_every_format(meter, costs(scale=0.45))
    engine = ChoosingEngine()
    opening = "Sure, I have"
    whole = auto.choose(opening, engine=engine, speaker=None, client="t")
    growing = auto.choose(opening, engine=engine, speaker=None, client="t", growing=True)
    assert (whole.name, growing.name) == ("fast", "faster")
    assert auto.report()["last_choice"]["speech_s"] == GROWING_SPEECH_S
