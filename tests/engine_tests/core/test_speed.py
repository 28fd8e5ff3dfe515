"""Speaking speed in the engine: the mel resampled in time before the vocoder, whole and chunk by
chunk while streaming, for both model families on their tiny test models."""

from __future__ import annotations

import functools
import math
import shutil
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA, synthesize_all

from engine.core.constants import HOP
from engine.core.prepared import PREPARED_DIR
from engine.core.speed import MelStretcher, stretch_mel
from engine.core.streaming import FlowPrompt
from engine.core.types import (
    LOW_LATENCY_SCHEDULE,
    MAX_SPEED,
    MIN_SPEED,
    InvalidOptionError,
    SynthesisOptions,
)
from engine.cosyvoice1.streaming import ChunkVocoder, stream_audio
from engine.cosyvoice2.engine import CosyVoice2Engine
from engine.cosyvoice2.streaming import SpeechStream, official_hops
from engine.cosyvoice2.streaming import stream_audio as stream_v2
from engine.family import load_engine
from engine.prompt.extract import PromptFeatures
from engine.prompt.voices import CustomVoice

SPEEDS = [0.5, 0.8, 1.25, 2.0]
# Positions are float32, as torch's own interpolation: a mel frame near 1000 is read within
# 1e-4 of a frame of where float64 would read it.
MEL_ATOL = 1e-3
V2_FRAME = 480  # samples per CosyVoice2 mel frame (24 kHz)


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Tiny tensors: no oversubscription of the shared cores."""


# --- the stretch itself --------------------------------------------------------------------


def _pushed(stretcher: MelStretcher, mel: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """``mel`` pushed in chunks of ``sizes`` frames (the rest with the final push)."""
    out, start = [], 0
    for size in sizes:
        out.append(stretcher.push(mel[:, :, start : start + size]))
        start += size
    out.append(stretcher.push(mel[:, :, start:], finalize=True))
    return torch.cat(out, dim=2)


@pytest.mark.parametrize("speed", [*SPEEDS, 0.7312, 1.9])
def test_the_stretch_is_torchs_linear_interpolation(speed: float) -> None:
    """The reference: torch's interpolation by the factor 1 / speed (above 4 frames: torch copies
    a mel whose length the factor does not change)."""
    generator = torch.Generator().manual_seed(7)
    for frames in (4, 37, 516, 1200):
        mel = torch.randn(1, 80, frames, generator=generator)
        torch.testing.assert_close(
            stretch_mel(mel, speed),
            F.interpolate(mel, scale_factor=1 / speed, mode="linear"),
            atol=MEL_ATOL,
            rtol=0,
        )


@pytest.mark.parametrize("speed", [*SPEEDS, 0.7312, 1.9])
def test_a_mel_stretched_chunk_by_chunk_equals_the_whole_mel_stretched(speed: float) -> None:
    generator = torch.Generator().manual_seed(round(speed * 1000))
    for frames in (0, 1, 2, 37, 516, 1200):
        mel = torch.randn(1, 80, frames, generator=generator)
        sizes = torch.randint(0, 90, (frames // 20 + 1,), generator=generator).tolist()
        whole = stretch_mel(mel, speed)
        assert whole.shape[2] == int(frames / speed)
        if frames < 2:
            sizes = [frames]
        for min_first in (0, 20):
            pieces = _pushed(MelStretcher(speed, min_first=min_first), mel, sizes)
            torch.testing.assert_close(pieces, whole, atol=MEL_ATOL, rtol=0)


def test_each_stretched_frame_is_released_as_soon_as_it_can_be_computed() -> None:
    """At speed 0.5 output frame i reads input frames around i / 2: 10 frames in give every
    output frame up to the one that needs frame 9 as its right neighbour."""
    stretcher = MelStretcher(0.5)
    mel = torch.arange(10.0).reshape(1, 1, 10)
    first = stretcher.push(mel)
    assert first.shape[2] == 19  # x = (i + 0.5) / 2 - 0.5 < 9 for i <= 18
    rest = stretcher.push(mel[:, :, :0], finalize=True)
    assert rest.shape[2] == 1  # the last frame, clamped to the last input frame
    torch.testing.assert_close(torch.cat([first, rest], 2), stretch_mel(mel, 0.5))


def test_the_first_output_is_held_until_it_has_min_first_frames() -> None:
    stretcher = MelStretcher(2.0, min_first=20)
    mel = torch.randn(1, 80, 60)
    assert stretcher.push(mel[:, :, :30]).shape[2] == 0  # 14 frames so far: held
    released = stretcher.push(mel[:, :, 30:50])
    assert released.shape[2] >= 20
    rest = stretcher.push(mel[:, :, 50:], finalize=True)
    torch.testing.assert_close(torch.cat([released, rest], 2), stretch_mel(mel, 2.0))


def test_speed_one_leaves_the_mel_alone() -> None:
    mel = torch.randn(1, 80, 33)
    assert stretch_mel(mel, 1.0) is mel


@pytest.mark.parametrize("speed", [0.0, 0.49, 2.01, -1.0, math.nan, math.inf])
def test_a_speed_out_of_range_is_refused_with_the_range(speed: float) -> None:
    with pytest.raises(InvalidOptionError, match=f"use {MIN_SPEED} to {MAX_SPEED}"):
        SynthesisOptions(speed=speed)


@pytest.mark.parametrize("speed", [True, "fast", None])
def test_a_speed_that_is_no_number_is_refused(speed: object) -> None:
    with pytest.raises(InvalidOptionError, match="must be a number"):
        SynthesisOptions(speed=speed)  # type: ignore[arg-type]


# --- CosyVoice v1 ------------------------------------------------------------------------------


class FlowOnlyNoise:
    """The flow's draws from a generator of their own and a silent HiFT source: the mel does not
    depend on how much audio HiFT makes, so streams at different speeds share their mel."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def flow_noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator)

    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 9, 1), torch.zeros(1, 9, n_samples)


