"""The int8 HiFT (``hift_weights: int8``): what its convolutions compute, how far its waveform is
from the float32 vocoder's on the same mel, its prepared file, and where it is not used.

The deviation bounds are facts of the format, not of one CPU: the int8 products are exact
integer sums (7-bit weights keep every pair of uint8 × int8 products inside int16, so CPUs
without VNNI do not saturate them), and the rest is float32 rounding. Measured on the tiny test
models and the fixtures' mels, the same on every kernel path tried (1 and 2 threads,
ATEN_CPU_CAPABILITY=default and avx2, ONEDNN_MAX_CPU_ISA=SSE41 and the default AVX2):

| model | waveform rel. L2 | mel-spectrogram rel. L2 | bound (both) |
| --- | --- | --- | --- |
| v1 tiny, ``mel100`` | 0.02459–0.02462 | 0.02485–0.02522 | 0.04 |
| v2 tiny, ``mel60`` | 0.01223–0.01235 | 0.01342–0.01356 | 0.02 |
| v3 tiny (causal), ``whole`` | 0.00931 | 0.01075–0.01077 | 0.018 |
| v3 tiny (causal), ``stream`` | 0.00846–0.00874 | 0.01021–0.01032 | 0.018 |

The bound is 1.6× the deviation (its spread across paths is ≈ 3e-4). The whole-mel figures held
to 1e-5 on the engine's Snake kernel and on the torch path (test_snake_avx2.py). With 8-bit
weights the AVX2 kernels saturate and the same cases measured 0.053 and 0.060: over both bounds.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import cast

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA
from torch import Tensor

from engine.core import hift_int8
from engine.core.hift import CausalCLConv1d, CLConv1d, HiFTGenerator
from engine.core.hift_int8 import Int8Conv, int8_conv_fast, quantize_activation
from engine.core.weight_norm import normalize_hift_state_dict
from engine.prompt.features import V1_PROMPT_MEL, V2_PROMPT_MEL, MelSpec, prompt_mel

needs_int8_here = pytest.mark.skipif(
    not int8_conv_fast(), reason="the int8 HiFT is not used on this CPU (it stays float32)"
)


def tiny_vocoder(family: str) -> tuple[HiFTGenerator, Tensor, MelSpec]:
    if family == "v3":
        from engine.cosyvoice3.model_dir import read_args, read_part

        tiny = DATA / "cosyvoice3" / "tiny"
        causal = cast(HiFTGenerator, read_part(tiny, read_args(tiny), "hift"))
        cases = torch.load(DATA / "cosyvoice3" / "hift_cases.pt", weights_only=True)
        return causal, cases["whole/in_mel"].unsqueeze(0), V2_PROMPT_MEL
    if family == "v1":
        from engine.cosyvoice1.hparams import load_model_args

        args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml").hift
        state = torch.load(DATA / "tiny_model" / "hift.pt", weights_only=True)
        mel = torch.load(DATA / "hift_fixtures.pt", weights_only=True)["mel100/in_mel"]
        spec = V1_PROMPT_MEL
    else:
        from engine.cosyvoice2.flow_args import load_hift_args

        tiny = DATA / "cosyvoice2" / "tiny"
        args = load_hift_args(tiny / "cosyvoice2.yaml")
        state = torch.load(tiny / "hift.pt", weights_only=True)
        cases = torch.load(DATA / "cosyvoice2" / "hift_cases.pt", weights_only=True)
        mel, spec = cases["mel60/in_mel"].unsqueeze(0), V2_PROMPT_MEL
    model = HiFTGenerator(args)
    model.load_state_dict(normalize_hift_state_dict(state), strict=True)
    return model, mel, spec


@needs_int8_here
def test_int8_conv_computes_the_formats_integer_products() -> None:
    # Inputs well above zero: their uint8 codes sit near 255, where 8-bit weights would push
    # pairs of products past int16 on AVX2. The result is the float64 convolution of the
    # dequantised codes, to float32 rounding.
    torch.manual_seed(0)
    conv = CLConv1d(128, 128, 11, dilation=5, padding=25)
    with torch.no_grad():
        conv.bias.normal_()
    x = (torch.rand(1, 128, 1, 900) * 4 - 1).contiguous(memory_format=torch.channels_last)
    int8 = Int8Conv(conv)
    with torch.inference_mode():
        got = int8(x)
        codes, scale, zero_point = quantize_activation(x)
        weight = int8.weight.double() * int8.weight_scale.double().view(-1, 1, 1)
        x_deq = (codes.double() - zero_point) * scale
        want = F.conv1d(x_deq.squeeze(2), weight, int8.bias.double(), padding=25, dilation=5)
    assert codes.dtype == torch.uint8 and int(codes.max()) == 255
    assert int8.weight.abs().max() <= 63
    assert float((got.squeeze(2) - want).abs().max() / want.abs().max()) < 1e-5


@needs_int8_here
def test_a_causal_int8_conv_pads_on_the_left_as_its_float_conv() -> None:
    # CosyVoice3's causal HiFT: output t reads inputs up to t, and as many come out as go in.
    torch.manual_seed(0)
    conv = CausalCLConv1d(16, 16, 5, dilation=3)
    x = torch.randn(1, 16, 1, 200).contiguous(memory_format=torch.channels_last)
    int8 = Int8Conv(conv)
    with torch.inference_mode():
        got = int8(x)
        codes, scale, zero_point = quantize_activation(x)
        weight = int8.weight.double() * int8.weight_scale.double().view(-1, 1, 1)
        x_deq = F.pad((codes.double() - zero_point) * scale, (12, 0)).squeeze(2)
        want = F.conv1d(x_deq, weight, int8.bias.double(), dilation=3)
        floats = conv(x)
    assert got.shape == floats.shape == x.shape
    assert float((got.squeeze(2) - want).abs().max() / want.abs().max()) < 1e-5


def test_only_the_residual_blocks_convolutions_turn_int8() -> None:
    model, _, _ = tiny_vocoder("v2")
    n_float = sum(isinstance(m, CLConv1d) for m in model.modules())
    model.use_int8()
    int8 = [m for m in model.modules() if isinstance(m, Int8Conv)]
    n_residual = 2 * 3 * (len(model.resblocks) + len(model.source_resblocks))  # 3 units, 2 convs
    assert len(int8) == n_residual
    assert sum(isinstance(m, CLConv1d) for m in model.modules()) == n_float - n_residual
    assert model.quantized and model.filter_dtype == torch.float32
    assert isinstance(model.conv_pre, CLConv1d) and isinstance(model.conv_post, CLConv1d)
    assert all(isinstance(m, CLConv1d) for m in model.source_downs)


@needs_int8_here
@pytest.mark.parametrize(("family", "bound"), [("v1", 0.04), ("v2", 0.02), ("v3", 0.018)])
def test_the_int8_hift_stays_within_its_bound_of_float32(family: str, bound: float) -> None:
    exact, mel, spec = tiny_vocoder(family)
    approx = copy.deepcopy(exact)
    approx.use_int8()

    def wave(model: HiFTGenerator) -> Tensor:
        with torch.inference_mode():
            return model.inference(mel, generator=torch.Generator().manual_seed(0))[0]

    want, got = wave(exact), wave(approx)
    wave_l2 = float((got - want).norm() / want.norm())
    mel_want, mel_got = prompt_mel(want, spec).exp(), prompt_mel(got, spec).exp()
    mel_l2 = float((mel_got - mel_want).norm() / mel_want.norm())
    assert 0 < wave_l2 < bound and 0 < mel_l2 < bound


@needs_int8_here
def test_the_engine_loads_the_int8_hift_from_its_prepared_file(tmp_path: Path) -> None:
    from engine.cosyvoice1.engine import CosyVoiceEngine

    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()  # its prepared files go beside the model files: a fresh copy's
    for path in (DATA / "tiny_model").iterdir():
        if path.is_file():
            (model / path.name).symlink_to(path)
    first = CosyVoiceEngine.load(model, hift_int8=True, cache_dir=cache)
    assert "hift.int8" in first.prepared_at_load and first.hift_dtype == "int8"
    again = CosyVoiceEngine.load(model, hift_int8=True, cache_dir=cache)
    assert again.prepared_at_load == () and again.hift_dtype == "int8"
    mel = torch.load(DATA / "hift_fixtures.pt", weights_only=True)["mel100/in_mel"]
    with torch.inference_mode():
        prepared = again.models.hift.inference(mel, generator=torch.Generator().manual_seed(0))
        built = first.models.hift.inference(mel, generator=torch.Generator().manual_seed(0))
    assert torch.equal(prepared[0], built[0])


def test_a_cpu_without_fast_int8_convolutions_keeps_hift_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from engine.cosyvoice1.engine import CosyVoiceEngine

    monkeypatch.setattr(hift_int8, "int8_conv_fast", lambda: False)
    with caplog.at_level(logging.WARNING):
        engine = CosyVoiceEngine.load(
            DATA / "tiny_model", hift_int8=True, cache_dir=tmp_path, extra_formats=("hift.int8",)
        )
    assert engine.hift_dtype == "float32" and engine.weight_formats["hift"] == ("fp32",)
    assert "HiFT stays float32" in caplog.text


def test_int8_convolutions_are_used_only_where_they_were_measured_faster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    int8_conv_fast.cache_clear()
    monkeypatch.setattr(hift_int8.platform, "machine", lambda: "aarch64")
    assert int8_conv_fast() is False
    int8_conv_fast.cache_clear()
    monkeypatch.setattr(hift_int8.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert int8_conv_fast() is False
    int8_conv_fast.cache_clear()
