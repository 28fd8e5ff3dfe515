"""CosyVoice2 streaming: the official orchestration (hops, HiFT cache, speech cross-fade) against
the official streaming cases, and the incremental flow's work per chunk staying flat as the
answer grows."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import TESTS
from parity import stream_atols, waveform_atol

from engine.core.hift import HiFTGenerator
from engine.core.streaming import FlowPrompt, GeneratorNoise
from engine.cosyvoice2.flow import CausalFlow, load_flow
from engine.cosyvoice2.flow_args import load_flow_args, load_hift_args
from engine.cosyvoice2.hift import load_hift
from engine.cosyvoice2.streaming import (
    SpeechStream,
    chunk_aligned,
    official_hops,
    stream_audio,
    whole_audio,
)

DATA = TESTS / "data" / "cosyvoice2"
TINY = DATA / "tiny"


@pytest.fixture(scope="module")
def flow() -> CausalFlow:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    state = torch.load(TINY / "flow.pt", weights_only=True)
    return load_flow(state, load_flow_args(TINY / "cosyvoice2.yaml"))


@pytest.fixture(scope="module")
def hift() -> HiFTGenerator:
    state = torch.load(TINY / "hift.pt", weights_only=True)
    return load_hift(state, load_hift_args(TINY / "cosyvoice2.yaml"))


def _prompt(n_tokens: int, seed: int = 0) -> FlowPrompt:
    g = torch.Generator().manual_seed(seed)
    return FlowPrompt(
        embedding=torch.randn(1, 192, generator=g),
        tokens=torch.randint(0, 6561, (1, n_tokens), generator=g),
        feat=torch.randn(1, 2 * n_tokens, 80, generator=g),
    )


def _tokens(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, 6561, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_official_hops() -> None:
    assert list(itertools.islice(official_hops(0), 5)) == [25, 50, 100, 100, 100]
    # The first hop brings the prompt to whole 25-token chunks.
    assert list(itertools.islice(official_hops(20), 3)) == [30, 50, 100]
    assert next(official_hops(50)) == 25


def test_flow_work_per_chunk_stays_flat(flow: CausalFlow) -> None:
    """Count the frames every estimator pass and the encoder's frame stage actually process
    (hooks on their last layers): each chunk covers its own new frames only, the last chunk's
    no more than the first's, however long the answer has grown."""
    decoder_frames: list[int] = []
    encoder_frames: list[int] = []
    hooks = [
        flow.decoder.estimator.final_proj.register_forward_pre_hook(
            lambda m, args: decoder_frames.append(args[0].shape[-1])
        ),
        flow.encoder.after_norm.register_forward_pre_hook(
            lambda m, args: encoder_frames.append(args[0].shape[1])
        ),
    ]
    prompt = _prompt(25)
    stream = flow.stream(prompt.tokens, prompt.feat, prompt.embedding)
    tokens = _tokens(185)
    per_chunk_decoder, per_chunk_encoder = [], []
    sent = 0
    try:  # hops of 25, then 50 (each pushed once its 3 look-ahead tokens are in), then 10
        for end, finalize in [(28, False), *[(28 + 50 * i, False) for i in range(1, 4)]]:
            stream.push(tokens[sent:end], finalize=finalize)
            sent = end
            per_chunk_decoder.append(decoder_frames.copy())
            per_chunk_encoder.append(encoder_frames.copy())
            decoder_frames.clear()
            encoder_frames.clear()
        stream.push(tokens[sent:], finalize=True)
        per_chunk_decoder.append(decoder_frames.copy())
        per_chunk_encoder.append(encoder_frames.copy())
    finally:
        for hook in hooks:
            hook.remove()
    # 10 Euler steps a chunk, each over the chunk's frames (the prompt's in the first chunk).
    assert per_chunk_decoder[0] == [2 * (25 + 25)] * 10
    assert per_chunk_decoder[1:-1] == [[2 * 50] * 10] * 3
    assert per_chunk_decoder[-1] == [2 * 10] * 10
    assert per_chunk_encoder == [[100]] * 4 + [[20]]


def test_stream_audio_cuts_the_official_chunks(flow: CausalFlow, hift: HiFTGenerator) -> None:
    """Audio per chunk: the hop's frames at 480 samples each, less the 8-frame tail held back
    for the cross-fade (given back by the last chunk)."""
    prompt = _prompt(20)
    speech = SpeechStream(flow, hift, prompt, GeneratorNoise(torch.Generator().manual_seed(0)))
    chunks = list(stream_audio(_tokens(100), speech, official_hops(20)))
    held = 8 * 480
    lengths = [c.shape[1] for c in chunks]
    assert lengths == [30 * 2 * 480 - held, 50 * 2 * 480, 20 * 2 * 480 + held]


def test_tokens_that_end_early_give_one_final_chunk(flow: CausalFlow, hift: HiFTGenerator) -> None:
    speech = SpeechStream(flow, hift, _prompt(0), GeneratorNoise(torch.Generator().manual_seed(0)))
    chunks = list(stream_audio(_tokens(12), speech, official_hops(0)))
    assert [c.shape[1] for c in chunks] == [12 * 2 * 480]


