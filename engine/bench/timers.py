"""Per-stage timers installed around the loaded models' entry points (engine code untouched).

The engine calls three model methods: ``llm.generate`` (a token generator, run in the LM thread),
``flow.inference`` (tokens → mel) and ``hift.inference`` (mel → audio). The timer replaces them
with instance attributes that call the original and record a :class:`StageEvent`. CosyVoice2's
flow is called as ``flow.encode`` then ``flow.decoder.solve``, once per streamed chunk and once
for a whole answer: the pair is one flow event, whose audio is the frames after the prompt's. In a
non-streaming request the stages run one after the other (the vocoder waits for the last token),
so their times are clean per-stage costs; in a streaming request they overlap on the two cores
once the first chunk is out (before, they run in turn: :meth:`StageTimer.first_audio_parts`).
``llm.decode_step`` is wrapped too, to note how long the KV cache each step read was.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.constants import HOP, SAMPLE_RATE
from engine.core.stage_times import StageTime

# The parts of a streamed request's first audio, in the order it waits for them.
FIRST_AUDIO_PARTS = (
    "first_audio_frontend_ms",
    "first_audio_prefill_ms",
    "first_audio_tokens_ms",
    "first_audio_flow_ms",
    "first_audio_hift_ms",
    "first_audio_other_ms",
)


@dataclass
class StageEvent:
    """One call of a stage: wall times (perf_counter s), output size and optional FLOPs."""

    stage: str  # "lm" | "flow" | "hift"
    start: float
    end: float
    audio_s: float = 0.0  # flow, hift: seconds of audio the output stands for
    token_times: list[float] = field(default_factory=list)  # lm: when each token was yielded
    flops: int = 0  # only while a FlopCounterMode is attached

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _first_tensor(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


class StageTimer:
    """Records every LM, flow and HiFT call of a loaded model set (audio seconds at
    ``sample_rate``, ``samples_per_frame`` samples a mel frame)."""

    def __init__(self, sample_rate: int = SAMPLE_RATE, samples_per_frame: int = HOP) -> None:
        self.sample_rate, self.samples_per_frame = sample_rate, samples_per_frame
        self.events: list[StageEvent] = []
        # Positions in the KV cache after each LM decode step: what that step's attention read.
        self.decode_positions: list[int] = []
        self.counter: Any = None  # a torch FlopCounterMode while counting FLOPs
        self._lock = threading.Lock()  # the LM thread records concurrently
        self.hears_hift = False  # whether HiFT's time comes to :meth:`hear` (set by install)

    def _flops(self) -> int:
        return int(self.counter.get_total_flops()) if self.counter is not None else 0

    def _record(self, event: StageEvent) -> None:
        with self._lock:
            self.events.append(event)

    def install(self, models: Any) -> None:
        """Wrap ``models.llm.generate``, the flow's entry points and ``models.hift.inference``."""
        models.llm.generate = self._wrap_generator(models.llm.generate)
        models.llm.decode_step = self._wrap_decode_step(models.llm.decode_step)
        if hasattr(models.flow, "stream"):  # CosyVoice2's causal flow
            self._wrap_causal_flow(models.flow)
        else:
            # mel (1, 80, frames) → samples_per_frame samples per frame.
            models.flow.inference = self._wrap_call(
                "flow", models.flow.inference, lambda out: self._seconds(out.shape[-1])
            )
        models.hift.inference = self._wrap_call(
            "hift", models.hift.inference, lambda out: out.shape[-1] / self.sample_rate
        )
        # A causal HiFT (CosyVoice3) streams every request without ``inference``: its engine
        # reports each piece of audio to :meth:`hear` (the FLOP count still calls ``inference``).
        self.hears_hift = hasattr(models.hift, "settle_frames")

    def hear(self, stage_time: StageTime) -> None:
        """A stage listener (``SynthesisOptions.on_stage``) that records the HiFT pieces an
        engine reports itself; the other stages are timed by the wrapped calls."""
        if stage_time.stage != "hift":
            return
        end = time.perf_counter()
        self._record(StageEvent("hift", end - stage_time.seconds, end, audio_s=stage_time.units))

    def _seconds(self, frames: int) -> float:
        return frames * self.samples_per_frame / self.sample_rate

    def _wrap_causal_flow(self, flow: Any) -> None:
        """One flow event per ``encode`` + ``decoder.solve`` pair (a thread's encode is always
        followed by its solve); its audio: the solved frames after the prompt's."""
        pending = threading.local()
        encode, solve = flow.encode, flow.decoder.solve

        @functools.wraps(encode)
        def timed_encode(*args: Any, **kwargs: Any) -> Any:
            pending.flops, pending.start = self._flops(), time.perf_counter()
            return encode(*args, **kwargs)

        @functools.wraps(solve)
        def timed_solve(z: Any, mu: Any, spks: Any, cond: Any, **kwargs: Any) -> Any:
            result = solve(z, mu, spks, cond, **kwargs)
            end = time.perf_counter()
            # cond holds the prompt's mel in the prompt frames, zeros after them.
            frames = result.shape[-1] - int((cond[0].abs().sum(dim=0) > 0).sum())
            self._record(
                StageEvent(
                    "flow",
                    pending.start,
                    end,
                    audio_s=self._seconds(frames),
                    flops=self._flops() - pending.flops,
                )
            )
            return result

        flow.encode = timed_encode
        flow.decoder.solve = timed_solve

    def _wrap_call(
        self, stage: str, method: Callable[..., Any], seconds_of: Callable[[torch.Tensor], float]
    ) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            flops = self._flops()
            start = time.perf_counter()
            result = method(*args, **kwargs)
            end = time.perf_counter()
            self._record(
                StageEvent(
                    stage,
                    start,
                    end,
                    audio_s=seconds_of(_first_tensor(result)),
                    flops=self._flops() - flops,
                )
            )
            return result

        return timed

    def _wrap_generator(self, method: Callable[..., Iterator[int]]) -> Callable[..., Iterator[int]]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Iterator[int]:
            start = time.perf_counter()
            times: list[float] = []
            try:
                for token in method(*args, **kwargs):
                    times.append(time.perf_counter())
                    yield token
            finally:  # also when the consumer stops early
                end = times[-1] if times else time.perf_counter()
                self._record(StageEvent("lm", start, end, token_times=times))

        return timed

    def _wrap_decode_step(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def counted(tokens: Any, cache: Any) -> Any:
            result = method(tokens, cache)
            with self._lock:
                self.decode_positions.append(cache.length)
            return result

        return counted

    def reset(self) -> None:
        with self._lock:
            self.events.clear()
            self.decode_positions.clear()

    def of(self, stage: str) -> list[StageEvent]:
        with self._lock:
            return [e for e in self.events if e.stage == stage]

    # --- per-stage summaries -----------------------------------------------------------------

    def lm_summary(self) -> dict[str, float | int | None]:
        """Tokens, prefill (call → first token), decode ms per token (first → last token) and
        the mean cache length of the decode steps."""
        events = [e for e in self.of("lm") if e.token_times]
        tokens = sum(len(e.token_times) for e in events)
        steps = sum(len(e.token_times) - 1 for e in events)
        decode = sum(e.token_times[-1] - e.token_times[0] for e in events)
        prefill = sum(e.token_times[0] - e.start for e in events)
        with self._lock:
            positions = list(self.decode_positions)
        return {
            "tokens": tokens,
            "lm_prefill_ms": prefill * 1000 if events else None,
            "lm_ms_per_token": decode / steps * 1000 if steps else None,
            # The mean KV-cache length a decode step read (prompt, text and the tokens so far).
            "lm_cache_positions": sum(positions) / len(positions) if positions else None,
        }

    def ms_per_audio_s(self, stage: str) -> float | None:
        events = self.of(stage)
        audio = sum(e.audio_s for e in events)
        return sum(e.seconds for e in events) / audio * 1000 if audio else None

    def first_audio_parts(self, request_start: float, first_audio: float) -> dict[str, float | int]:
        """Where a streamed request's time to first audio went, in ms (empty if unknown).

        ``request_start`` and ``first_audio`` are ``perf_counter`` times, like the events'. Call
        it once the stream is drained: the LM's event is recorded when its generator ends.

        The first chunk waits for each part in turn (the engine decodes the first chunk's tokens
        in the consumer's thread, so nothing overlaps them): request → the LM starts (the whole
        text's normalisation and tokenising, the voice), → its first token (prefill), → the flow
        starts (the rest of the chunk's tokens), the first flow call, the first HiFT call. The
        rest is ``other``: the heap trims between the stages, the fades, handing the chunk over.
        ``first_chunk_tokens`` is how many tokens the first flow call got.
        """
        lm = [e for e in self.of("lm") if e.token_times]
        flow, hift = self.of("flow"), self.of("hift")
        if not (lm and flow and hift):
            return {}
        first_lm = min(lm, key=lambda e: e.start)
        # A flow pass before the first token (a voice's prompt computed for later forks) is
        # part of getting the request ready, not of the first chunk.
        chunk_flow = [e for e in flow if e.start >= first_lm.token_times[0]]
        if not chunk_flow:
            return {}
        first_flow = min(chunk_flow, key=lambda e: e.start)
        first_hift = min(hift, key=lambda e: e.start)
        seconds = (
            first_lm.start - request_start,
            first_lm.token_times[0] - first_lm.start,
            first_flow.start - first_lm.token_times[0],
            first_flow.seconds,
            first_hift.seconds,
        )
        other = first_audio - request_start - sum(seconds)
        parts: dict[str, float | int] = {
            key: value * 1000
            for key, value in zip(FIRST_AUDIO_PARTS, (*seconds, other), strict=True)
        }
        parts["first_chunk_tokens"] = sum(t <= first_flow.start for t in first_lm.token_times)
        return parts
