"""The ``auto`` profile: per request, the most exact settings this machine speaks in time.

The server runs ``auto`` with every weight format its fixed profiles need loaded, the LM's, the
flow's and HiFT's (settings.yaml ``auto.profiles``, the most exact first: realtime, fast,
faster, fastest). Per request it predicts, from this machine's measured cost of each stage
(:mod:`.stage_costs`) and the text's length, when each profile's first audio would play and
whether playback would stall, and picks:

1. the most exact profile whose first audio comes within ``auto.first_audio_s`` and whose
   audio never makes a real-time player wait;
2. else, among those whose first audio comes in time, the most exact one that stalls least
   (within ``STALL_TOLERANCE_S``);
3. else the one whose first audio comes soonest.

Until the costs are measured (a server without warm-up, before its first request) it runs the
most exact one. :func:`choose_profile` is that rule, a pure function; :class:`AutoProfile` is
the server's side of it: it measures the costs after the warm-up (:meth:`AutoProfile.calibrate`),
keeps them up to date from every request, logs each choice with its reason and reports it.

The prediction follows one request through its chunks (:func:`plan_chunks`, the engine's own hop
sizes), with the stages one after the other: the LM's tokens up to a chunk, then its flow and
HiFT, each at its cost in the format the profile runs it in. The LM thread beside the vocoder
shares the same cores, so that is close on a small box and errs slow on a big one. The text's
spoken length is the engine's rough estimate from its words and characters
(engine.core.start_policy).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import Any

from engine.api import Engine, StreamGeometry
from engine.core.pacing import ChunkPacer
from engine.core.stage_times import flow_passes
from engine.core.start_policy import estimate_speech_seconds
from wyoming_cosyvoice.auto.stage_costs import CostMeter, StageCosts
from wyoming_cosyvoice.config import AutoSettings, ProfileConfig

_LOGGER = logging.getLogger(__name__)

# Playback that waits less than this in all counts as not stalling, and two profiles whose
# waits differ by less stall alike: below the prediction's precision, and within what a
# player's buffer absorbs. (The low-latency schedules' first chunk holds 0.19 s of audio, so
# the next one is a little late on all but fast machines.)
STALL_TOLERANCE_S = 0.1
# The shortest speech a text is taken to need: a word or a number the estimate cannot count.
MIN_SPEECH_S = 0.5
# The speech a sentence spoken while it arrives is taken to need at least: it only starts early
# when the model has read the voice's transcript and about as much of the answer as the
# voice's recording is long (a few seconds of speech) before the sentence ended.
GROWING_SPEECH_S = 5.0
# The calibration's sentence: a spoken answer's length (the benchmark's reference sentence), so
# that the LM's way to its first token is as long as a request's.
CALIBRATION_TEXT = "您好，您咨询的iPhone15 Pro壳子有现货，支持顺丰次日达，现在下单还送钢化膜。"


@dataclass(frozen=True)
class PlannedChunk:
    """One chunk of a request as the engine will compute it."""

    tokens: int  # speech tokens the LM must have made before it can be cut
    flow_frames: float  # mel frames the flow computes for it
    hift_s: float  # seconds of mel HiFT turns into audio for it
    audio_s: float  # seconds of audio it delivers


def plan_chunks(
    profile: ProfileConfig, n_tokens: int, geometry: StreamGeometry, prompt_frames: int = 0
) -> list[PlannedChunk]:
    """The chunks of ``n_tokens`` speech tokens under ``profile`` (one when not streamed), cut
    at the schedule's own hops (a paced schedule's largest).

    ``prompt_frames``: a voice's prompt frames, which the v1 flow computes in every chunk.
    """
    hops = geometry.hops(profile.schedule)
    return list(_chunks(profile, n_tokens, geometry, hops, prompt_frames))


def _chunks(
    profile: ProfileConfig,
    n_tokens: int,
    geometry: StreamGeometry,
    hops: Iterator[int],
    prompt_frames: int,
) -> Iterator[PlannedChunk]:
    """:func:`plan_chunks`' chunks one by one, each hop taken from ``hops`` only when the
    chunk before it has been handed on (a pacer decides it then)."""
    g = geometry
    total_s = n_tokens / g.token_rate
    if not profile.stream_audio:
        frames = prompt_frames + n_tokens * g.frames_per_token
        yield PlannedChunk(n_tokens, frames, total_s, total_s)
        return
    covered = 0  # tokens whose audio the chunks so far deliver
    delivered_s = 0.0
    first = True
    tail = g.prompt_tail(profile.schedule)  # prompt tokens the first chunk computes again
    extra = g.overlap_tokens + tail  # tokens a chunk computes besides its hop
    for hop in hops:
        needed = covered + hop + max(g.overlap_tokens, g.lookahead_tokens)
        if needed > n_tokens:
            break
        hop_s = hop / g.token_rate
        chunk = PlannedChunk(
            tokens=needed,
            flow_frames=prompt_frames + (hop + extra) * g.frames_per_token,
            hift_s=hop_s + (0.0 if first else g.hift_context_s),
            audio_s=hop_s - (g.held_back_s if first else 0.0),
        )
        covered += hop
        delivered_s += chunk.audio_s
        extra = g.overlap_tokens
        first = False
        yield chunk
    rest = n_tokens - covered
    yield PlannedChunk(
        tokens=n_tokens,
        flow_frames=prompt_frames + (rest + (tail if first else 0)) * g.frames_per_token,
        hift_s=rest / g.token_rate + (0.0 if first else g.hift_context_s),
        audio_s=total_s - delivered_s,
    )


def calibration_tokens(profile: ProfileConfig, geometry: StreamGeometry) -> int:
    """The calibration request's speech tokens under ``profile``: its first streamed chunk and
    the next one (the engine's last chunk after them is a small one: the flow and HiFT calls
    of a streamed request, in three sizes for the fit of their cost)."""
    first, second = islice(geometry.hops(profile.schedule), 2)
    return first + second + max(geometry.overlap_tokens, geometry.lookahead_tokens)


# --- predicting a profile ---------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """One profile's predicted request: when audio starts, how long playback waits."""

    first_audio_s: float
    stall_s: float  # a real-time player's total wait after the first audio
    compute_s: float  # until the last chunk is made
    audio_s: float

    @property
    def rtf(self) -> float:
        """Seconds of computing per second of audio."""
        return self.compute_s / self.audio_s if self.audio_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "first_audio_s": round(self.first_audio_s, 3),
            "stall_s": round(self.stall_s, 3),
            "rtf": round(self.rtf, 3),
        }


