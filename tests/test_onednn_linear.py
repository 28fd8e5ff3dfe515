"""The estimator's float32 Linear layers on oneDNN (engine.onednn_linear): same outputs as
``nn.Linear`` up to summation order, swapped in by the engine's load, left alone when int8."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from engine.engine import CosyVoiceEngine
from engine.flow_estimator import TransformerBlock
from engine.onednn_linear import OneDnnLinear, onednn_linear_available, use_onednn_linears

TINY = Path(__file__).parent / "data" / "tiny_model"

pytestmark = pytest.mark.skipif(not onednn_linear_available(),
                                reason="this torch has no oneDNN matmul")


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
    in_blocks = [m for b in estimator.modules() if isinstance(b, TransformerBlock)
                 for m in b.modules() if isinstance(m, OneDnnLinear | nn.Linear)]
    assert in_blocks and all(isinstance(m, OneDnnLinear) for m in in_blocks)
    # Outside the transformer blocks (the time MLP, 1-2 rows) the default path is faster.
    assert any(type(m) is nn.Linear for m in estimator.modules())


def test_engine_load_leaves_an_int8_estimator_alone(tmp_path: Path) -> None:
    engine = CosyVoiceEngine.load(TINY, flow_int8=True, int8_cache_dir=tmp_path)
    assert not any(isinstance(m, OneDnnLinear) for m in engine.models.flow.modules())
