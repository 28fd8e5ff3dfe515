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


@dataclass(frozen=True)
class StageTime:
    """One piece of a synthesis: its stage, weight format, wall seconds and units of work."""

    stage: str
    weights: str
    seconds: float
    units: float


StageListener = Callable[[StageTime], None]


def flow_units(frames: int, n_timesteps: int, cfg_rate: float) -> float:
    """The flow's work for ``frames`` mel frames: each ODE step runs the estimator once over
    them, on two batch rows (conditioned and not) when guidance is on."""
    return float(frames * n_timesteps * (2 if cfg_rate > 0 else 1))


def report(
    listener: StageListener | None, stage: str, weights: str, seconds: float, units: float
) -> None:
    """Tell ``listener`` (if any) that ``stage`` took ``seconds`` for ``units`` of work (none:
    nothing to tell)."""
    if listener is not None and units > 0:
        listener(StageTime(stage, weights, seconds, float(units)))


def since(start: float) -> float:
    """Seconds from ``start`` (a ``time.perf_counter()`` reading) until now."""
    return time.perf_counter() - start
