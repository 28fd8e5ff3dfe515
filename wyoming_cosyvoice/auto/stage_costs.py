"""This machine's cost per stage of synthesis, measured by the engine and kept up to date.

The engine times each piece of work it does (engine.core.stage_times): the LM's way to its first
token and each token after it in each weight format, each flow call (its units: mel frames·ODE
steps·batch rows) in each format, each HiFT call (seconds of audio) in each format.
:class:`CostMeter` keeps a running fit of each (an exponentially weighted one: recent calls
count most, one odd call does not swing it) per number of free cores at the time, because a busy
box is a slower box: with a neighbour on one of two cores a stage takes up to twice as long.

The LM's figures are per unit. A flow or HiFT call costs a fixed part per pass and a part per
unit (:class:`LineCost`), fitted through the calls of streamed requests: a streamed answer's
first chunk is a small call, dearer per frame than a long one (the work per pass that does not
shrink with the chunk, and CosyVoice2's attention to the prompt's frames), so a cost per unit
fitted to big calls would promise its first audio too early. A flow call makes one pass per
ODE step and batch row, and its fit is per pass, so a profile with other steps or no guidance
is predicted from the calls of another (docs/dev/auto-profile.md has the measurement).

:meth:`CostMeter.costs` answers for the cores free now. A figure measured with another number
of free cores stands in, scaled by the ratio of cores when fewer are free now (a conservative
guess; the first request on the busier box measures the real figure), and a format that has
not run yet is guessed from a measured format of its part by the ratio measured on the
reference machine (``PRIOR_RATIOS``). Every guessed figure is named in ``estimated``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from engine.core.stage_times import StageTime

# The weight of a new measurement in its running fit. The LM reports once per sentence, the
# flow and HiFT once per chunk, so their calls weigh less: a request moves their fit about as
# much, and the fit keeps calls of several sizes (the last requests' first and last chunks).
ALPHA = 0.3
CALL_ALPHA = 0.1
# A format that has not run yet, relative to a measured format of its part (the first measured
# in this order, the reference first): the int4 LM's tokens take about 0.72 times the int8 LM's
# end to end (0.75: a guess that errs slow) and the float32 LM's about 3 times (the prefill taken
# alike), the int8 flow's passes are about 25 % faster than float32's, the bfloat16 HiFT about
# twice as fast (docs/performance.md), the int8 HiFT about 1.4 times
# (docs/dev/performance-notes.md).
PRIOR_RATIOS: Mapping[str, Mapping[str, float]] = {
    "llm": {"int8": 1.0, "int4": 0.75, "fp32": 3.0},
    "flow": {"fp32": 1.0, "int8": 0.75},
    "hift": {"fp32": 1.0, "bf16": 0.5, "int8": 0.7},
}
# The LM's stages, each timed in the LM's format (part "llm").
LM_STAGES = ("lm_prefill", "lm_token")
# Stages whose calls have a fixed part: the vocoder's, one call per chunk.
CALL_STAGES = ("flow", "hift")
# Calls whose sizes spread less than this (relative standard deviation) cannot tell a fixed
# part from a part per unit: their cost is taken as per unit alone.
MIN_SIZE_SPREAD = 0.05


def stage_key(time: StageTime) -> str:
    """``lm_prefill.int8``, ``lm_token.int4``, ``flow.int8``, ``hift.fp32``, ..."""
    return f"{time.stage}.{time.weights}" if time.weights else time.stage


def _stage(key: str) -> str:
    return key.partition(".")[0]


class LineCost(NamedTuple):
    """The seconds of one call: ``call_s`` per pass (a flow call's ODE steps × batch rows; one
    for HiFT) plus ``unit_s`` per unit of work."""

    call_s: float
    unit_s: float

    def seconds(self, units: float, passes: float = 1.0) -> float:
        """One call of ``units`` units in ``passes`` passes (none: no call, nothing to pay)."""
        return passes * self.call_s + self.unit_s * units if units > 0 else 0.0

    def scaled(self, factor: float) -> LineCost:
        return LineCost(self.call_s * factor, self.unit_s * factor)


class LmCost(NamedTuple):
    """The LM's seconds in one weight format: to its first token, and per token after it."""

    prefill_s: float
    token_s: float


