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
    """Keys and values of one attention layer for every frame so far, (rows, heads, T, d).

    Grown geometrically, so appending a chunk copies the history only O(log T) times over the
    whole stream rather than at every chunk.
    """

    def __init__(self) -> None:
        self._kv: Tensor | None = None  # (2, rows, heads, capacity, d)
        self.length = 0

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add k, v (rows, heads, t, d); return every key and value so far."""
        t = k.shape[2]
        end = self.length + t
        if self._kv is None or end > self._kv.shape[3]:
            capacity = max(end, 2 * (0 if self._kv is None else self._kv.shape[3]), 64)
            grown = k.new_empty(2, k.shape[0], k.shape[1], capacity, k.shape[3])
            if self._kv is not None:
                grown[:, :, :, : self.length] = self._kv[:, :, :, : self.length]
            self._kv = grown
        self._kv[0, :, :, self.length : end] = k
        self._kv[1, :, :, self.length : end] = v
        self.length = end
        return self._kv[0, :, :, :end], self._kv[1, :, :, :end]

    @property
    def nbytes(self) -> int:
        return 0 if self._kv is None else self._kv.numel() * self._kv.element_size()


class ConvTail:
    """The last ``kernel − 1`` inputs of one left-padded convolution (zeros before the start)."""

    def __init__(self) -> None:
        self.frames: Tensor | None = None  # (rows, C, kernel - 1)

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
