"""The decode step in one native call (engine/core/native/decode_step_avx2.cpp): built where the
kernels it calls are, taken wherever every layer is one of them, and bit for bit the Python
path's results (the same operators in the same order) for both LM layouts: Qwen2 (CosyVoice2,
Fun-CosyVoice3) and relative positions (CosyVoice-300M)."""

from __future__ import annotations

import copy
import platform
import threading

import pytest
import torch
from conftest import TINY_MODEL
from torch import nn

from engine.core import decode_step
from engine.core.cpu import read_cpuinfo
from engine.core.int4 import Int4Linear, int4_format_parts, pack_int4_format
from engine.core.quantize import install_int8_layers, int8_parts, pack_lm_int8
from engine.core.quantize import int8_layer_names as v1_int8_layer_names
from engine.core.transformer import ROW_BLOCK, KVCache, RelPosEncoder
from engine.cosyvoice1.hparams import load_model_args
from engine.cosyvoice1.llm import TransformerLM
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
    """Float32 CPU rows and caches without autograd, heads the attention kernel is compiled
    for."""
    row = torch.randn(1, 1, CONFIG.hidden_size)
    kv = torch.zeros(3, 2, 1, 2, 8, CONFIG.head_dim)
    with torch.inference_mode():
        assert decode_step.runs(row, kv, CONFIG.head_dim)
        assert not decode_step.runs(row.double(), kv, CONFIG.head_dim)
        assert not decode_step.runs(row, kv.bfloat16(), CONFIG.head_dim)
        assert not decode_step.runs(row, kv, 12)  # not a multiple of 8
    assert not decode_step.runs(row, kv, CONFIG.head_dim)  # autograd on


# --- relative positions (CosyVoice-300M) -----------------------------------------------------

# Past the first block of positional rows: the steps cross into the second.
V1_PREFILL, V1_STEPS = 5, ROW_BLOCK + 10


def _v1_encoder(lm_weights: str) -> RelPosEncoder:
    """The tiny CosyVoice-300M LM's decoder stack, its layers packed as a prepared file of
    ``lm_weights`` packs them."""
    args = load_model_args(TINY_MODEL / "cosyvoice.yaml")
    model = TransformerLM(args.llm).eval()
    model.load_state_dict(torch.load(TINY_MODEL / "llm.pt", weights_only=True))
    names = v1_int8_layer_names(model)
    if lm_weights == "int8":
        parts = int8_parts(model, names)
        install_int8_layers(model, {name: pack_lm_int8(parts, name) for name in names})
    elif lm_weights == "int4":
        parts = int4_format_parts(model, names)
        install_int8_layers(model, {name: pack_int4_format(parts, name) for name in names})
    return model.llm


class _V1Answer:
    """One answer's prefill and decode steps, a step at a time (answers can take turns)."""

    def __init__(self, encoder: RelPosEncoder, seed: int) -> None:
        self.encoder = encoder
        gen = torch.Generator().manual_seed(seed)
        self.rows = torch.randn(1, V1_PREFILL + V1_STEPS, encoder.args.input_size, generator=gen)
        self.cache = encoder.new_cache(1, V1_PREFILL + V1_STEPS)
        self.outs: list[torch.Tensor] = []
        with torch.inference_mode():
            encoder.forward_cached(self.rows[:, :V1_PREFILL], self.cache)

    def step(self, *, native: bool) -> None:
        i = self.cache.length
        with torch.inference_mode():
            if not native:
                self.encoder._native_step = (tuple(self.encoder.encoders), None)  # noqa: SLF001
            self.outs.append(self.encoder.forward_cached(self.rows[:, i : i + 1], self.cache))


def _v1_reference(encoder: RelPosEncoder, seed: int) -> _V1Answer:
    answer = _V1Answer(encoder, seed)
    for _ in range(V1_STEPS):
        answer.step(native=False)
    return answer


def _same(answer: _V1Answer, reference: _V1Answer) -> bool:
    return torch.equal(torch.cat(answer.outs, 1), torch.cat(reference.outs, 1)) and torch.equal(
        answer.cache.kv, reference.cache.kv
    )


@pytest.mark.parametrize("lm_weights", ["int8", "int4"])
def test_a_rel_pos_step_is_bit_for_bit_the_python_path(lm_weights: str) -> None:
    encoder = _v1_encoder(lm_weights)
    answer = _V1Answer(encoder, seed=1)
    for _ in range(V1_STEPS):
        answer.step(native=True)
    assert encoder._native_step is not None and encoder._native_step[1] is not None  # noqa: SLF001
    assert _same(answer, _v1_reference(encoder, seed=1))


def test_answers_taking_turns_each_read_their_own_positions() -> None:
    """A second answer's prefill rebuilds the step while the first is past a block boundary:
    each answer's steps still read the positional rows of its own length."""
    encoder = _v1_encoder("int8")
    first = _V1Answer(encoder, seed=1)
    for _ in range(ROW_BLOCK):
        first.step(native=True)
    second = _V1Answer(encoder, seed=2)
    while len(second.outs) < V1_STEPS:
        second.step(native=True)
        if len(first.outs) < V1_STEPS:
            first.step(native=True)
    assert _same(first, _v1_reference(encoder, seed=1))
    assert _same(second, _v1_reference(encoder, seed=2))


def test_a_float_rel_pos_stack_keeps_the_python_path() -> None:
    encoder = _v1_encoder("float32")
    answer = _V1Answer(encoder, seed=1)
    answer.step(native=True)
    assert encoder._native_step is not None and encoder._native_step[1] is None  # noqa: SLF001


def test_a_silu_feed_forward_keeps_the_python_path() -> None:
    """The native step computes ReLU feed-forward layers (the LM's); others stay in Python."""
    encoder = _v1_encoder("int8")
    for layer in encoder.encoders:
        layer.feed_forward.act = nn.functional.silu
    answer = _V1Answer(encoder, seed=1)
    answer.step(native=True)
    assert encoder._native_step is not None and encoder._native_step[1] is None  # noqa: SLF001


def test_answers_in_threads_at_once_each_get_their_own_steps() -> None:
    """The step releases the GIL: answers decoding on one model in several threads (as with
    ``parallel_sentences: 2``), their steps at the same time, each get what they get alone."""
    qwen2 = _quantised("int4")
    rel_pos = _v1_encoder("int8")
    qwen2_alone = _decode(qwen2, native=True)[0]
    rel_pos_alone = _v1_reference(rel_pos, seed=1)
    results: dict[str, list] = {"qwen2": [], "rel_pos": []}

    def qwen2_answer() -> None:
        torch.set_num_threads(1)  # one thread each: the threads, not OpenMP teams, overlap
        results["qwen2"].append(_decode(qwen2, native=True)[0])

    def rel_pos_answer() -> None:
        torch.set_num_threads(1)
        answer = _V1Answer(rel_pos, seed=1)
        for _ in range(V1_STEPS):
            answer.step(native=True)
        results["rel_pos"].append(answer)

    threads = [threading.Thread(target=f) for f in (qwen2_answer, rel_pos_answer) * 2]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results["qwen2"]) == len(results["rel_pos"]) == 2
    assert all(torch.equal(out, qwen2_alone) for out in results["qwen2"])
    assert all(_same(answer, rel_pos_alone) for answer in results["rel_pos"])
