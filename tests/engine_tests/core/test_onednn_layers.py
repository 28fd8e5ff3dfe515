"""The estimator's float32 Linear and Conv1d layers on oneDNN (engine.core.onednn_layers): same
outputs as ``nn.Linear`` / ``nn.Conv1d`` up to summation order, swapped in by the engine's load
(the Linears only while the estimator is float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import DATA, ONEDNN_OPS_NEEDED
from torch import nn

from engine.core.estimator_blocks import TransformerBlock
from engine.core.onednn_layers import (
    OneDnnConv1d,
    OneDnnLinear,
    onednn_conv_available,
    onednn_linear_available,
    use_onednn_convs,
    use_onednn_linears,
)
from engine.cosyvoice1.engine import CosyVoiceEngine

TINY = DATA / "tiny_model"

pytestmark = pytest.mark.skipif(
    not (onednn_linear_available() and onednn_conv_available()),
    reason=ONEDNN_OPS_NEEDED,
)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (154, 48), (2, 39, 48)])
def test_matches_nn_linear(bias: bool, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(80, generator=gen))
    x = torch.randn(shape, generator=gen)
    layer = OneDnnLinear(linear.weight, linear.bias)
    with torch.no_grad():
        expected = linear(x)
        out = layer(x)
        # A transposed (non-contiguous) input, as the attention's output reshape can give.
        xt = torch.randn(shape[-1], *shape[:-1], generator=gen).movedim(0, -1)
        torch.testing.assert_close(layer(xt), linear(xt), atol=1e-5, rtol=1e-5)
    assert out.shape == expected.shape
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_swaps_only_float_linears_inside_the_given_blocks() -> None:
    block = TransformerBlock(32, heads=2, head_dim=16)
    root = nn.ModuleDict({"block": block, "outside": nn.Linear(32, 32)})
    block.ff.net[2] = nn.Identity()  # a non-Linear child in a Linear's slot stays as it is
    assert use_onednn_linears(root, TransformerBlock) == 5  # q, k, v, out, the GELU proj
    assert type(root["outside"]) is nn.Linear
    assert all(type(m) is not nn.Linear for m in block.modules())


def test_engine_load_puts_the_float_estimator_on_onednn() -> None:
    estimator = CosyVoiceEngine.load(TINY).models.flow.decoder.estimator
    in_blocks = [
        m
        for b in estimator.modules()
        if isinstance(b, TransformerBlock)
        for m in b.modules()
        if isinstance(m, OneDnnLinear | nn.Linear)
    ]
    assert in_blocks and all(isinstance(m, OneDnnLinear) for m in in_blocks)
    assert not any(type(m) is nn.Conv1d for m in estimator.modules())
    # Outside the transformer blocks (the time MLP, 1-2 rows) the default path is faster.
    assert any(type(m) is nn.Linear for m in estimator.modules())


def test_engine_load_keeps_an_int8_estimator_int8(tmp_path: Path) -> None:
    engine = CosyVoiceEngine.load(TINY, flow_int8=True, cache_dir=tmp_path)
    assert not any(isinstance(m, OneDnnLinear) for m in engine.models.flow.modules())
    # Its convolutions are float32 either way, so they run on oneDNN too.
    estimator = engine.models.flow.decoder.estimator
    assert any(isinstance(m, OneDnnConv1d) for m in estimator.modules())
    assert not any(type(m) is nn.Conv1d for m in estimator.modules())


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "dilation", "bias"),
    [(3, 1, 1, 1, True), (1, 1, 0, 1, True), (3, 2, 1, 1, True), (7, 1, 9, 3, False)],
)
@pytest.mark.parametrize(("batch", "frames"), [(1, 5), (2, 35), (2, 200)])
def test_conv_matches_nn_conv1d(
    kernel: int, stride: int, padding: int, dilation: int, bias: bool, batch: int, frames: int
) -> None:
    gen = torch.Generator().manual_seed(1)
    conv = nn.Conv1d(24, 40, kernel, stride=stride, padding=padding, dilation=dilation, bias=bias)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=gen))
        if bias:
            conv.bias.copy_(torch.randn(40, generator=gen))
    layer = OneDnnConv1d(conv)
    x = torch.randn(batch, 24, frames, generator=gen)
    # The estimator feeds both plain inputs and channels-last ones (a transformer's output).
    x_channels_last = x.transpose(1, 2).contiguous().transpose(1, 2)
    with torch.no_grad():
        expected = conv(x)
        for given in (x, x_channels_last):
            out = layer(given)
            assert out.shape == expected.shape
            torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_conv_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="ungrouped"):
        OneDnnConv1d(nn.Conv1d(8, 8, 3, padding=1, groups=2))
    with pytest.raises(ValueError, match="zero-padded"):
        OneDnnConv1d(nn.Conv1d(8, 8, 3, padding=1, padding_mode="reflect"))


def test_swaps_the_conv1d_layers_it_can_run() -> None:
    root = nn.Sequential(
        nn.Conv1d(4, 8, 3, padding=1),
        nn.ModuleList([nn.Conv1d(8, 8, 1)]),
        nn.ConvTranspose1d(8, 8, 4, stride=2, padding=1),
        nn.Conv1d(8, 8, 3, padding=1, groups=2),
    )
    assert use_onednn_convs(root) == 2
    assert isinstance(root[0], OneDnnConv1d) and isinstance(root[1][0], OneDnnConv1d)
    assert type(root[2]) is nn.ConvTranspose1d  # transposed convolutions stay as they are
    assert type(root[3]) is nn.Conv1d  # so do those it cannot run (grouped here)
