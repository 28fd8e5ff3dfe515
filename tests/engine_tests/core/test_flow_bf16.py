"""The bfloat16 flow (``flow.bf16``): its deviation from the float32 flow, measured on every CPU
(the layer computes the native kernel's rounding in float32 where the CPU has no bfloat16
units), and the engine loading it only where the CPU computes bfloat16 natively."""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import pytest
import torch
from conftest import DATA

from engine.bench.flow_solvers import EXACT, v1_solve, v2_whole_solve
from engine.core import cpu
from engine.core.bf16_flow import Bf16Linear, bf16_layer_names, has_bf16_linears, use_bf16_linears

# Measured on the tiny models: 0.0035 (v1) and 0.0033 (CosyVoice2) at the exact settings;
# the full-size models' figures are in docs/dev/flow-solver.md. A bound of a few times that.
MAX_DEVIATION = 0.02


def test_the_emulated_products_round_as_the_bfloat16_kernel() -> None:
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(2, 40, 64, generator=gen)
    native = Bf16Linear(weight, bias, native=True)(x)
    emulated = Bf16Linear(weight, bias, native=False)(x)
    # Both are float32 sums of the same bfloat16 products, rounded to bfloat16: at most the
    # summation order apart, i.e. one bfloat16 step.
    torch.testing.assert_close(emulated, native, rtol=2**-7, atol=1e-6)
    exact = x @ weight.T + bias
    assert 1e-4 < float((emulated - exact).norm() / exact.norm()) < 1e-2


def _v1_flow() -> torch.nn.Module:
    from engine.cosyvoice1 import model_dir as v1

    model = DATA / "tiny_model"
    return v1.read_part(model, v1.read_model_args(model), "flow")


def _v2_flow() -> torch.nn.Module:
    from engine.cosyvoice2 import model_dir as v2

    model = DATA / "cosyvoice2" / "tiny"
    return v2.read_part(model, v2.read_args(model), "flow")


@pytest.mark.parametrize(("load", "solve"), [(_v1_flow, v1_solve), (_v2_flow, v2_whole_solve)])
def test_bfloat16_flow_deviation_is_bounded(load, solve) -> None:  # type: ignore[no-untyped-def]
    flow = load()
    bf16 = use_bf16_linears(copy.deepcopy(flow))
    swapped = bf16_layer_names(flow)
    assert swapped and all(isinstance(bf16.get_submodule(n), Bf16Linear) for n in swapped)
    assert all(bf16.get_submodule(n).weight.dtype == torch.bfloat16 for n in swapped)
    exact, approx = solve(flow, 40)(EXACT), solve(bf16, 40)(EXACT)
    deviation = float((approx - exact).norm() / exact.norm())
    assert 0 < deviation < MAX_DEVIATION


def test_the_engine_loads_the_bfloat16_flow_only_where_native(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from engine.core.runtime import loaded_format
    from engine.cosyvoice1.engine import CosyVoiceEngine

    model, cache = DATA / "tiny_model", tmp_path / "cache"
    monkeypatch.setattr(cpu, "bf16_native", lambda: False)
    with caplog.at_level(logging.WARNING):
        fallback = CosyVoiceEngine.load(model, flow_bf16=True, cache_dir=cache)
    assert list(fallback.flows) == ["fp32"]
    assert not has_bf16_linears(fallback.flows["fp32"])
    assert "no native bfloat16 matrix units" in caplog.text

    monkeypatch.setattr(cpu, "bf16_native", lambda: True)
    engine = CosyVoiceEngine.load(model, flow_bf16=True, cache_dir=cache)
    assert list(engine.flows) == ["bf16"]
    flow = engine.flows["bf16"]
    assert loaded_format(flow) == "bf16"
    weights = [m.weight for m in flow.modules() if isinstance(m, Bf16Linear)]
    assert len(weights) == len(bf16_layer_names(_v1_flow()))
    assert all(w.dtype == torch.bfloat16 for w in weights)
    prepared = list(Path(model, "prepared").glob("flow.bf16.*")) + list(cache.rglob("flow.bf16.*"))
    assert prepared, "the bfloat16 weights come from a prepared file of their own"
    chunks = list(engine.synthesize("你好。", _options(engine)))
    assert chunks and all(len(chunk.samples) for chunk in chunks)


def _options(engine):  # type: ignore[no-untyped-def]
    from engine.core.types import SynthesisOptions

    return SynthesisOptions(speaker=engine.speakers[0], n_timesteps=2, force_tokens=30, seed=0)
