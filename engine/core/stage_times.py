"""What each stage of a synthesis cost: the LM, the flow and HiFT, timed as they run.

A caller that passes a listener (``SynthesisOptions.on_stage``) hears, for each piece of work,
how long it took and how much work it was, in the unit its cost grows with:

============  ==========================================================================
stage         units
============  ==========================================================================
lm_prefill    1 per segment: the LM's way to its first speech token (text and prompt)
lm_token      speech tokens sampled after the first, in the caller's thread (the first
              chunk's, or all of a non-streamed segment's: the LM thread beside the
              vocoder shares the cores and is not timed)
flow          mel frames computed × ODE steps × batch rows (2 with classifier-free
              guidance), per call: a chunk's frames with those it computes again (v1's
              overlap and prompt, CosyVoice2's prompt's unfinished attention chunk)
hift          seconds of mel turned into audio (left context included), per call
============  ==========================================================================

``weights`` names the format the stage ran in (the flow's ``fp32``/``int8``, HiFT's
``fp32``/``bf16``; the LM's is the engine's one and left empty), so a caller can keep the
costs of each loaded format apart. The engine only measures; what the figures mean for the
next request is the caller's business.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.solver import EXACT_SOLVER, evaluation_count


@dataclass(frozen=True)
class StageTime:
    """One piece of a synthesis: its stage, weight format, wall seconds and units of work."""

    stage: str
    weights: str
    seconds: float
    units: float
    # How many times the call ran its network: a flow call's ODE steps × batch rows (its cost
    # has a part per pass: the layers' fixed work, CosyVoice2's attention to earlier frames);
    # 1 for the other stages.
    passes: float = 1.0


StageListener = Callable[[StageTime], None]


def flow_passes(n_timesteps: int, cfg_rate: float, solver: str = EXACT_SOLVER) -> int:
    """The estimator's passes in one flow call: one per solver evaluation (one per ODE step,
    two with Heun or the midpoint rule) and batch row (two rows, conditioned and not, when
    guidance is on)."""
    return evaluation_count(solver, n_timesteps) * (2 if cfg_rate > 0 else 1)


def flow_units(
    frames: float, n_timesteps: int, cfg_rate: float, solver: str = EXACT_SOLVER
) -> float:
    """The flow's work for ``frames`` mel frames: each pass runs the estimator over them."""
    return float(frames * flow_passes(n_timesteps, cfg_rate, solver))


def report(
    listener: StageListener | None,
    stage: str,
    weights: str,
    seconds: float,
    units: float,
    passes: float = 1.0,
) -> None:
    """Tell ``listener`` (if any) that ``stage`` took ``seconds`` for ``units`` of work in
    ``passes`` passes (none: nothing to tell)."""
    if listener is not None and units > 0:
        listener(StageTime(stage, weights, seconds, float(units), float(passes)))


def report_flow(
    listener: StageListener | None,
    weights: str,
    seconds: float,
    frames: float,
    n_timesteps: int,
    cfg_rate: float,
    solver: str = EXACT_SOLVER,
) -> None:
    """Tell ``listener`` about one flow call that computed ``frames`` mel frames."""
    passes = flow_passes(n_timesteps, cfg_rate, solver)
    report(listener, "flow", weights, seconds, frames * passes, passes)


def since(start: float) -> float:
    """Seconds from ``start`` (a ``time.perf_counter()`` reading) until now."""
    return time.perf_counter() - start
