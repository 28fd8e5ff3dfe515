"""Public value types of the engine: synthesis options, audio chunks and errors."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from engine.core.constants import SAMPLE_RATE
from engine.core.stage_times import StageListener


class EngineError(Exception):
    """Base class of errors the engine reports to its callers with a clear message."""


class ModelLoadError(EngineError):
    """A model directory is missing files, or a file is corrupt or does not fit the config."""


class UnknownSpeakerError(EngineError, ValueError):
    """The requested speaker is not in the model's speaker table."""


class SynthesisCancelled(EngineError):
    """The caller's cancel event was set while synthesizing."""


def raise_if_cancelled(cancel: threading.Event | None) -> None:
    """:class:`SynthesisCancelled` once the request's ``cancel`` event is set."""
    if cancel is not None and cancel.is_set():
        raise SynthesisCancelled("synthesis cancelled")


class InvalidOptionError(EngineError, ValueError):
    """A synthesis option is outside the range the engine supports."""


# The speaking speeds the engine takes: the mel is resampled in time, and past these limits the
# vocoder's output degrades audibly (smeared at 0.5, clipped syllables past 2).
MIN_SPEED = 0.5
MAX_SPEED = 2.0


@dataclass(frozen=True)
class StreamSchedule:
    """How the token stream is cut into audio chunks.

    ``official`` reproduces CosyVoice v1 (first chunk after hop+overlap = 120 tokens, fixed hop
    100). ``low_latency`` starts after ``first_hop`` tokens and grows the hop by ``growth`` per
    chunk up to ``max_hop``: the listener hears audio early, later chunks amortise the fixed
    per-chunk cost. ``paced``: each hop after the first no larger than the listener's buffer
    can cover at this machine's measured speed (engine.core.pacing), the schedule's hops the
    largest.
    """

    name: str = "low_latency"
    # 21 + the 20-token overlap = 41 tokens, the smallest first chunk the flow can cut: a
    # larger one only delays the first audio of the exact profile.
    first_hop: int = 21
    growth: float = 2.0
    max_hop: int = 100
    overlap: int = 20
    paced: bool = False


OFFICIAL_SCHEDULE = StreamSchedule(name="official", first_hop=100, growth=1.0, max_hop=100)
LOW_LATENCY_SCHEDULE = StreamSchedule()


@dataclass(frozen=True)
class SynthesisOptions:
    """Per-request options; ``None`` means the engine default."""

    speaker: str | None = None
    stream: bool = True
    schedule: StreamSchedule = field(default_factory=StreamSchedule)
    seed: int | None = None
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    # The flow ODE's solver (engine.core.solver.SOLVERS): 'euler' is the official maths.
    solver: str = "euler"
    instruct: str | None = None
    # Fixes the number of speech tokens (benchmarks: random weights never emit EOS).
    force_tokens: int | None = None
    # 'eager': release audio as soon as it exists; 'gapless': hold the first chunks until
    # playback from then on will not starve (see engine.core.start_policy).
    start_policy: str = "eager"
    # The caller's split: False when ``text`` is one sentence the caller has already split off,
    # so the engine normalises it as one segment instead of splitting it again.
    split: bool = True
    # The text's language as the caller detected it ("zh", "en", ...; None: detected here per
    # segment): chooses a custom voice's cross-lingual mode and the language tag.
    language: str | None = None
    # Asked before each LM token and flow step: torch threads from then on (None: leave the
    # calling thread's count). engine.core.thread_budget says why.
    threads: Callable[[], int] | None = field(default=None, compare=False, repr=False)
    # The loaded weight format the LM ('int8', 'int4', 'fp32'), flow ('fp32', 'int8', 'bf16')
    # and HiFT ('fp32', 'bf16', 'int8') run in; an engine loaded with several formats
    # (``extra_formats``) holds each. None, or a format the engine did not load (a CPU without
    # the kernels for it): its primary format.
    lm_weights: str | None = None
    flow_weights: str | None = None
    hift_weights: str | None = None
    # Hears what each stage cost (engine.core.stage_times), on the thread that ran it.
    on_stage: StageListener | None = field(default=None, compare=False, repr=False)
    # Speaking speed: 1.0 as the model speaks, 1.25 a quarter faster (the mel is resampled in
    # time before the vocoder, engine.core.speed); MIN_SPEED..MAX_SPEED.
    speed: float = 1.0

    def __post_init__(self) -> None:
        from engine.core.solver import SOLVERS

        if self.solver not in SOLVERS:
            raise InvalidOptionError(
                f"unknown flow solver {self.solver!r}: use one of {', '.join(SOLVERS)}"
            )
        speed = self.speed
        if isinstance(speed, bool) or not isinstance(speed, (int, float)):
            raise InvalidOptionError(f"speed must be a number, not {speed!r}")
        if not MIN_SPEED <= speed <= MAX_SPEED:  # NaN fails too
            raise InvalidOptionError(
                f"speed {speed} is out of range: use {MIN_SPEED} to {MAX_SPEED} (1.0 = normal)"
            )


@dataclass(frozen=True, eq=False)
class AudioChunk:
    """A piece of mono float32 audio in [-1, 1] at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int = SAMPLE_RATE

    @cached_property
    def pcm16(self) -> bytes:
        """16-bit little-endian PCM, as Wyoming and WAV files expect."""
        clipped = np.clip(self.samples, -1.0, 1.0)
        return (clipped * 32767.0).round().astype("<i2").tobytes()

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate
