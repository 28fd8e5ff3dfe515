"""The work of a second of speech, counted on loaded models, against counts by hand."""

from __future__ import annotations

import copy
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from conftest import DATA
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from engine.bench import work
from engine.bench.timers import StageTimer
from engine.bench.work import (
    count_stage_flops,
    lm_cache_bytes_per_position,
    lm_weight_bytes_per_token,
)
from engine.core.hift_int8 import Int8Conv, int8_conv_fast
from engine.core.int8_avx2 import Avx2Int8Linear
from engine.core.onednn_layers import OneDnnConv1d, onednn_conv_available
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


class _MelFlow(nn.Module):
    """A flow that hands on a fixed mel: only the vocoder's FLOPs are counted."""

    def __init__(self, mel: torch.Tensor) -> None:
        super().__init__()
        self.mel = mel

    def inference(self, tokens: torch.Tensor, steps: int) -> torch.Tensor:
        return self.mel


def _hift_gflop_per_audio_s(hift: nn.Module, mel: torch.Tensor) -> float:
    """The benchmark's count of ``hift``'s work on ``mel``."""
    flow = _MelFlow(mel)
    timer = StageTimer(hift.args.sampling_rate, hift.upp)  # type: ignore[arg-type]
    lm = SimpleNamespace(generate=iter, decode_step=lambda tokens, cache: None)
    timer.install(SimpleNamespace(llm=lm, flow=flow, hift=hift))

    def run_chunk(steps: int) -> None:
        with torch.inference_mode():
            hift.inference(flow.inference(mel, steps), generator=torch.Generator().manual_seed(0))

    return count_stage_flops(run_chunk, timer, n_timesteps=10, cfg_rate=0.7).hift_gflop_per_audio_s


def _tiny_hift(family: str) -> tuple[nn.Module, torch.Tensor]:
    if family == "v1":
        mel = torch.load(DATA / "hift_fixtures.pt", weights_only=True)["mel100/in_mel"]
        return load_model_dir(TINY_MODEL).hift, mel
    from engine.cosyvoice3.model_dir import read_args, read_part

    tiny = DATA / "cosyvoice3" / "tiny"
    cases = torch.load(DATA / "cosyvoice3" / "hift_cases.pt", weights_only=True)
    return read_part(tiny, read_args(tiny), "hift"), cases["whole/in_mel"].unsqueeze(0)


@pytest.mark.skipif(not int8_conv_fast(), reason="the int8 HiFT is not used on this CPU")
@pytest.mark.parametrize("family", ["v1", "v3"])
def test_the_int8_hift_counts_the_float32_hifts_flops(
    family: str, single_torch_thread: None
) -> None:
    # Its oneDNN int8 convolutions compute the float32 ones' products; quantising the
    # activations costs no products. The same count, to the FLOP.
    exact, mel = _tiny_hift(family)
    mel = mel[..., :24]  # any length counts the same; FLOP counting is slow
    int8 = copy.deepcopy(exact)
    int8.use_int8()  # type: ignore[operator]
    assert any(isinstance(m, Int8Conv) for m in int8.modules())
    want = _hift_gflop_per_audio_s(exact, mel)
    assert want > 0 and _hift_gflop_per_audio_s(int8, mel) == want


def _counted(run: Callable[[], object]) -> int:
    """FLOPs of ``run()`` as the benchmark counts them."""
    with FlopCounterMode(display=False, custom_mapping=work._EXTRA_FLOPS) as counter:
        with torch.inference_mode():
            run()
    return int(counter.get_total_flops())


@pytest.mark.skipif(not onednn_conv_available(), reason="torch has no oneDNN convolution here")
def test_a_onednn_float_convolution_counts_as_torchs_own() -> None:
    # v1's flow estimator runs its convolutions on oneDNN's reordered weights.
    conv, x = nn.Conv1d(16, 8, 5, padding=4, dilation=2), torch.randn(2, 16, 40)
    want = _counted(lambda: conv(x))
    assert want > 0 and _counted(lambda: OneDnnConv1d(conv)(x)) == want


@pytest.mark.skipif(not int8_conv_fast(), reason="the int8 HiFT is not used on this CPU")
def test_a_grouped_int8_convolution_counts_as_its_float_one() -> None:
    # The packed weight keeps the float weight's (out, in ÷ groups, 1, kernel) shape.
    groups, padding, dilation = 4, [0, 4], [1, 2]
    conv, x = nn.Conv1d(16, 8, 5, padding=4, dilation=2, groups=groups), torch.randn(1, 16, 40)
    weight = torch.randint(-63, 64, (8, 4, 1, 5), dtype=torch.int8)
    scales, zero_points = torch.ones(8), torch.zeros(8, dtype=torch.int64)
    packed = torch.ops.onednn.qconv_prepack(
        weight.contiguous(memory_format=torch.channels_last),
        scales, 1.0, 0, [1, 1], padding, dilation, groups, None,
    )  # fmt: skip
    q = torch.randint(0, 255, (1, 16, 1, 40), dtype=torch.uint8)
    q = q.contiguous(memory_format=torch.channels_last)

    def int8_conv() -> torch.Tensor:
        return torch.ops.onednn.qconv2d_pointwise(
            q, 0.1, 0, packed, scales, zero_points, None, [1, 1], padding, dilation, groups,
            1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip

    assert int8_conv().shape == (1, 8, 1, 40)
    assert _counted(int8_conv) == _counted(lambda: conv(x)) > 0
