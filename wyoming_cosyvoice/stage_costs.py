"""This machine's cost per stage of synthesis, measured by the engine and kept up to date.

The engine times each piece of work it does (engine.stage_times): the LM's way to its first
token and each token after it, the flow per mel frame·ODE step·batch row in each weight
format, HiFT per second of audio in each format. :class:`CostMeter` keeps a running average of
each (an exponential one: recent requests count most, one odd request does not swing it) per
number of free cores at the time, because a busy box is a slower box: with a neighbour on one
of two cores a stage takes up to twice as long.

:meth:`CostMeter.costs` answers for the cores free now. A figure measured with another number
of free cores stands in, scaled by the ratio of cores when fewer are free now (a conservative
guess; the first request on the busier box measures the real figure), and a format that has
not run yet is guessed from the other format of its part by the ratio measured on the
reference machine (``PRIOR_RATIOS``). Every guessed figure is named in ``estimated``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engine.stage_times import StageTime

# The weight of a new measurement in its running average.
ALPHA = 0.3
# A format that has not run yet, relative to its part's other format: the int8 flow's passes
# are about 25 % faster than float32's, the bfloat16 HiFT about twice as fast (docs/performance.md).
PRIOR_RATIOS: Mapping[str, Mapping[str, float]] = {
    "flow": {"fp32": 1.0, "int8": 0.75},
    "hift": {"fp32": 1.0, "bf16": 0.5},
}
LM_STAGES = ("lm_prefill", "lm_token")


def stage_key(time: StageTime) -> str:
    """``lm_prefill``, ``lm_token``, ``flow.int8``, ``hift.fp32``, ..."""
    return f"{time.stage}.{time.weights}" if time.weights else time.stage


@dataclass(frozen=True)
class StageCosts:
    """What each stage costs on this machine with ``cores`` free cores."""

    lm_prefill_s: float  # per text segment: the LM's way to its first token
    lm_token_s: float  # per speech token after the first
    flow_s: Mapping[str, float]  # per mel frame·ODE step·batch row, by weight format
    hift_s: Mapping[str, float]  # per second of audio, by weight format
    cores: int
    estimated: tuple[str, ...] = ()  # the figures not measured with these cores

    def as_dict(self) -> dict[str, Any]:
        """For /health: milliseconds per unit, rounded."""
        return {
            "cores": self.cores,
            "lm_prefill_ms": round(self.lm_prefill_s * 1000, 2),
            "lm_token_ms": round(self.lm_token_s * 1000, 3),
            "flow_us_per_frame_step": {k: round(v * 1e6, 2) for k, v in self.flow_s.items()},
            "hift_ms_per_audio_s": {k: round(v * 1000, 1) for k, v in self.hift_s.items()},
            "estimated": list(self.estimated),
        }


def free_cores_now(threads: int | None) -> int:
    """The threads a sentence gets now: the configured count (None: every core torch uses),
    no more than the cores other processes leave free (engine.thread_budget)."""
    from engine.thread_budget import threads_now  # torch: loaded by the engine by then

    return threads_now(None) if threads is None else min(threads, threads_now(None))


class CostMeter:
    """Running averages of the engine's stage costs, per number of free cores.

    :meth:`record` is the engine's listener (``SynthesisOptions.on_stage``): it runs on the
    engine's threads, so the averages are kept under a lock. ``cores_now`` says how many cores
    a sentence gets at the moment (:func:`free_cores_now`).
    """

    def __init__(self, cores_now: Callable[[], int], alpha: float = ALPHA) -> None:
        self._cores_now = cores_now
        self._alpha = alpha
        self._lock = threading.Lock()
        self._averages: dict[int, dict[str, float]] = {}  # cores → stage key → s per unit

    def record(self, time: StageTime) -> None:
        """Fold one measurement into its average (the cores free now are its key)."""
        if time.units <= 0 or time.seconds < 0:
            return
        per_unit = time.seconds / time.units
        cores = max(1, self._cores_now())
        key = stage_key(time)
        with self._lock:
            table = self._averages.setdefault(cores, {})
            old = table.get(key)
            table[key] = per_unit if old is None else old + self._alpha * (per_unit - old)

    def measured(self) -> dict[int, dict[str, float]]:
        """Every average, by free cores then stage key (seconds per unit)."""
        with self._lock:
            return {cores: dict(table) for cores, table in self._averages.items()}

    def costs(self, cores: int | None = None) -> StageCosts | None:
        """The costs with ``cores`` free cores (None: as many as are free now); None until the
        LM, a flow and a HiFT have each been measured."""
        cores = max(1, cores if cores is not None else self._cores_now())
        figures, estimated = _at_cores(self.measured(), cores)
        if not all(stage in figures for stage in LM_STAGES):
            return None
        parts = {}
        for part in ("flow", "hift"):
            by_format = {k.partition(".")[2]: v for k, v in figures.items() if k.startswith(part)}
            if not by_format:
                return None
            for weights in PRIOR_RATIOS[part]:
                if weights not in by_format:
                    by_format[weights] = _from_prior(part, weights, by_format)
                    estimated.add(f"{part}.{weights}")
            parts[part] = by_format
        return StageCosts(
            lm_prefill_s=figures["lm_prefill"],
            lm_token_s=figures["lm_token"],
            flow_s=parts["flow"],
            hift_s=parts["hift"],
            cores=cores,
            estimated=tuple(sorted(estimated)),
        )


def _at_cores(
    measured: Mapping[int, Mapping[str, float]], cores: int
) -> tuple[dict[str, float], set[str]]:
    """Each stage's figure with ``cores`` free cores: measured with them, else from the
    nearest core count measured, scaled up by the ratio when fewer are free now."""
    figures: dict[str, float] = {}
    estimated: set[str] = set()
    keys = {key for table in measured.values() for key in table}
    for key in keys:
        if key in measured.get(cores, {}):
            figures[key] = measured[cores][key]
            continue
        # The nearest core count that measured it; between two as near, the one with fewer.
        counts = [c for c in measured if key in measured[c]]
        nearest = min(counts, key=lambda c: (abs(c - cores), c))
        figures[key] = measured[nearest][key] * max(1.0, nearest / cores)
        estimated.add(key)
    return figures, estimated


def _from_prior(part: str, weights: str, known: Mapping[str, float]) -> float:
    """A format's cost guessed from a measured format of its part and the prior ratios."""
    ratios = PRIOR_RATIOS[part]
    other, cost = next(iter(known.items()))
    return cost * ratios[weights] / ratios[other]
