"""The attention of an LM's decode step (one new position of one sequence): the engine's AVX2
kernel where it runs (engine/core/native/attention_avx2.cpp), else torch's batched products.

Both compute softmax(scale · q·K + qp·P) · V per query head, the positional term only for
CosyVoice-300M's relative positions; they differ in the products' summation order, so in the
last bits (docs/dev/int8-kernel.md, the decode-step attention).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType

import torch
from torch import Tensor

from engine.core import native

# The head sizes the kernel is compiled for: multiples of 8 up to 128.
KERNEL_HEAD_SIZES = tuple(range(8, 129, 8))


@functools.cache
def _kernel() -> ModuleType | None:
    return native.load("attention_avx2")


def kernel_runs(head_size: int) -> bool:
    """Whether the kernel runs a decode step of heads of ``head_size`` here."""
    return _kernel() is not None and head_size in KERNEL_HEAD_SIZES


def attend_one(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    scale: float,
    pos_query: Tensor | None = None,
    pos_rows: Sequence[Tensor] = (),
) -> Tensor:
    """(H, G, D): ``q`` (H, G, D), G query heads per key/value head; ``keys``/``values`` (H, L, D)
    float32 with contiguous rows; ``pos_query`` (H, 1, D) against ``pos_rows``, consecutive
    pieces (H, n_i, D) of pre-scaled positional rows with sum n_i = L."""
    kernel = _kernel()
    if (
        kernel is not None
        and q.dtype == torch.float32
        and q.shape[-1] in KERNEL_HEAD_SIZES
        and not torch.is_grad_enabled()
    ):
        query = None if pos_query is None else pos_query.reshape(q.shape[0], q.shape[-1])
        return kernel.decode_attention(q, keys, values, scale, query, list(pos_rows))
    return reference_attend_one(q, keys, values, scale, pos_query, pos_rows)


def reference_attend_one(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    scale: float,
    pos_query: Tensor | None = None,
    pos_rows: Sequence[Tensor] = (),
) -> Tensor:
    """:func:`attend_one` with torch's batched products (the kernel's fallback and reference)."""
    if pos_query is None:
        scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)
    else:
        query = pos_query.transpose(1, 2)  # (H, D, 1)
        pos = torch.cat([torch.bmm(rows, query) for rows in pos_rows], 1)  # (H, L, 1)
        scores = torch.baddbmm(pos.transpose(1, 2), q, keys.transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(dim=-1), values)
