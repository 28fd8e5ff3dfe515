"""CosyVoice2 streaming: the official orchestration (hops, HiFT cache, speech cross-fade) against
the official streaming cases, and the incremental flow's work per chunk staying flat as the
answer grows."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from engine.cosyvoice2.flow import CausalFlow, load_flow
from engine.cosyvoice2.flow_args import load_flow_args, load_hift_args
from engine.cosyvoice2.hift import load_hift
from engine.cosyvoice2.streaming import (
    FlowPrompt,
    GeneratorNoise,
    SpeechStream,
    official_hops,
    stream_audio,
)
from engine.hift import HiFTGenerator

DATA = Path(__file__).parent / "data" / "cosyvoice2"
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