@dataclass
class RunningFit:
    """An exponentially weighted least-squares line through one stage's (units, seconds)."""

    mean_x: float
    mean_y: float
    mean_xx: float
    mean_xy: float

    @classmethod
    def of(cls, units: float, seconds: float) -> RunningFit:
        return cls(units, seconds, units * units, units * seconds)

    def add(self, units: float, seconds: float, alpha: float) -> None:
        """Fold one call in: it weighs ``alpha``, everything before ``1 − alpha``."""
        self.mean_x += alpha * (units - self.mean_x)
        self.mean_y += alpha * (seconds - self.mean_y)
        self.mean_xx += alpha * (units * units - self.mean_xx)
        self.mean_xy += alpha * (units * seconds - self.mean_xy)

    def line(self, fixed_part: bool) -> LineCost:
        """The fitted cost; without ``fixed_part`` (or when the fit cannot tell one, or finds
        a negative one) the average seconds per unit."""
        per_unit = LineCost(0.0, self.mean_y / self.mean_x)
        variance = self.mean_xx - self.mean_x**2
        if not fixed_part or variance <= (MIN_SIZE_SPREAD * self.mean_x) ** 2:
            return per_unit
        slope = (self.mean_xy - self.mean_x * self.mean_y) / variance
        intercept = self.mean_y - slope * self.mean_x
        return LineCost(intercept, slope) if slope > 0 and intercept >= 0 else per_unit


@dataclass(frozen=True)
class StageCosts:
    """What each stage costs on this machine with ``cores`` free cores."""

    lm_prefill_s: Mapping[str, float]  # per text segment (the way to the first token), by format
    lm_token_s: Mapping[str, float]  # per speech token after the first, by weight format
    flow_s: Mapping[str, float]  # per mel frame·ODE step·batch row, by weight format
    hift_s: Mapping[str, float]  # per second of audio, by weight format
    cores: int
    estimated: tuple[str, ...] = ()  # the figures not measured with these cores
    # The fixed part of each flow pass (ODE step and batch row) and HiFT call, by weight
    # format (absent: none).
    flow_call_s: Mapping[str, float] = field(default_factory=dict)
    hift_call_s: Mapping[str, float] = field(default_factory=dict)

    def lm(self, weights: str) -> LmCost:
        return LmCost(self.lm_prefill_s[weights], self.lm_token_s[weights])

    def flow(self, weights: str) -> LineCost:
        return LineCost(self.flow_call_s.get(weights, 0.0), self.flow_s[weights])

    def hift(self, weights: str) -> LineCost:
        return LineCost(self.hift_call_s.get(weights, 0.0), self.hift_s[weights])

    def as_dict(self) -> dict[str, Any]:
        """For /health: milliseconds per unit, per flow pass and per HiFT call, rounded."""
        return {
            "cores": self.cores,
            "lm_prefill_ms": {k: round(v * 1000, 2) for k, v in self.lm_prefill_s.items()},
            "lm_token_ms": {k: round(v * 1000, 3) for k, v in self.lm_token_s.items()},
            "flow_us_per_frame_step": {k: round(v * 1e6, 2) for k, v in self.flow_s.items()},
            "flow_ms_per_pass": {k: round(v * 1000, 1) for k, v in self.flow_call_s.items()},
            "hift_ms_per_audio_s": {k: round(v * 1000, 1) for k, v in self.hift_s.items()},
            "hift_ms_per_call": {k: round(v * 1000, 1) for k, v in self.hift_call_s.items()},
            "estimated": list(self.estimated),
        }


def free_cores_now(threads: int | None) -> int:
    """The threads a sentence gets now: the configured count (None: every core torch uses),
    no more than the cores other processes leave free (engine.core.thread_budget)."""
    from engine.core.thread_budget import threads_now  # torch: loaded by the engine by then

    return threads_now(None) if threads is None else min(threads, threads_now(None))


