"""Official streaming orchestration (token2wav per chunk) against the official fixtures.

The noise is injected exactly as recorded (fixtures README §0.1): per chunk, the flow's z, the
sine phase draw, the sine noise and the discarded noise-branch draw, in that order.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DATA
from parity import stream_atols, waveform_atol

from engine.core import thread_budget
from engine.core.streaming import FlowPrompt
from engine.core.types import OFFICIAL_SCHEDULE
from engine.cosyvoice1.model_dir import load_model_dir
from engine.cosyvoice1.streaming import ChunkVocoder, stream_audio, whole_audio

FIXTURES = torch.load(DATA / "stream_fixtures.pt", weights_only=True)
SAMPLE_RATE = 22050
# The kernel-path re-run (tests/engine_tests/core/test_kernel_paths.py) takes one scenario of the
# slow parity tests: every kernel runs in it; the others only add length.
SCENARIOS = ["vc250", pytest.param("vc221_prompt", marks=pytest.mark.parity), "e2e_sft_llm"]


def expand(codes: torch.Tensor, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """The fixtures' injected draw: codes repeated cyclically over the flattened shape."""
    n = math.prod(shape)
    reps = -(-n // codes.numel())
    return (codes.to(torch.float32).repeat(reps)[:n] * scale).view(shape)


class ReplayNoise:
    """Hands out the recorded draws of one run, in call order."""

    def __init__(self, prefix: str) -> None:
        keys = sorted(k for k in FIXTURES if k.startswith(prefix + "/rng/"))
        self.codes = [FIXTURES[k] for k in keys]
        self.index = 0

    def _next(self) -> torch.Tensor:
        codes = self.codes[self.index]
        self.index += 1
        return codes

    def flow_noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        return expand(self._next(), shape, 1 / 32)

    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        phase = expand(self._next(), (1, 9, 1), 1 / 256)
        sine = expand(self._next(), (1, 9, n_samples), 1 / 32)
        self._next()  # the official noise branch draws and discards a tensor
        return phase, sine


@pytest.fixture(scope="module")
def models():
    return load_model_dir(DATA / "tiny_model")


def _case(scenario: str) -> tuple[list[int], FlowPrompt]:
    kwargs = FIXTURES[f"{scenario}/input_kwargs"]
    if scenario == "e2e_sft_llm":
        tokens = FIXTURES["e2e_sft_llm/nonstream/chunk0/tokens"][0].tolist()
    else:
        tokens = kwargs["source_speech_token"][0].tolist()
    prompt = FlowPrompt(kwargs["flow_embedding"])
    if "flow_prompt_speech_token" in kwargs:
        prompt = FlowPrompt(
            kwargs["flow_embedding"],
            kwargs["flow_prompt_speech_token"],
            kwargs["prompt_speech_feat"],
        )
    return tokens, prompt


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_official_stream_chunks(models, scenario: str) -> None:
    tokens, prompt = _case(scenario)
    vocoder = ChunkVocoder(models.flow, models.hift, prompt, ReplayNoise(f"{scenario}/stream"))
    with torch.inference_mode():
        chunks = list(stream_audio(iter(tokens), vocoder, OFFICIAL_SCHEDULE))
    n_expected = len(
        [
            k
            for k in FIXTURES
            if k.startswith(f"{scenario}/stream/chunk") and k.endswith("/speech_out")
        ]
    )
    assert len(chunks) == n_expected
    atols = stream_atols([chunk.shape[-1] for chunk in chunks], SAMPLE_RATE)
    for i, chunk in enumerate(chunks):
        expected = FIXTURES[f"{scenario}/stream/chunk{i}/speech_out"]
        assert chunk.shape == expected.shape
        atol = atols[i]
        torch.testing.assert_close(chunk, expected, atol=atol, rtol=0)


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_official_nonstream(models, scenario: str) -> None:
    tokens, prompt = _case(scenario)
    vocoder = ChunkVocoder(models.flow, models.hift, prompt, ReplayNoise(f"{scenario}/nonstream"))
    with torch.inference_mode():
        audio = whole_audio(tokens, vocoder)
    expected = FIXTURES[f"{scenario}/nonstream/chunk0/speech_out"]
    atol = waveform_atol(expected.shape[-1], SAMPLE_RATE)
    torch.testing.assert_close(audio, expected, atol=atol, rtol=0)


def test_a_thread_budget_is_asked_before_each_flow_step_and_hift(models) -> None:
    """A server running sentences side by side changes a sentence's threads between flow
    steps (engine.core.thread_budget); the audio must not change with it."""
    tokens, prompt = _case("vc250")
    asked: list[int] = []
    cores = torch.get_num_threads()
    thread_budget.configure_threads(2, follow_free_cores=False)  # the budget's 2 is not capped

    busy: list[int] = []

    def budget() -> int:
        asked.append(torch.get_num_threads())
        busy.append(thread_budget._vocoders_busy)  # an LM thread beside it would take one core
        return 1 if len(asked) % 2 else 2  # alternate, to change the count at every step

    vocoder = ChunkVocoder(
        models.flow, models.hift, prompt, ReplayNoise("vc250/nonstream"), threads=budget
    )
    try:
        with torch.inference_mode():
            audio = whole_audio(tokens, vocoder)
    finally:
        torch.set_num_threads(cores)
    expected = FIXTURES["vc250/nonstream/chunk0/speech_out"]
    atol = waveform_atol(expected.shape[-1], SAMPLE_RATE)
    torch.testing.assert_close(audio, expected, atol=atol, rtol=0)
    # Before the flow, after each of its 10 steps, before HiFT; and each answer was applied.
    assert len(asked) == 1 + 10 + 1
    assert busy == [1] * len(asked) and thread_budget._vocoders_busy == 0
    assert asked[1:] == [1 if i % 2 else 2 for i in range(1, len(asked))]
