"""Benchmark profiles: the server's named profiles from ``config.yaml``, else built-in ones.

A profile fixes what changes speed: the streaming schedule (when the first chunk is cut and how
hops grow), the number of flow ODE steps, the CFG rate and the flow's weight format. The
server's ``config.yaml`` is the single source of truth; the built-ins only keep the benchmark
usable without the server package.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.types import LOW_LATENCY_SCHEDULE, OFFICIAL_SCHEDULE, StreamSchedule

_LOGGER = logging.getLogger(__name__)


@dataclass(frozen=True)
class BenchProfile:
    """The speed-relevant settings of one profile."""

    name: str
    schedule: StreamSchedule
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    source: str = "built-in"
    flow_weights: str = "fp32"  # the format the engine loads the flow in
    hift_weights: str = "fp32"  # the format HiFT's filter runs in

    def describe(self) -> dict[str, object]:
        s = self.schedule
        return {
            "name": self.name,
            "source": self.source,
            "schedule": s.name,
            "first_hop": s.first_hop,
            "growth": s.growth,
            "max_hop": s.max_hop,
            "n_timesteps": self.n_timesteps,
            "cfg_rate": self.cfg_rate,
            "flow_weights": self.flow_weights,
            "hift_weights": self.hift_weights,
        }


BUILTIN_PROFILES = {
    "realtime": BenchProfile("realtime", LOW_LATENCY_SCHEDULE),
    "quality": BenchProfile("quality", OFFICIAL_SCHEDULE),
}
DEFAULT_PROFILE = "realtime"


def available_profiles(config: Path | None = None) -> dict[str, BenchProfile]:
    """Profiles of the server config (``config`` or the repository's config.yaml) or built-ins."""
    try:
        from wyoming_cosyvoice.config import load_config
    except ImportError:
        _LOGGER.debug("wyoming_cosyvoice.config not importable; using built-in profiles")
        return dict(BUILTIN_PROFILES)
    server = load_config(config)
    source = str(config) if config else "config.yaml"
    return {
        name: BenchProfile(
            name, p.schedule, p.n_timesteps, p.cfg_rate, source, p.flow_weights, p.hift_weights
        )
        for name, p in server.profiles.items()
    }


def get_profile(name: str, config: Path | None = None) -> BenchProfile:
    """The named profile; ValueError listing the known names otherwise."""
    profiles = available_profiles(config)
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; available: {', '.join(sorted(profiles))}")
    return profiles[name]