def playback_stall(ready: Sequence[float], durations: Sequence[float]) -> float:
    """The total wait of a real-time player that starts at the first chunk: chunk ``i`` is
    ready at ``ready[i]`` and plays for ``durations[i]`` seconds."""
    if not ready:
        return 0.0
    stall, plays_until = 0.0, ready[0] + durations[0]
    for at, duration in zip(ready[1:], durations[1:], strict=True):
        if at > plays_until:
            stall += at - plays_until
            plays_until = at
        plays_until += duration
    return stall


def loaded_format(part: str, wanted: str, loaded: Mapping[str, Sequence[str]] | None) -> str:
    """The format a request asking for ``wanted`` runs in: the engine's primary one when it did
    not load that one (a CPU without the kernels for it)."""
    formats = (loaded or {}).get(part) or ()
    return wanted if not formats or wanted in formats else formats[0]


def predict(
    profile: ProfileConfig,
    costs: StageCosts,
    n_tokens: int,
    geometry: StreamGeometry,
    *,
    prompt_frames: int = 0,
    loaded: Mapping[str, Sequence[str]] | None = None,
) -> Prediction:
    """When ``profile``'s chunks of ``n_tokens`` tokens would be ready, stage after stage."""
    lm = costs.lm(loaded_format("llm", profile.lm_weights, loaded))
    flow = costs.flow(loaded_format("flow", profile.flow_weights, loaded))
    hift = costs.hift(loaded_format("hift", profile.hift_weights, loaded))
    clock, made = lm.prefill_s, 1  # the prefill gives the first token
    hops, pacer = _hops(profile, geometry, lambda: clock)
    ready, durations = [], []
    for chunk in _chunks(profile, n_tokens, geometry, hops, prompt_frames):
        new_tokens = max(0, chunk.tokens - made)
        if pacer is not None and made == 1:
            pacer.started()
        clock += new_tokens * lm.token_s
        made = max(made, chunk.tokens)
        passes = flow_passes(profile.n_timesteps, profile.cfg_rate, profile.solver)
        clock += flow.seconds(passes * chunk.flow_frames, passes) + hift.seconds(chunk.hift_s)
        ready.append(clock)
        durations.append(max(0.0, chunk.audio_s))
        if pacer is not None:
            pacer.delivered(round(durations[-1] * _PACER_RATE), new_tokens + (len(ready) == 1))
    return Prediction(
        first_audio_s=ready[0],
        stall_s=playback_stall(ready, durations),
        compute_s=ready[-1],
        audio_s=sum(durations),
    )