@pytest.fixture(scope="module")
def v1_engine(tmp_path_factory: pytest.TempPathFactory):
    target = tmp_path_factory.mktemp("v1") / "CosyVoice-300M-SFT"
    shutil.copytree(DATA / "tiny_model", target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    return load_engine(target, threads=1)


def _v1_stream(engine, tokens: list[int], speed: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A low-latency stream's audio and the new mel frames HiFT got, chunk after chunk."""
    models = engine.models
    embedding = next(iter(models.speakers.values())).reshape(1, -1)
    vocoder = ChunkVocoder(models.flow, models.hift, FlowPrompt(embedding), FlowOnlyNoise(5),
                           n_timesteps=2, speed=speed)  # fmt: skip
    mels: list[torch.Tensor] = []
    hift = vocoder._hift

    def recording_hift(mel: torch.Tensor, source: torch.Tensor):
        context = 0 if vocoder.hift_mel is None else vocoder.hift_mel.shape[2]
        mels.append(mel[:, :, context:])
        return hift(mel, source)

    vocoder._hift = recording_hift  # type: ignore[method-assign]
    with torch.inference_mode():
        audio = torch.cat(list(stream_audio(tokens, vocoder, LOW_LATENCY_SCHEDULE)), dim=1)
    return audio, torch.cat(mels, dim=2)


@pytest.mark.parametrize("speed", SPEEDS)
def test_v1_stream_seams_equal_the_whole_mel_stretched(v1_engine, speed: float) -> None:
    """The mel HiFT gets while streaming, stitched, is the unstretched stream's mel stretched
    whole: no chunk is stretched on its own (at 2.0 the first chunk's 36 frames give 18, fewer
    than HiFT's 20 frames of context, so they wait for the next chunk)."""
    tokens = torch.randint(0, 4096, (260,), generator=torch.Generator().manual_seed(3)).tolist()
    plain_audio, plain_mel = _v1_stream(v1_engine, tokens, 1.0)
    audio, mel = _v1_stream(v1_engine, tokens, speed)
    torch.testing.assert_close(mel, stretch_mel(plain_mel, speed), atol=MEL_ATOL, rtol=0)
    assert audio.shape[1] == mel.shape[2] * HOP
    assert abs(audio.shape[1] - plain_audio.shape[1] / speed) <= 2 * HOP


@pytest.mark.parametrize("stream", [True, False])
def test_v1_audio_lasts_one_over_speed_as_long(v1_engine, stream: bool) -> None:
    def samples(speed: float) -> int:
        options = SynthesisOptions(stream=stream, seed=1, force_tokens=150, n_timesteps=2,
                                   speed=speed)  # fmt: skip
        return synthesize_all(v1_engine, "Hello there.", options).numel()

    normal = samples(1.0)
    for speed in SPEEDS:
        assert abs(samples(speed) - normal / speed) <= 2 * HOP, speed


# --- CosyVoice2 --------------------------------------------------------------------------------


def _v2_voice() -> CustomVoice:
    g = torch.Generator().manual_seed(0)
    features = PromptFeatures(
        torch.randn(1, 192, generator=g),
        torch.randint(0, 6561, (1, 40), generator=g, dtype=torch.int32),
        torch.randn(1, 80, 80, generator=g),
    )
    return CustomVoice("tester", "Hello there, my friend.", "en", features, 2.0,
                       family="cosyvoice2")  # fmt: skip


@pytest.fixture(scope="module")
def v2_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CosyVoice2Engine]:
    target = tmp_path_factory.mktemp("v2") / "CosyVoice2-0.5B"
    tiny = DATA / "cosyvoice2" / "tiny"
    shutil.copytree(tiny, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    engine = load_engine(target, threads=1)
    assert isinstance(engine, CosyVoice2Engine)
    engine.add_voice(_v2_voice())
    yield engine


class SilentSource:
    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 9, 1), torch.zeros(1, 9, n_samples)


def _v2_stream(engine: CosyVoice2Engine, speed: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An official-schedule stream's audio and the mel frames its vocoder got, stitched."""
    models = engine.models
    g = torch.Generator().manual_seed(2)
    prompt = FlowPrompt(
        torch.randn(1, 192, generator=g),
        torch.randint(0, 6561, (1, 30), generator=g),
        torch.randn(1, 60, 80, generator=g),
    )
    tokens = torch.randint(0, 6561, (180,), generator=g).tolist()
    speech = SpeechStream(models.flow, models.hift, prompt, SilentSource(), n_timesteps=2,
                          speed=speed)  # fmt: skip
    mels: list[torch.Tensor] = []
    push = speech.vocoder.push

    def recording_push(mel: torch.Tensor, *, finalize: bool) -> torch.Tensor:
        mels.append(mel)
        return push(mel, finalize=finalize)

    speech.vocoder.push = recording_push  # type: ignore[method-assign]
    with torch.inference_mode():
        audio = torch.cat(list(stream_v2(tokens, speech, official_hops(30))), dim=1)
    return audio, torch.cat(mels, dim=2)


@pytest.mark.parametrize("speed", SPEEDS)
def test_v2_stream_seams_equal_the_whole_mel_stretched(
    v2_engine: CosyVoice2Engine, speed: float
) -> None:
    plain_audio, plain_mel = _v2_stream(v2_engine, 1.0)
    audio, mel = _v2_stream(v2_engine, speed)
    torch.testing.assert_close(mel, stretch_mel(plain_mel, speed), atol=MEL_ATOL, rtol=0)
    assert audio.shape[1] == mel.shape[2] * V2_FRAME
    assert abs(audio.shape[1] - plain_audio.shape[1] / speed) <= 2 * V2_FRAME


@pytest.mark.parametrize("stream", [True, False])
def test_v2_audio_lasts_one_over_speed_as_long(v2_engine: CosyVoice2Engine, stream: bool) -> None:
    def samples(speed: float) -> int:
        options = SynthesisOptions(speaker="tester", stream=stream, seed=1, force_tokens=120,
                                   n_timesteps=2, speed=speed)  # fmt: skip
        return synthesize_all(v2_engine, "Hello there.", options).numel()

    normal = samples(1.0)
    for speed in SPEEDS:
        assert abs(samples(speed) - normal / speed) <= 2 * V2_FRAME, speed


# --- the engine's command line -------------------------------------------------------------


def test_the_command_line_speaks_at_a_speed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.__main__ as cli

    # Random weights never end an utterance: 60 speech tokens (103 mel frames) fix the length.
    monkeypatch.setattr(
        cli, "SynthesisOptions", functools.partial(SynthesisOptions, force_tokens=60)
    )
    out = tmp_path / "out.wav"
    argv = ["synthesize", "--model-dir", str(DATA / "tiny_model"), "--text", "Hello world.",
            "--out", str(out), "--seed", "1", "--speed", "1.25"]  # fmt: skip
    assert cli.main(argv) == 0
    with wave.open(str(out)) as wav:
        assert wav.getnframes() == int(103 / 1.25) * HOP


def test_the_command_line_refuses_a_bad_speed_before_loading(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from engine.__main__ import main

    argv = ["synthesize", "--model-dir", str(tmp_path / "no-model"), "--text", "Hi.",
            "--out", str(tmp_path / "out.wav"), "--speed", "3"]  # fmt: skip
    assert main(argv) == 2
    assert "speed 3.0 is out of range" in caplog.text  # not the missing model: checked first
