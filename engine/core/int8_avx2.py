"""The LM's int8 layers on the engine's own AVX2 kernel (engine/core/native/int8_avx2.cpp).

A decode step multiplies one row of activations by every LM weight once per token. torch's
fbgemm kernel reads the weights at about half the bandwidth a core can stream at one row; this
kernel reads them in blocks laid out for that case and computes fbgemm's arithmetic bit for bit
(the same activation quantisation, integer sums and float epilogue), so an LM gives the same
tokens on either kernel. Prompt and text rows (many at once) go through the same layer.
docs/dev/int8-kernel.md has the design and its measurements.

Many rows at once (a prompt's prefill, v1's text encoder) take an int8 GEMM where the CPU has
VNNI or AMX (:func:`int8_matmul_works`): the same quantised activations and the same float
epilogue around the same integer sums, computed several times as fast; the layer's weight is
read back from its blocks for the call. The sums come from AMX's tiles where the process may use
them (native/amx_int8.h: oneDNN may be capped below AMX for the int8 HiFT), else from oneDNN
(``torch._int_mm``).

Built by setup.py on x86-64 only; elsewhere (aarch64), or on a CPU without AVX2 and FMA, the
engine keeps torch's own int8 layer (engine.core.quantize.Int8Linear).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from engine.core import native
from engine.core.cpu import read_cpuinfo

_LOGGER = logging.getLogger(__name__)

# From this many rows on a call takes oneDNN's GEMM where it works (docs/dev/int8-kernel.md:
# with the weight read back from its blocks it is ahead from ≈ 20 rows on AMX).
MATMUL_ROWS = 32
# The CPU features with which oneDNN sums int8 products exactly: without VNNI it adds pairs
# of products in saturating 16-bit lanes.
_EXACT_INT8_FEATURES = frozenset({"avx_vnni", "avx512_vnni", "amx_int8"})


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled kernel module if it is built and this CPU can run it, else None."""
    return native.load("int8_avx2")


def sums_exact(matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``matmul`` (int8 (M, K) x int8 (K, N) -> int32) gives exact sums on the
    activations the kernels give it at their worst (the int8 kernel's 7-bit codes, the int4
    path's signed ones): codes of ±127 against weights of ±127, where 16-bit pair sums would
    saturate."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (32, 256), dtype=torch.int8, generator=gen)
    codes[::4] = 127
    codes[1::4] = -127
    weight = torch.randint(-127, 128, (64, 256), dtype=torch.int8, generator=gen)
    weight[::3] = 127
    weight[1::3] = -127
    try:
        sums = matmul(codes, weight.t())
    except RuntimeError:
        return False
    return torch.equal(sums.long(), codes.long() @ weight.long().t())


@functools.cache
def int8_matmul_works() -> bool:
    """Whether many-row calls take an int8 GEMM here: x86 with VNNI or AMX, where oneDNN's
    sums exactly (checked; ``ONEDNN_MAX_CPU_ISA`` may keep oneDNN below them) and faster. The
    kernels then compute the sums on AMX's tiles where the process may use them."""
    compiled = kernel()
    if compiled is None or not _EXACT_INT8_FEATURES & set(read_cpuinfo().split()):
        return False
    works = sums_exact(torch._int_mm)
    if works:
        on = "AMX's tiles" if compiled.amx_ready() else "oneDNN's int8 GEMM"
        _LOGGER.info("The LM reads prompts with %s", on)
    else:
        _LOGGER.info("oneDNN's int8 GEMM does not sum exactly here: the LM's kernels read prompts")
    return works


def fits(in_features: int) -> bool:
    """Whether a layer with ``in_features`` inputs can run on the kernel here (4 inputs make
    one step of its blocks)."""
    return kernel() is not None and in_features % 4 == 0


class Avx2Int8Linear(nn.Module):
    """A per-channel symmetric int8 Linear with dynamically quantised activations, as
    ``Int8Linear``, on the engine's kernel.

    Holds the weight re-laid in blocks of 8 output channels (``blocks``), each channel's weight
    sum (``rowsum``, for the activations' zero point), its float32 scale and the bias, the last
    three padded to whole blocks.
    """

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        compiled = kernel()
        if compiled is None or not fits(weight.shape[1]):
            raise RuntimeError("the engine's int8 kernel cannot run this layer here")
        self.out_features, self.in_features = weight.shape
        blocks, rowsum = compiled.pack(weight)
        self._linear = compiled.linear
        self.blocks: torch.Tensor
        self.register_buffer("blocks", blocks)
        self.register_buffer("rowsum", rowsum)
        # float32 scales, as fbgemm keeps them: its products are the reference, bit for bit.
        self.register_buffer("scale", native.padded(scales, rowsum.numel()))
        padded_bias = None if bias is None else native.padded(bias, rowsum.numel())
        self.register_buffer("bias", padded_bias)
        self.matmul_rows = MATMUL_ROWS if int8_matmul_works() else 0  # 0: never

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(
            x,
            self.blocks,
            self.rowsum,
            self.scale,
            self.bias,
            self.out_features,
            False,
            self.matmul_rows,
        )

    def forward_relu(self, x: torch.Tensor) -> torch.Tensor:
        """relu(forward(x)) in one kernel call."""
        return self._linear(
            x,
            self.blocks,
            self.rowsum,
            self.scale,
            self.bias,
            self.out_features,
            True,
            self.matmul_rows,
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
