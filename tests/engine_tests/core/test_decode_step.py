"""The decode step in one native call (engine/core/native/decode_step_avx2.cpp): built where the
kernels it calls are, taken wherever every layer is one of them, and bit for bit the Python
path's results (the same operators in the same order)."""

from __future__ import annotations

import copy
import platform

import pytest
import torch

from engine.core import decode_step
from engine.core.cpu import read_cpuinfo
from engine.core.int4 import Int4Linear, int4_format_parts, pack_int4_format
from engine.core.quantize import install_int8_layers
from engine.core.transformer import KVCache
from engine.cosyvoice2.qwen2 import (
    Qwen2Config,
    Qwen2Model,
    int8_layer_names,
    quantize_qwen2_int8,
)

X86_64 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_FMA = X86_64 and {"avx2", "fma"} <= set(read_cpuinfo().split())
pytestmark = pytest.mark.skipif(not AVX2_FMA, reason="the kernels are for x86-64 with AVX2 and FMA")

# Grouped-query heads (4 query heads on 2 K/V heads) of 16, inputs whole int4 groups.
CONFIG = Qwen2Config(
    vocab_size=50,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
)
STEPS = 12


def _float_model() -> Qwen2Model:
    torch.manual_seed(0)
    model = Qwen2Model(CONFIG).eval()
    with torch.no_grad():  # norms away from 1, so that a norm weight mixed up would show
        for layer in model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.uniform_(0.5, 1.5)
    return model


def _quantised(lm_weights: str) -> Qwen2Model:
    model = _float_model()
    if lm_weights == "int8":
        return quantize_qwen2_int8(model)
    # as a prepared int4 file packs them: the feed-forward layers 4-bit, attention int8
    names = int8_layer_names(model)
    parts = int4_format_parts(model, names)
    install_int8_layers(model, {name: pack_int4_format(parts, name) for name in names})
    return model


def _decode(model: Qwen2Model, *, native: bool) -> tuple[torch.Tensor, KVCache]:
    """A 7-row prefill, then STEPS decode steps; their outputs and the cache."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(1, 7 + STEPS, CONFIG.hidden_size, generator=gen)
    with torch.inference_mode():
        cache = model.new_cache(1, 32)
        model.forward_cached(rows[:, :7], cache)
        outs = []
        for i in range(7, 7 + STEPS):
            if not native:
                model._native_step = (tuple(model.layers), None)  # noqa: SLF001
            outs.append(model.forward_cached(rows[:, i : i + 1], cache))
        return torch.cat(outs, 1), cache


def test_the_step_is_built_on_this_cpu() -> None:
    # script/setup and the add-on image build it on x86-64: without it a CosyVoice2 int4 token
    # spends a fifth more time in Python than in its products.
    assert decode_step.kernel() is not None


@pytest.mark.parametrize("lm_weights", ["int8", "int4"])
def test_the_native_step_is_bit_for_bit_the_python_path(lm_weights: str) -> None:
    model = _quantised(lm_weights)
    if lm_weights == "int4":
        assert isinstance(model.layers[0].mlp.gate_up_proj, Int4Linear)
    native_out, native_cache = _decode(model, native=True)
    assert model._native_step is not None and model._native_step[1] is not None  # noqa: SLF001
    python_out, python_cache = _decode(model, native=False)
    assert torch.equal(native_out, python_out)
    assert native_cache.length == python_cache.length == 7 + STEPS
    assert torch.equal(
        native_cache.kv[:, :, :, :, : 7 + STEPS], python_cache.kv[:, :, :, :, : 7 + STEPS]
    )


def test_float_layers_keep_the_python_path() -> None:
    model = _float_model()
    _decode(model, native=True)
    assert model._native_step is not None and model._native_step[1] is None  # noqa: SLF001


def test_a_prefill_builds_the_step_from_the_layers_it_then_has() -> None:
    """Layers quantised after an answer (the model's Linear layers swapped in place) are taken
    by the next answer's steps, not the old ones' float layers."""
    model = _float_model()
    _decode(model, native=True)
    quantize_qwen2_int8(model)
    reference = copy.deepcopy(model)
    native_out, _ = _decode(model, native=True)
    assert model._native_step is not None and model._native_step[1] is not None  # noqa: SLF001
    python_out, _ = _decode(reference, native=False)
    assert torch.equal(native_out, python_out)


def test_the_step_runs_only_where_its_kernels_take_the_row() -> None:
    """Float32 CPU rows without autograd, heads the attention kernel is compiled for."""
    row = torch.randn(1, 1, CONFIG.hidden_size)
    with torch.inference_mode():
        assert decode_step.runs(row, CONFIG.head_dim)
        assert not decode_step.runs(row.double(), CONFIG.head_dim)
        assert not decode_step.runs(row, 12)  # not a multiple of 8
    assert not decode_step.runs(row, CONFIG.head_dim)  # autograd on