# --- the official orchestration (tests/data/cosyvoice2/stream_cases.*) ------------------------

SAMPLE_RATE = 24000
# The kernel-path re-run (tests/engine_tests/core/test_kernel_paths.py) takes one scenario of the
# slow parity tests: every kernel runs in it; the others only add length.
SCENARIOS = [pytest.param("prompt17", marks=pytest.mark.parity), "noprompt180"]
CASES = torch.load(DATA / "stream_cases.pt", weights_only=True)


def expand(codes: torch.Tensor, shape: tuple[int, ...], scale: float) -> torch.Tensor:
    """An injected draw: the stored codes repeated over the row-major shape, scaled."""
    n = math.prod(shape)
    return (codes.to(torch.float32).repeat(-(-n // codes.numel()))[:n] * scale).view(shape)


class ReplayNoise:
    """Hands out one run's recorded HiFT draws, chunk by chunk (official shapes: rand (1, 9),
    randn (1, L, 9) time-major; the discarded noise-branch draw is skipped)."""

    def __init__(self, run: str) -> None:
        self.run, self.chunk = run, 0

    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = f"{self.run}/chunk{self.chunk}/"
        self.chunk += 1
        phase = expand(CASES[prefix + "rng_phase_rand_codes"], (1, 9), 1 / 256)
        sine = expand(CASES[prefix + "rng_sine_noise_codes"], (1, n_samples, 9), 1 / 32)
        return phase.view(1, 9, 1), sine.transpose(1, 2)


def _scenario(name: str) -> tuple[list[int], FlowPrompt]:
    tokens = CASES[f"{name}/in_source_speech_token"][0].tolist()
    prompt = FlowPrompt(CASES[f"{name}/in_flow_embedding"])
    if f"{name}/in_flow_prompt_speech_token" in CASES:
        prompt = FlowPrompt(
            CASES[f"{name}/in_flow_embedding"],
            CASES[f"{name}/in_flow_prompt_speech_token"],
            CASES[f"{name}/in_prompt_speech_feat"],
        )
    return tokens, prompt


def _official_chunks(run: str) -> list[torch.Tensor]:
    count = len({k.split("/")[2] for k in CASES if k.startswith(run + "/chunk")})
    return [CASES[f"{run}/chunk{i}/speech_out"] for i in range(count)]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_stream_equals_the_official_stream(
    flow: CausalFlow, hift: HiFTGenerator, scenario: str
) -> None:
    """Chunk for chunk, with the official last chunk (full attention over the utterance)."""
    tokens, prompt = _scenario(scenario)
    run = f"{scenario}/stream"
    speech = SpeechStream(flow, hift, prompt, ReplayNoise(run), full_attention_last=True)
    chunks = list(stream_audio(tokens, speech, official_hops(prompt.tokens.shape[1])))
    expected = _official_chunks(run)
    assert [c.shape[1] for c in chunks] == [e.shape[0] for e in expected]
    atols = stream_atols([e.shape[0] for e in expected], SAMPLE_RATE)
    for i, (got, want) in enumerate(zip(chunks, expected, strict=True)):
        atol = atols[i]
        torch.testing.assert_close(got[0], want, atol=atol, rtol=0, msg=f"chunk {i}")


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_incremental_last_chunk_changes_only_the_last_chunk(
    flow: CausalFlow, hift: HiFTGenerator, scenario: str
) -> None:
    """The default stream computes its last chunk incrementally too (chunk attention): every
    earlier chunk is the official one, and the last has the official length."""
    tokens, prompt = _scenario(scenario)
    run = f"{scenario}/stream"
    speech = SpeechStream(flow, hift, prompt, ReplayNoise(run))
    chunks = list(stream_audio(tokens, speech, official_hops(prompt.tokens.shape[1])))
    expected = _official_chunks(run)
    assert [c.shape[1] for c in chunks] == [e.shape[0] for e in expected]
    atols = stream_atols([e.shape[0] for e in expected], SAMPLE_RATE)
    for i, (got, want) in enumerate(zip(chunks[:-1], expected[:-1], strict=True)):
        atol = atols[i]
        torch.testing.assert_close(got[0], want, atol=atol, rtol=0, msg=f"chunk {i}")


@pytest.mark.parity
def test_whole_utterance_equals_the_official_non_streaming_call(
    flow: CausalFlow, hift: HiFTGenerator
) -> None:
    tokens, prompt = _scenario("prompt17")
    audio = whole_audio(flow, hift, prompt, tokens, ReplayNoise("prompt17/nonstream"))
    want = CASES["prompt17/nonstream/chunk0/speech_out"]
    atol = waveform_atol(want.shape[0], SAMPLE_RATE)
    torch.testing.assert_close(audio[0], want, atol=atol, rtol=0)


def test_a_chunk_aligned_prompt_gives_audio_after_25_tokens_and_the_look_ahead(
    flow: CausalFlow, hift: HiFTGenerator
) -> None:
    prompt = chunk_aligned(_prompt(60))
    assert prompt.tokens.shape == (1, 50) and prompt.feat.shape == (1, 100, 80)
    assert torch.equal(prompt.tokens, _prompt(60).tokens[:, 10:])
    assert chunk_aligned(_prompt(20)).tokens.shape == (1, 20)  # shorter than a chunk: kept
    speech = SpeechStream(flow, hift, prompt, GeneratorNoise(torch.Generator().manual_seed(0)))
    tokens = _tokens(40)
    for n in range(1, 28):
        assert speech.push(tokens[n - 1 : n]).shape[1] == 0, n
    assert speech.push(tokens[27:28]).shape[1] == 25 * 2 * 480 - 8 * 480


def test_a_prompt_ending_on_its_look_ahead_makes_the_first_chunk_one_chunk(
    flow: CausalFlow, hift: HiFTGenerator
) -> None:
    prompt = chunk_aligned(_prompt(60), 25, tail=3)
    assert prompt.tokens.shape == (1, 53) and prompt.feat.shape == (1, 106, 80)
    assert torch.equal(prompt.tokens, _prompt(60).tokens[:, 7:])
    assert chunk_aligned(_prompt(27), 25, tail=3).tokens.shape == (1, 27)  # kept whole
    base = flow.stream(prompt.tokens, prompt.feat, prompt.embedding)
    base.push([])
    assert base.frames_per_step() == [100]  # both whole prompt chunks, look-ahead included
    noise = GeneratorNoise(torch.Generator().manual_seed(0))
    speech = SpeechStream(flow, hift, prompt, noise, flow_stream=base.fork())
    tokens = _tokens(40)
    for n in range(1, 25):
        assert speech.push(tokens[n - 1 : n]).shape[1] == 0, n
    assert speech.push(tokens[24:25]).shape[1] == 22 * 2 * 480 - 8 * 480
    # One chunk's frames: the prompt's last 3 tokens and 22 new ones; nothing before.
    assert speech.flow.frames_per_step() == [100, 50]


def test_a_prompt_ending_further_into_a_chunk_makes_a_smaller_first_hop_of_the_same_audio(
    flow: CausalFlow, hift: HiFTGenerator
) -> None:
    """14 prompt tokens in the unfinished chunk: audio after 11 new tokens and the look-ahead,
    one attention chunk computed, and the same audio as a stream that computes the prompt
    itself."""
    prompt = chunk_aligned(_prompt(60), 25, tail=14)
    assert prompt.tokens.shape == (1, 39) and torch.equal(prompt.tokens, _prompt(60).tokens[:, 21:])
    base = flow.stream(prompt.tokens, prompt.feat, prompt.embedding)
    base.push([])
    assert base.frames_per_step() == [50]  # the whole prompt chunk, its look-ahead inside

    def first_chunk(primed: bool) -> torch.Tensor:
        noise = GeneratorNoise(torch.Generator().manual_seed(0))
        fork = base.fork() if primed else None
        speech = SpeechStream(flow, hift, prompt, noise, flow_stream=fork)
        tokens = _tokens(40)
        for n in range(1, 14):
            assert speech.push(tokens[n - 1 : n]).shape[1] == 0, n
        audio = speech.push(tokens[13:14])
        assert speech.flow.frames_per_step() == [50, 50]  # the prompt chunk, then one chunk
        return audio

    audio = first_chunk(primed=True)
    assert audio.shape[1] == 11 * 2 * 480 - 8 * 480
    torch.testing.assert_close(audio, first_chunk(primed=False), atol=1e-5, rtol=0)


def test_the_thread_count_is_asked_again_after_every_flow_step(
    flow: CausalFlow, hift: HiFTGenerator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk takes seconds at full size: an LM beside it that finishes within one gives its
    core back to the flow at the next step, not at the next chunk."""
    import engine.cosyvoice2.streaming as module

    asked: list[str] = []
    monkeypatch.setattr(module, "apply_thread_budget", lambda budget: asked.append("asked"))
    steps: list[int] = []
    solve = flow.decoder.solve

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        callback = kwargs["step_callback"]

        def step(k: int, *rest: object) -> None:
            steps.append(k)
            asked.append(f"step {k}")
            callback(k, *rest)  # type: ignore[operator]

        return solve(*args, **{**kwargs, "step_callback": step})  # type: ignore[arg-type]

    monkeypatch.setattr(flow.decoder, "solve", counted)
    noise = GeneratorNoise(torch.Generator().manual_seed(0))
    speech = SpeechStream(flow, hift, _prompt(0), noise, n_timesteps=3)
    speech.push(_tokens(28))
    assert steps == [0, 1, 2]
    # once before the chunk, once after each step, once before the vocoder
    assert asked == ["asked", "step 0", "asked", "step 1", "asked", "step 2", "asked", "asked"]
