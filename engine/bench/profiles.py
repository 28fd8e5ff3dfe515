"""Benchmark profiles: the speed-relevant settings of one run.

A profile fixes what changes speed: the streaming schedule (when the first chunk is cut and how
hops grow), the number of flow ODE steps, the CFG rate and the weight formats of the flow and
HiFT. The engine alone knows two, ``realtime`` and ``quality``: its own low-latency and official
schedules at its default steps and guidance. The server's named profiles live in its
``config.yaml``; ``python -m wyoming_cosyvoice.bench`` reads them and hands them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from engine.core.types import LOW_LATENCY_SCHEDULE, OFFICIAL_SCHEDULE, StreamSchedule


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

    def to_json(self) -> dict[str, Any]:
        """Every field, the schedule as a mapping: what a worker process is handed."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchProfile:
        return cls(**{**data, "schedule": StreamSchedule(**data["schedule"])})


BUILTIN_PROFILES = {
    "realtime": BenchProfile("realtime", LOW_LATENCY_SCHEDULE),
    "quality": BenchProfile("quality", OFFICIAL_SCHEDULE),
}
DEFAULT_PROFILE = "realtime"


def get_profile(name: str, profiles: Mapping[str, BenchProfile] = BUILTIN_PROFILES) -> BenchProfile:
    """The named profile; ValueError listing the known names otherwise."""
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; available: {', '.join(sorted(profiles))}")
    return profiles[name]
