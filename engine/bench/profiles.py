"""Benchmark profiles: the speed-relevant settings of one run.

A profile fixes what changes speed: the streaming schedule (when the first chunk is cut and how
hops grow), the flow ODE's solver and steps, the CFG rate and the weight formats of the LM, the flow
and HiFT. The engine alone knows two, ``realtime`` and ``quality``: its own low-latency and
official schedules at its default steps and guidance, in the weight formats a server loads for
its profiles of those names (tests/engine_tests/bench/test_bench.py holds them equal). The server's
named profiles live in its ``config.yaml``; ``python -m wyoming_cosyvoice.bench`` reads them, with
the formats the server loads for each, and hands them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
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
    lm_weights: str = "fp32"  # the format the engine loads the LM decoder in
    solver: str = "euler"  # the flow ODE's solver (engine.core.solver)

    def with_weights(
        self, lm: str | None = None, flow: str | None = None, hift: str | None = None
    ) -> BenchProfile:
        """This profile with the formats given instead of its own (an experiment's)."""
        return replace(
            self,
            lm_weights=lm or self.lm_weights,
            flow_weights=flow or self.flow_weights,
            hift_weights=hift or self.hift_weights,
        )

    def load_keywords(self) -> dict[str, bool]:
        """The engine's load keywords (``engine.load_engine``) for this profile's formats."""
        keywords: dict[str, bool] = {}
        for part, weights in self.weight_formats().items():
            if weights not in LOAD_KEYWORDS[part]:
                known = ", ".join(LOAD_KEYWORDS[part])
                raise ValueError(f"the engine has no {part} weights {weights!r} (known: {known})")
            keywords.update(LOAD_KEYWORDS[part][weights])
        return keywords

    def weight_formats(self) -> dict[str, str]:
        return {"lm": self.lm_weights, "flow": self.flow_weights, "hift": self.hift_weights}

    def describe(self) -> dict[str, object]:
        s = self.schedule
        return {
            "name": self.name,
            "source": self.source,
            "schedule": s.name,
            "first_hop": s.first_hop,
            "growth": s.growth,
            "max_hop": s.max_hop,
            "paced": s.paced,
            "n_timesteps": self.n_timesteps,
            "cfg_rate": self.cfg_rate,
            "solver": self.solver,
            "lm_weights": self.lm_weights,
            "flow_weights": self.flow_weights,
            "hift_weights": self.hift_weights,
        }

    def to_json(self) -> dict[str, Any]:
        """Every field, the schedule as a mapping: what a worker process is handed."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BenchProfile:
        return cls(**{**data, "schedule": StreamSchedule(**data["schedule"])})


# Each part's weight formats and the engine's load keywords for them.
LOAD_KEYWORDS: dict[str, dict[str, dict[str, bool]]] = {
    "lm": {
        "fp32": {"lm_int8": False},
        "int8": {"lm_int8": True},
        "int4": {"lm_int8": False, "lm_int4": True},
    },
    "flow": {
        "fp32": {"flow_int8": False},
        "int8": {"flow_int8": True},
        "bf16": {"flow_int8": False, "flow_bf16": True},
    },
    "hift": {
        "fp32": {"hift_bf16": False},
        "bf16": {"hift_bf16": True},
        "int8": {"hift_int8": True},
    },
}

# As a server with its default settings loads its profiles of these names: the LM in int8, the
# low-latency hops paced (engine.core.pacing).
BUILTIN_PROFILES = {
    "realtime": BenchProfile(
        "realtime", replace(LOW_LATENCY_SCHEDULE, paced=True), lm_weights="int8"
    ),
    "quality": BenchProfile("quality", OFFICIAL_SCHEDULE, lm_weights="int8"),
}
DEFAULT_PROFILE = "realtime"


def get_profile(name: str, profiles: Mapping[str, BenchProfile] = BUILTIN_PROFILES) -> BenchProfile:
    """The named profile; ValueError listing the known names otherwise."""
    if name not in profiles:
        raise ValueError(f"unknown profile {name!r}; available: {', '.join(sorted(profiles))}")
    return profiles[name]