# Samples a second the simulated pacer counts the audio in (only their ratio matters).
_PACER_RATE = 1_000_000


def _hops(
    profile: ProfileConfig, geometry: StreamGeometry, clock: Callable[[], float]
) -> tuple[Iterator[int], ChunkPacer | None]:
    """The hops the engine will cut: the schedule's, or a paced schedule's, decided by the
    engine's own pacer as the predicted chunks are handed on at the predicted times."""
    if not (profile.stream_audio and profile.schedule.paced):
        return geometry.hops(profile.schedule), None
    pacer = geometry.pacer(profile.schedule, paced=True, sample_rate=_PACER_RATE, clock=clock)
    return pacer, pacer


# --- the choice -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Choice:
    """The profile chosen for one request, and why."""

    profile: ProfileConfig
    reason: str
    speech_s: float
    predictions: dict[str, Prediction] = field(default_factory=dict)
    cores: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.name,
            "reason": self.reason,
            "speech_s": round(self.speech_s, 2),
            "cores": self.cores,
            "predicted": {name: p.as_dict() for name, p in self.predictions.items()},
        }


def speech_seconds(text: str, force_tokens: int | None, geometry: StreamGeometry) -> float:
    """How long ``text`` will take to say (exact when the token count is forced)."""
    if force_tokens is not None:
        return force_tokens / geometry.token_rate
    return max(MIN_SPEECH_S, estimate_speech_seconds(text))


def choose_profile(
    candidates: Sequence[ProfileConfig],
    costs: StageCosts | None,
    speech_s: float,
    target_s: float,
    geometry: StreamGeometry,
    *,
    prompt_frames: int = 0,
    loaded: Mapping[str, Sequence[str]] | None = None,
) -> Choice:
    """The profile for a request of ``speech_s`` seconds of speech (module docstring: the
    rule), from ``candidates`` ordered most exact first."""
    if not candidates:
        raise ValueError("auto needs at least one profile to choose from")
    if costs is None:
        return Choice(candidates[0], "not measured yet: the most exact profile", speech_s)
    n_tokens = max(1, math.ceil(speech_s * geometry.token_rate))
    predictions = {
        c.name: predict(c, costs, n_tokens, geometry, prompt_frames=prompt_frames, loaded=loaded)
        for c in candidates
    }

    def made(profile: ProfileConfig, reason: str) -> Choice:
        return Choice(profile, reason, speech_s, predictions, costs.cores)

    in_time = [c for c in candidates if predictions[c.name].first_audio_s <= target_s]
    smooth = [c for c in in_time if predictions[c.name].stall_s <= STALL_TOLERANCE_S]
    if smooth:
        chosen = smooth[0]
        p = predictions[chosen.name]
        passed = _passed_over(candidates[: candidates.index(chosen)], predictions, target_s)
        reason = (
            f"first audio {p.first_audio_s:.2f} s within {target_s:g} s and no stall "
            f"(RTF {p.rtf:.2f}) for {speech_s:.1f} s of speech{passed}"
        )
        return made(chosen, reason)
    if in_time:
        least = min(predictions[c.name].stall_s for c in in_time)
        chosen = next(
            c for c in in_time if predictions[c.name].stall_s <= least + STALL_TOLERANCE_S
        )
        p = predictions[chosen.name]
        reason = (
            f"no profile plays {speech_s:.1f} s of speech without a stall here; the most exact "
            f"that stalls least ({p.stall_s:.2f} s, RTF {p.rtf:.2f}) with first audio "
            f"{p.first_audio_s:.2f} s within {target_s:g} s"
        )
        return made(chosen, reason)
    chosen = min(candidates, key=lambda c: predictions[c.name].first_audio_s)
    p = predictions[chosen.name]
    reason = (
        f"no profile gets first audio within {target_s:g} s here; this one is soonest "
        f"({p.first_audio_s:.2f} s, stall {p.stall_s:.2f} s) for {speech_s:.1f} s of speech"
    )
    return made(chosen, reason)


def _passed_over(
    skipped: Sequence[ProfileConfig], predictions: Mapping[str, Prediction], target_s: float
) -> str:
    """Why each more exact profile was not chosen, for the log."""
    notes = []
    for profile in skipped:
        p = predictions[profile.name]
        if p.first_audio_s > target_s:
            notes.append(f"{profile.name}: first audio {p.first_audio_s:.2f} s")
        else:
            notes.append(f"{profile.name}: stall {p.stall_s:.2f} s")
    return f" ({'; '.join(notes)})" if notes else ""


