"""Snake, HiFT's activation: x + sin²(αx)/α per channel.

Its own module because both vocoder paths read it: the float32 HiFT (engine.core.hift) calls it,
the int8 HiFT's convolutions (engine.core.hift_int8) take it into their activation's
quantisation.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Snake(nn.Module):
    """x + sin²(αx)/α per channel, with a linear-scale α (on (1, C, 1, L) tensors).

    engine/core/native/snake_avx2.cpp computes the same ops in the same order (its own sin) for
    the int8 HiFT: a change here must change it too.
    """

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: Tensor) -> Tensor:
        alpha = self.alpha.view(1, -1, 1, 1)
        t = x * alpha
        t.sin_().square_()  # in place: one temporary instead of three
        return torch.addcmul(x, t, 1.0 / (alpha + 1e-9))
