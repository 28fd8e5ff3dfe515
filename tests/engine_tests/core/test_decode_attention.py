"""The engine's decode-step attention kernel (engine/core/native/attention_avx2.cpp), which both
LM families' decode steps run: built where it should be, torch's batched products but for the
products' summation order, on the cache layouts the LMs hand it, and a clear error for
inputs it does not take."""

from __future__ import annotations

import math
import platform

import pytest
import torch

from engine.core import decode_attention
from engine.core.cpu import read_cpuinfo
from engine.core.decode_attention import attend_one, reference_attend_one

X86_64 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_FMA = X86_64 and {"avx2", "fma"} <= set(read_cpuinfo().split())
pytestmark = pytest.mark.skipif(not AVX2_FMA, reason="the kernel is for x86-64 with AVX2 and FMA")


def _cache(heads: int, length: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Keys and values as an LM's cache holds them: slices of a longer (H, max_len, D)."""
    kv = torch.randn(2, heads, length + 37, d, generator=gen)
    return kv[0, :, :length], kv[1, :, :length]


def _exact(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.double() for tensor in tensors]


# The kernel against torch's batched products in float64: float32 rounding is all that may
# part them. The bounds are a few times how far torch's own float32 products are from float64
# on every kernel path (ATEN_CPU_CAPABILITY default, avx2, avx512; 1-4 threads): comparing two
# float32 results instead, each a summation order apart from the other, failed on a CPU it
# was not fitted on. With the positional term the scores are an order larger, and so is their
# rounding.
PLAIN_ATOL = 2e-6
POSITIONAL_ATOL = 2e-5


def test_the_kernel_is_built_on_this_cpu() -> None:
    # script/setup and the add-on image build it on x86-64: without it every decode step spends
    # milliseconds more in torch's one-column batched products.
    assert decode_attention.kernel_runs(64)


@pytest.mark.parametrize(
    ("heads", "group", "length", "d"),
    [
        (2, 7, 1, 64),
        (2, 7, 203, 64),
        (16, 1, 130, 64),
        (4, 2, 9, 128),
        (1, 1, 1000, 64),
        (2, 2, 17, 8),
        (3, 1, 6, 24),
    ],  # fmt: skip
)
def test_grouped_queries_match_torchs_products(heads: int, group: int, length: int, d: int) -> None:
    gen = torch.Generator().manual_seed(length + heads)
    q = torch.randn(heads, group, d, generator=gen)
    keys, values = _cache(heads, length, d, gen)
    scale = 1.0 / math.sqrt(d)
    with torch.inference_mode():
        out = attend_one(q, keys, values, scale)
        expected = reference_attend_one(*_exact(q, keys, values), scale)
    assert out.shape == (heads, group, d)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=PLAIN_ATOL)


@pytest.mark.parametrize("lengths", [[5], [3, 64, 64], [64, 1]])
def test_relative_positions_match_torchs_products(lengths: list[int]) -> None:
    """CosyVoice-300M's positional term: rows in pieces, the first one cut, as its layers keep
    them (engine.core.transformer)."""
    heads, d = 16, 64
    gen = torch.Generator().manual_seed(sum(lengths))
    blocks = [torch.randn(heads, 64, d, generator=gen) for _ in lengths]
    pieces = [block[:, 64 - n :] if i == 0 else block[:, :n] for i, (block, n) in
              enumerate(zip(blocks, lengths, strict=True))]  # fmt: skip
    length = sum(lengths)
    qu, qv = torch.randn(2, heads, 1, d, generator=gen).unbind(0)
    keys, values = _cache(heads, length, d, gen)
    with torch.inference_mode():
        out = attend_one(qu, keys, values, 0.125, qv, pieces)
        qu64, keys64, values64, qv64 = _exact(qu, keys, values, qv)
        expected = reference_attend_one(qu64, keys64, values64, 0.125, qv64, _exact(*pieces))
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=POSITIONAL_ATOL)


def test_inputs_it_cannot_take_are_refused_with_a_reason() -> None:
    kernel = decode_attention._kernel()
    assert kernel is not None
    q = torch.randn(2, 1, 64)
    keys = torch.randn(2, 10, 64)
    with pytest.raises(RuntimeError, match="5 rows for 10 positions"):
        kernel.decode_attention(q, keys, keys, 1.0, q.view(2, 64), [torch.randn(2, 5, 64)])
    with pytest.raises(RuntimeError, match="head size"):
        kernel.decode_attention(torch.randn(2, 1, 20), keys, keys, 1.0)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        kernel.decode_attention(q, keys.transpose(1, 2).contiguous().transpose(1, 2), keys, 1.0)


def test_other_head_sizes_take_torchs_products() -> None:
    gen = torch.Generator().manual_seed(3)
    q, keys = torch.randn(2, 3, 20, generator=gen), torch.randn(2, 11, 20, generator=gen)
    with torch.inference_mode():
        out = attend_one(q, keys, keys, 0.5)
        assert torch.equal(out, reference_attend_one(q, keys, keys, 0.5))


@pytest.mark.parametrize("family", ["cosyvoice1", "cosyvoice2", "cosyvoice3"])
def test_the_parity_tests_tiny_lms_decode_through_the_kernel(family: str) -> None:
    """The parity tests hold the kernel only if their tiny models' heads are sizes it takes."""
    import importlib

    from conftest import DATA

    from engine.core.transformer import RelPosAttention
    from engine.cosyvoice2.qwen2 import Qwen2Attention

    directory = {"cosyvoice1": "tiny_model", "cosyvoice2": "cosyvoice2/tiny"}
    model_dir = DATA / directory.get(family, "cosyvoice3/tiny")
    load = importlib.import_module(f"engine.{family}.model_dir").load_model_dir
    sizes = set()
    for layer in load(model_dir).llm.llm.modules():  # the decoder (not v1's text encoder)
        if isinstance(layer, RelPosAttention):
            sizes.add(layer.d_k)
        elif isinstance(layer, Qwen2Attention):
            sizes.add(layer.head_dim)
    assert sizes and all(decode_attention.kernel_runs(size) for size in sizes), sizes
