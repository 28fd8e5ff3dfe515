"""What the streaming of every family shares: where the flow and HiFT draw their noise, what
conditions the flow, and the float64 cross-fade between consecutive chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.core.constants import N_MELS


class HiftNoiseSource(Protocol):
    """Where HiFT gets its random draws (a seeded generator, or injected)."""

    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(phase uniform in [0,1) of shape (1, 9, 1), sine noise of shape (1, 9, n_samples))."""
        ...


class NoiseSource(HiftNoiseSource, Protocol):
    """Where the flow and HiFT get their random draws (CosyVoice v1's flow draws per chunk)."""

    def flow_noise(self, shape: tuple[int, ...]) -> torch.Tensor: ...


@dataclass
class GeneratorNoise:
    """Noise drawn from one ``torch.Generator`` (reproducible with a seed)."""

    generator: torch.Generator
    harmonics: int = 9

    def flow_noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=self.generator)

    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        phase = torch.rand((1, self.harmonics, 1), generator=self.generator)
        noise = torch.randn((1, self.harmonics, n_samples), generator=self.generator)
        return phase, noise


@dataclass(frozen=True)
class FlowPrompt:
    """What conditions the flow: the speaker x-vector and (zero-shot) prompt tokens and mel."""

    embedding: torch.Tensor  # (1, 192) un-normalised x-vector
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, dtype=torch.int64))
    # (1, T, 80): the prompt's mel frames (v1: T as the flow's regulator; v2: 2 a token)
    feat: torch.Tensor = field(default_factory=lambda: torch.zeros(1, 0, N_MELS))


def fade_in_out(
    fade_in: torch.Tensor, fade_out: torch.Tensor, window: torch.Tensor
) -> torch.Tensor:
    """Cross-fade the start of ``fade_in`` with the end of ``fade_out`` (float64 maths)."""
    n = window.numel() // 2
    head = fade_in[..., :n].double() * window[:n] + fade_out[..., -n:].double() * window[n:]
    out = fade_in.clone()
    out[..., :n] = head.to(fade_in.dtype)
    return out
