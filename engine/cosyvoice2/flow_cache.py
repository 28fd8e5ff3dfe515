"""State the chunk-causal flow carries from one streamed chunk to the next.

Everything in the v2 flow looks left only (causal convolutions) or at whole chunks up to its own
(chunk attention with every earlier chunk visible). A chunk therefore needs, of the frames before
it, only each convolution's last ``kernel − 1`` inputs and each attention layer's keys and
values. Holding those (:class:`ConvTail`, :class:`KVBuffer`) lets a chunk be computed once, on
its own frames, with the result the whole sequence would have given.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class KVBuffer:
    """Keys and values of one attention layer for every frame so far, one page per call.

    A chunk's keys are kept transposed, (rows, heads, d, t), and its values as (rows, heads,
    t, d), each contiguous: copied once when the chunk arrives, read in place by every later
    chunk, and no capacity is held in reserve. ``dtype`` (e.g.
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
        if not self.pages:
            self._store(k, v)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        keys_t, values = self._store(k, v)
        pages = [(pk.to(q.dtype), pv.to(q.dtype)) for pk, pv in self.pages[:-1]]
        pages.append((keys_t, values))
        # Made contiguous once: a strided operand would be copied again for every page.
        q = q.contiguous()
        scale = 1.0 / math.sqrt(q.shape[-1])
        scores = torch.cat([torch.matmul(q, pk) for pk, _ in pages], dim=-1)
        scores = scores * scale if bias is None else torch.add(bias, scores, alpha=scale)
        weights = scores.softmax(dim=-1)
        out: Tensor | None = None
        start = 0
        for _, pv in pages:
            end = start + pv.shape[2]
            part = torch.matmul(weights[..., start:end], pv)
            out = part if out is None else out.add_(part)
            start = end
        assert out is not None
        return out

    def _store(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Keep a page as the products read it, keys transposed (rows, heads, d, t) and values
        (rows, heads, t, d), both contiguous: a matmul then reads a page in place, where a
        strided one is copied on every read. Returns the page at the computed precision."""
        keys_t, values = k.transpose(-1, -2).contiguous(), v.contiguous()
        if self.dtype is None:
            self.pages.append((keys_t, values))
        else:
            self.pages.append((keys_t.to(self.dtype), values.to(self.dtype)))
        self.length += k.shape[2]
        return keys_t, values

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
