"""State the chunk-causal flow carries from one streamed chunk to the next.

Everything in the v2 flow looks left only (causal convolutions) or at whole chunks up to its own
(chunk attention with every earlier chunk visible). A chunk therefore needs, of the frames before
it, only each convolution's last ``kernel − 1`` inputs and each attention layer's keys and
values. Holding those (:class:`ConvTail`, :class:`KVBuffer`) lets a chunk be computed once, on
its own frames, with the result the whole sequence would have given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class KVBuffer:
    """Keys and values of one attention layer for every frame so far, one page per call.

    A chunk's keys and values are kept as (rows, heads, t, d), contiguous: copied once when
    the chunk arrives and never written again; no capacity is held in reserve. ``dtype`` (e.g.
    float16) stores the pages in a narrower type, an approximation that halves their memory;
    a chunk still attends to its own keys at full precision.
    """

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.pages: list[tuple[Tensor, Tensor]] = []
        self.length = 0
        self.dtype = dtype

    def attend(self, q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None = None) -> Tensor:
        """Add the keys and values (rows, heads, t, d) of t new positions, then
        softmax(q·Kᵀ/√d + bias)·V of their queries over every key so far; bias (…, t, length)
        additive (−inf hides a key). Returns (rows, heads, t, d)."""
        k, v = k.contiguous(), v.contiguous()
        self._store(k, v)
        if len(self.pages) > 1:
            # Every key in one operand, widened to the queries' type: one fused attention
            # (no score matrix in memory), where a product per page cost twice as much.
            old = self.pages[:-1]
            k = _joined([pk for pk, _ in old], k)
            v = _joined([pv for _, pv in old], v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)

    def _store(self, k: Tensor, v: Tensor) -> None:
        """Keep a page (contiguous; in ``dtype`` if one is set)."""
        if self.dtype is None:
            self.pages.append((k, v))
        else:
            self.pages.append((k.to(self.dtype), v.to(self.dtype)))
        self.length += k.shape[2]

    @property
    def nbytes(self) -> int:
        return sum(
            k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.pages
        )

    def copy(self) -> KVBuffer:
        """A buffer that goes on from here on its own; the pages so far are shared (they are
        never written)."""
        twin = KVBuffer(self.dtype)
        twin.pages, twin.length = list(self.pages), self.length
        return twin


def _joined(pages: list[Tensor], new: Tensor) -> Tensor:
    """The pages then ``new`` along the positions, in ``new``'s type. Where that is the type
    both promote to (float16 pages, float32 keys) cat widens the pages as it copies them,
    without a widened copy of each first."""
    if torch.promote_types(pages[0].dtype, new.dtype) != new.dtype:
        pages = [page.to(new.dtype) for page in pages]
    return torch.cat([*pages, new], dim=-2)


class ConvTail:
    """The last ``kernel − 1`` inputs of one left-padded convolution (zeros before the start)."""

    def __init__(self) -> None:
        self.frames: Tensor | None = None  # (rows, C, kernel - 1)

    def copy(self) -> ConvTail:
        twin = ConvTail()
        twin.frames = self.frames  # replaced, never written, by the next call
        return twin

    def conv(self, conv: nn.Conv1d, x: Tensor) -> Tensor:
        """``conv`` (built without padding) over x (rows, C, t) continued from earlier calls."""
        context = (conv.kernel_size[0] - 1) * conv.dilation[0]
        if context == 0:
            return conv(x)
        if self.frames is None:
            padded = F.pad(x, (context, 0))
        else:
            padded = torch.cat([self.frames, x], dim=-1)
        self.frames = padded[..., -context:].clone()  # not a view: the chunk's input can go
        return conv(padded)


def visibility_bias(visible: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A visibility mask as an additive attention bias (0 visible, −inf hidden)."""
    if visible is None:
        return None
    zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    return zeros.masked_fill_(~visible, float("-inf"))


def chunk_visible(
    start: int, queries: int, chunk: int | None, device: torch.device | None = None
) -> Tensor | None:
    """Which keys each query may see, (queries, start + queries) bool, or None for all.

    Queries sit at positions start … start+queries−1 of a sequence whose keys so far end at
    start+queries. With ``chunk`` a query sees every key before the end of its own chunk
    (all earlier chunks, its own chunk up to the keys that exist); None: every key.
    """
    if chunk is None:
        return None
    length = start + queries
    positions = torch.arange(start, length, device=device)
    ends = torch.clamp((positions // chunk + 1) * chunk, max=length)
    visible = torch.arange(length, device=device).unsqueeze(0) < ends.unsqueeze(1)
    return None if bool(visible.all()) else visible