class CostMeter:
    """Running fits of the engine's stage costs, per number of free cores.

    :meth:`record` is the engine's listener (``SynthesisOptions.on_stage``): it runs on the
    engine's threads, so the fits are kept under a lock. ``cores_now`` says how many cores a
    sentence gets at the moment (:func:`free_cores_now`).
    """

    def __init__(
        self, cores_now: Callable[[], int], alpha: float = ALPHA, call_alpha: float = CALL_ALPHA
    ) -> None:
        self._cores_now = cores_now
        self._alpha = alpha
        self._call_alpha = call_alpha
        self._lock = threading.Lock()
        self._fits: dict[int, dict[str, RunningFit]] = {}  # cores → stage key → fit

    def record(self, time: StageTime) -> None:
        """Fold one measurement into its fit (the cores free now are its key)."""
        if time.units <= 0 or time.seconds < 0:
            return
        cores = max(1, self._cores_now())
        key = stage_key(time)
        alpha = self._call_alpha if time.stage in CALL_STAGES else self._alpha
        # Fitted per pass: calls of other steps and guidance share one line.
        passes = max(1.0, time.passes)
        units, seconds = time.units / passes, time.seconds / passes
        with self._lock:
            table = self._fits.setdefault(cores, {})
            fit = table.get(key)
            if fit is None:
                table[key] = RunningFit.of(units, seconds)
            else:
                fit.add(units, seconds, alpha)

    def measured(self) -> dict[int, dict[str, LineCost]]:
        """Every fitted cost, by free cores then stage key (seconds per call and per unit)."""
        with self._lock:
            return {
                cores: {
                    key: fit.line(fixed_part=_stage(key) in CALL_STAGES)
                    for key, fit in table.items()
                }
                for cores, table in self._fits.items()
            }

    def costs(self, cores: int | None = None) -> StageCosts | None:
        """The costs with ``cores`` free cores (None: as many as are free now); None until the
        LM (its prefill and tokens in one format), a flow and a HiFT have each been measured."""
        cores = max(1, cores if cores is not None else self._cores_now())
        figures, estimated = _at_cores(self.measured(), cores)
        stages = {stage: _by_format(figures, stage) for stage in (*LM_STAGES, *CALL_STAGES)}
        # An LM format counts as measured once both its stages are.
        lm_formats = set(stages["lm_prefill"]) & set(stages["lm_token"])
        for stage in LM_STAGES:
            stages[stage] = {k: v for k, v in stages[stage].items() if k in lm_formats}
        if not all(stages.values()):
            return None
        for stage, by_format in stages.items():
            part = "llm" if stage in LM_STAGES else stage
            for weights in PRIOR_RATIOS[part]:
                if weights not in by_format:
                    by_format[weights] = _from_prior(part, weights, by_format)
                    estimated.add(f"{stage}.{weights}")
        return StageCosts(
            lm_prefill_s={k: v.unit_s for k, v in stages["lm_prefill"].items()},
            lm_token_s={k: v.unit_s for k, v in stages["lm_token"].items()},
            flow_s={k: v.unit_s for k, v in stages["flow"].items()},
            hift_s={k: v.unit_s for k, v in stages["hift"].items()},
            cores=cores,
            estimated=tuple(sorted(estimated)),
            flow_call_s={k: v.call_s for k, v in stages["flow"].items()},
            hift_call_s={k: v.call_s for k, v in stages["hift"].items()},
        )


def _at_cores(
    measured: Mapping[int, Mapping[str, LineCost]], cores: int
) -> tuple[dict[str, LineCost], set[str]]:
    """Each stage's cost with ``cores`` free cores: measured with them, else from the nearest
    core count measured, scaled up by the ratio when fewer are free now."""
    figures: dict[str, LineCost] = {}
    estimated: set[str] = set()
    keys = {key for table in measured.values() for key in table}
    for key in keys:
        if key in measured.get(cores, {}):
            figures[key] = measured[cores][key]
            continue
        # The nearest core count that measured it; between two as near, the one with fewer.
        counts = [c for c in measured if key in measured[c]]
        nearest = min(counts, key=lambda c: (abs(c - cores), c))
        figures[key] = measured[nearest][key].scaled(max(1.0, nearest / cores))
        estimated.add(key)
    return figures, estimated


def _by_format(figures: Mapping[str, LineCost], stage: str) -> dict[str, LineCost]:
    """``stage``'s costs by the weight format they were measured in."""
    return {
        weights: cost
        for key, cost in figures.items()
        for name, _, weights in [key.partition(".")]
        if name == stage and weights
    }


def _from_prior(part: str, weights: str, known: Mapping[str, LineCost]) -> LineCost:
    """A format's cost guessed from a measured format of its part and the prior ratios."""
    ratios = PRIOR_RATIOS[part]
    other = next((k for k in ratios if k in known), None)
    if other is None:  # only formats without a prior measured: taken as costing the same
        return next(iter(known.values()))
    return known[other].scaled(ratios[weights] / ratios[other])
