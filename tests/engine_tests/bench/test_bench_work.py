"""The work of a second of speech, counted on loaded models, against counts by hand."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from conftest import DATA
from torch import nn

from engine.bench.timers import StageTimer
from engine.bench.work import (
    count_stage_flops,
    lm_cache_bytes_per_position,
    lm_weight_bytes_per_token,
)
from engine.core.int8_avx2 import Avx2Int8Linear
from engine.core.quantize import Int8Linear, quantize_lm_int8
from engine.cosyvoice1.model_dir import load_model_dir

TINY_MODEL = DATA / "tiny_model"


def _read_per_token(llm: nn.Module) -> list[tuple[str, nn.Module]]:
    """The float LM's modules a decode step reads, by hand: the stack and the head, without
    the positional projection and the token embeddings."""
    return [
        (name, module)
        for part in ("llm", "llm_decoder")
        for name, module in llm.get_submodule(part).named_modules()
        if "linear_pos" not in name and not isinstance(module, nn.Embedding)
    ]


def test_a_float_lms_bytes_per_token_are_its_parameter_bytes() -> None:
    llm = load_model_dir(TINY_MODEL).llm
    by_hand = sum(
        4 * p.numel()
        for _, module in _read_per_token(llm)
        for p in module.parameters(recurse=False)
    )
    assert by_hand > 0 and lm_weight_bytes_per_token(llm) == by_hand


def test_an_int8_lm_is_counted_from_its_packed_tensors() -> None:
    # One byte per weight of every Linear of the blocks and the head, a float32 scale per
    # output channel and the float32 bias (the engine's own kernel also reads an int32 weight
    # sum per channel, every per-channel tensor padded to blocks of 8 channels); the rest (the
    # input layer, norms, position biases) stays float32.
    float_llm = load_model_dir(TINY_MODEL).llm
    int8 = quantize_lm_int8(copy.deepcopy(float_llm))
    by_hand = 0
    for _, module in _read_per_token(int8):
        if isinstance(module, Avx2Int8Linear):
            channels = -(-module.out_features // 8) * 8
            per_channel = 4 * (3 if module.bias is not None else 2)  # rowsum, scale, bias
            by_hand += channels * (module.in_features + per_channel)
        elif isinstance(module, Int8Linear):
            with_bias = module.bias() is not None
            by_hand += module.out_features * (module.in_features + 4 * (2 if with_bias else 1))
        else:
            by_hand += sum(4 * p.numel() for p in module.parameters(recurse=False))
    assert lm_weight_bytes_per_token(int8) == by_hand
    assert by_hand < lm_weight_bytes_per_token(float_llm) / 2


def test_the_kv_cache_is_read_per_position_in_every_layer() -> None:
    llm = load_model_dir(TINY_MODEL).llm
    blocks = len(llm.llm.encoders)
    width = llm.llm.after_norm.weight.numel()  # heads × d_k
    # K and V of every block in float32; no held positional rows in a model built from the
    # checkpoints (a prepared file adds them: one row of heads × d_k per position and block).
    assert lm_cache_bytes_per_position(llm) == blocks * 2 * width * 4
    for layer in llm.llm.encoders:
        attention = layer.self_attn
        attention.pos_rows = torch.zeros(2, attention.h, 8, attention.d_k)
    assert lm_cache_bytes_per_position(llm) == blocks * 3 * width * 4


class _Flow(nn.Module):
    """A flow with an encoder once per call and an estimator per step, both plain products."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(6, 5)
        self.estimator = nn.Linear(5, 5, bias=False)

    def inference(self, tokens: torch.Tensor, steps: int, rows: int) -> torch.Tensor:
        x = self.encoder(torch.zeros(tokens.shape[1], 6))  # one row per mel frame
        for _ in range(steps):
            x = self.estimator(x.expand(rows, -1, -1))[0]
        return x.T.unsqueeze(0)  # (1, 5 channels, frames)


class _Vocoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.filter = nn.Linear(5, 4, bias=False)

    def inference(self, mel: torch.Tensor) -> torch.Tensor:
        return self.filter(mel[0].T).reshape(1, -1)  # 4 samples per frame


@pytest.mark.parametrize(("cfg_rate", "rows"), [(0.7, 2), (0.0, 1)])
def test_flow_flops_split_into_its_encoder_and_one_pass_per_frame(
    cfg_rate: float, rows: int
) -> None:
    # 12 frames of 4 samples at 16 samples/s: 3 s of audio. The encoder: 2·6·5 FLOPs per frame
    # once; a step: 2·5·5 per frame and row of the CFG batch; the vocoder: 2·5·4 per frame.
    flow, vocoder = _Flow(), _Vocoder()
    timer = StageTimer(sample_rate=16, samples_per_frame=4)
    lm = SimpleNamespace(generate=iter, decode_step=lambda tokens, cache: None)
    timer.install(SimpleNamespace(llm=lm, flow=flow, hift=vocoder))
    tokens = torch.zeros(1, 12, dtype=torch.long)

    def run_chunk(steps: int) -> None:
        vocoder.inference(flow.inference(tokens, steps, rows))

    flops = count_stage_flops(run_chunk, timer, n_timesteps=10, cfg_rate=cfg_rate)
    frames_per_s, audio_s = 4.0, 3.0
    assert flops.mel_frames_per_audio_s == frames_per_s
    assert flops.flow_passes == rows
    assert flops.estimator_mflop_per_frame_pass == pytest.approx(2 * 5 * 5 / 1e6)
    assert flops.estimator_mflop_per_frame_step == pytest.approx(rows * 2 * 5 * 5 / 1e6)
    assert flops.flow_encoder_gflop_per_audio_s == pytest.approx(12 * 2 * 6 * 5 / audio_s / 1e9)
    per_call = 12 * (2 * 6 * 5 + 10 * rows * 2 * 5 * 5)
    assert flops.flow_gflop_per_audio_s == pytest.approx(per_call / audio_s / 1e9)
    assert flops.hift_gflop_per_audio_s == pytest.approx(12 * 2 * 5 * 4 / audio_s / 1e9)