# --- the server's side ------------------------------------------------------------------------


class AutoProfile:
    """The server's ``auto`` profile: its candidates, the measured costs and the last choice."""

    def __init__(
        self, settings: AutoSettings, candidates: Sequence[ProfileConfig], meter: CostMeter
    ) -> None:
        self.settings = settings
        self.candidates = list(candidates)
        self.meter = meter
        self.last: Choice | None = None
        self._last_at: float | None = None

    def choose(
        self,
        text: str,
        *,
        engine: Engine,
        speaker: str | None,
        client: str,
        force_tokens: int | None = None,
        growing: bool = False,
    ) -> ProfileConfig:
        """The profile for a request whose known text is ``text``; logs the choice and why.
        ``growing``: that text is the start of a sentence still arriving (spoken while it
        arrives), taken to be at least :data:`GROWING_SPEECH_S` long.

        Plain arithmetic on the measured costs: runs on the event loop.
        """
        geometry = engine.stream_geometry
        prompt_frames = engine.flow_prompt_frames(speaker)
        speech_s = speech_seconds(text, force_tokens, geometry)
        if growing and force_tokens is None:
            speech_s = max(speech_s, GROWING_SPEECH_S)
        choice = choose_profile(
            self.candidates,
            self.meter.costs(),
            speech_s,
            self.settings.first_audio_s,
            geometry,
            prompt_frames=prompt_frames,
            loaded=engine.weight_formats,
        )
        self.last, self._last_at = choice, time.time()
        _LOGGER.info("Profile auto for %s: %s, %s", client, choice.profile.name, choice.reason)
        return choice.profile

    def out_of_reach(self, engine: Engine) -> list[ProfileConfig]:
        """The candidates it would choose for no text at the costs measured now (none before
        they are): even the shortest speech's first audio comes later than the target, and
        another candidate's comes sooner."""
        costs = self.meter.costs()
        if costs is None:
            return []
        geometry = engine.stream_geometry
        n_tokens = max(1, math.ceil(MIN_SPEECH_S * geometry.token_rate))
        loaded = engine.weight_formats
        first_audio = {
            c.name: predict(c, costs, n_tokens, geometry, loaded=loaded).first_audio_s
            for c in self.candidates
        }
        soonest = min(self.candidates, key=lambda c: first_audio[c.name])
        target = self.settings.first_audio_s
        return [c for c in self.candidates if first_audio[c.name] > target and c is not soonest]

    def calibrate(self, engine: Engine) -> None:
        """Measure every loaded weight format once (on the engine thread, after the warm-up):
        per format one request as requests pay it, with the first profile's settings that runs
        in it: streamed on its schedule, in the default voice, a sentence of an answer's length,
        its first two chunks' worth of speech tokens and the engine's last chunk."""
        start = time.perf_counter()
        geometry = engine.stream_geometry
        runs = 0
        for profile in self._one_per_format(engine.weight_formats):
            tokens = calibration_tokens(profile, geometry)
            options = profile.options(speaker=None, seed=0, instruct=None, force_tokens=tokens)
            try:
                for _ in engine.synthesize(
                    CALIBRATION_TEXT, replace(options, on_stage=self.meter.record)
                ):
                    pass
            except Exception as err:  # e.g. no voice yet: the first requests measure instead
                _LOGGER.info("Stage costs not measured before the first request: %s", err)
                return
            runs += 1
        costs = self.meter.costs()
        _LOGGER.info(
            "Measured the stage costs in %.1f s (%d run(s)): %s",
            time.perf_counter() - start,
            runs,
            costs.as_dict() if costs is not None else "incomplete",
        )

    def _one_per_format(self, loaded: Mapping[str, Sequence[str]] | None) -> list[ProfileConfig]:
        """The first candidate of each distinct (LM, flow, HiFT) triple of formats it runs in."""
        seen: dict[tuple[str, ...], ProfileConfig] = {}
        for profile in self.candidates:
            formats = tuple(
                loaded_format(part, weights, loaded)
                for part, weights in profile.weight_formats().items()
            )
            seen.setdefault(formats, profile)
        return list(seen.values())

    def report(self) -> dict[str, Any]:
        """For /health: the target, the candidates, the costs now and the last choice."""
        costs = self.meter.costs()
        last = None
        if self.last is not None:
            last = {**self.last.as_dict(), "at": self._last_at}
        return {
            "first_audio_target_s": self.settings.first_audio_s,
            "profiles": [c.name for c in self.candidates],
            "stage_costs": costs.as_dict() if costs is not None else None,
            "last_choice": last,
        }
