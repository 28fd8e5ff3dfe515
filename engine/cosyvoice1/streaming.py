"""Speech tokens → audio, whole or in overlapping streamed chunks (CosyVoice v1 ``token2wav``).

A chunk of tokens goes through the flow (tokens → mel) and HiFT (mel → audio). Consecutive
chunks share ``TOKEN_OVERLAP`` tokens; the seams are hidden exactly as the official runtime does:

* the flow's noise and ``mu`` for the prompt frames and the 34 overlap frames are pinned to the
  previous chunk's values (flow cache);
* the first 34 mel frames are cross-faded with the 34 frames held back from the previous chunk;
* HiFT gets the previous chunk's last 20 mel frames as left context, its source signal is pinned
  over those 5120 samples, and the first 5120 output samples are cross-faded with the previous
  chunk's held-back tail.

A speed other than 1 resamples the mel in time between the fade and HiFT (engine.core.speed), chunk
by chunk as the whole mel would be.

A :class:`~engine.core.types.StreamSchedule` decides where chunks are cut: the official schedule
(hop 100, so first audio after 120 tokens) or our low-latency one (small first hop, growing hops).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.core.constants import (
    HOP,
    MEL_CACHE,
    MEL_OVERLAP,
    N_MELS,
    SAMPLE_RATE,
    SOURCE_CACHE,
    TOKEN_OVERLAP,
)
from engine.core.pacing import ChunkPacer
from engine.core.solver import EXACT_SOLVER
from engine.core.speed import MelStretcher
from engine.core.stage_times import StageListener, report, report_flow, since
from engine.core.streaming import FlowPrompt, NoiseSource, fade_in_out
from engine.core.thread_budget import ThreadBudget, apply_thread_budget, vocoder_busy
from engine.core.types import StreamSchedule

if TYPE_CHECKING:
    from engine.core.hift import HiFTGenerator
    from engine.cosyvoice1.flow import FlowModel

# float64, as upstream multiplies float32 tensors by numpy hamming windows (fixtures README §9.5).
_MEL_WINDOW = torch.from_numpy(np.hamming(2 * MEL_OVERLAP))
_SPEECH_WINDOW = torch.from_numpy(np.hamming(2 * SOURCE_CACHE))
# Below this many tokens the flow interpolates a chunk in one piece, so the 20 overlap tokens
# would not map onto exactly 34 frames; schedules must cut bigger chunks than this.
MIN_CHUNK_TOKENS = 2 * TOKEN_OVERLAP + 1


class ChunkVocoder:
    """Turns token chunks of one utterance into audio, carrying the cross-chunk state."""

    def __init__(
        self,
        flow: FlowModel,
        hift: HiFTGenerator,
        prompt: FlowPrompt,
        noise: NoiseSource,
        *,
        n_timesteps: int = 10,
        cfg_rate: float = 0.7,
        solver: str = EXACT_SOLVER,
        threads: ThreadBudget | None = None,
        speed: float = 1.0,
        on_stage: StageListener | None = None,
        weights: tuple[str, str] = ("fp32", "fp32"),
    ) -> None:
        self.flow, self.hift, self.prompt, self.noise = flow, hift, prompt, noise
        self.n_timesteps, self.cfg_rate, self.solver = n_timesteps, cfg_rate, solver
        # Told what each flow and HiFT call cost, by (flow, HiFT) weight format.
        self.on_stage, self.weights = on_stage, weights
        self.threads = threads  # applied before the flow, after each flow step and before HiFT
        self.flow_cache = torch.zeros(1, N_MELS, 0, 2)  # (1, 80, frames, [z | mu])
        self.mel_overlap: torch.Tensor | None = None  # (1, 80, 34) held back for the fade
        self.hift_mel: torch.Tensor | None = None  # (1, 80, 20) left context for HiFT
        self.hift_source: torch.Tensor | None = None  # (1, 1, 5120) pinned source samples
        self.hift_speech: torch.Tensor | None = None  # (1, 5120) held-back output tail
        # HiFT's first chunk must hold the 20 frames of context the next one starts with.
        self.stretcher = MelStretcher(speed, min_first=MEL_CACHE) if speed != 1.0 else None

    def _flow(self, tokens: torch.Tensor) -> torch.Tensor:
        prompt_frames = self.prompt.feat.shape[1]
        n_frames = prompt_frames + int(tokens.shape[1] / 50 * 22050 / HOP)
        z = self.noise.flow_noise((1, N_MELS, n_frames))
        apply_thread_budget(self.threads)

        def after_step(*_: object) -> None:
            apply_thread_budget(self.threads)

        start = time.perf_counter()
        mel, self.flow_cache = self.flow.inference(
            tokens,
            self.prompt.tokens,
            self.prompt.feat,
            self.prompt.embedding,
            self.flow_cache,
            noise=z,
            n_timesteps=self.n_timesteps,
            cfg_rate=self.cfg_rate,
            solver=self.solver,
            step_callback=after_step,
        )
        report_flow(self.on_stage, self.weights[0], since(start), n_frames, self.n_timesteps,
                    self.cfg_rate, self.solver)  # fmt: skip
        return mel

    def _hift(
        self, mel: torch.Tensor, cache_source: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        from engine.core.hift import HiftNoise

        phase, sine_noise = self.noise.hift_noise(mel.shape[2] * HOP)
        apply_thread_budget(self.threads)
        start = time.perf_counter()
        out = self.hift.inference(
            mel, cache_source, noise=HiftNoise(phase_uniform=phase, sine_noise=sine_noise)
        )
        fed_s = mel.shape[2] * HOP / SAMPLE_RATE
        report(self.on_stage, "hift", self.weights[1], since(start), fed_s)
        return out

    def chunk(self, tokens: torch.Tensor, *, finalize: bool) -> torch.Tensor:
        """Audio (1, S) for a window of tokens (1, n); ``finalize`` on the utterance's last."""
        with vocoder_busy():
            return self._chunk(tokens, finalize=finalize)

    def _chunk(self, tokens: torch.Tensor, *, finalize: bool) -> torch.Tensor:
        mel = self._flow(tokens)
        if self.mel_overlap is not None:
            mel = fade_in_out(mel, self.mel_overlap, _MEL_WINDOW)
        if not finalize:  # a chunk has more frames than the overlap (check_schedule)
            self.mel_overlap = mel[:, :, -MEL_OVERLAP:]
            mel = mel[:, :, :-MEL_OVERLAP]
        if self.stretcher is not None:
            mel = self.stretcher.push(mel, finalize=finalize)
        if self.hift_mel is not None and self.hift_source is not None:  # set together
            mel = torch.cat([self.hift_mel, mel], dim=2)
            cache_source = self.hift_source
        else:
            cache_source = torch.zeros(1, 1, 0)
        if mel.shape[2] == 0:  # the stretcher holds the first frames back
            return torch.zeros(1, 0)
        speech, source = self._hift(mel, cache_source)
        if self.hift_speech is not None:
            speech = fade_in_out(speech, self.hift_speech, _SPEECH_WINDOW)
        if finalize:
            return speech
        self.hift_mel = mel[:, :, -MEL_CACHE:]
        self.hift_source = source[:, :, -SOURCE_CACHE:]
        self.hift_speech = speech[:, -SOURCE_CACHE:]
        return speech[:, :-SOURCE_CACHE]


def hop_sizes(schedule: StreamSchedule) -> Iterator[int]:
    """The schedule's hops (new tokens per chunk): first_hop, then growing to max_hop."""
    hop = float(schedule.first_hop)
    while True:
        yield max(1, int(round(min(hop, schedule.max_hop))))
        hop *= schedule.growth


def check_schedule(schedule: StreamSchedule) -> None:
    """Reject schedules whose chunks the flow's fixed 20-token overlap handling cannot cut."""
    if schedule.overlap != TOKEN_OVERLAP:
        raise ValueError(f"stream overlap must be {TOKEN_OVERLAP} tokens (the flow hard-codes it)")
    if schedule.first_hop + schedule.overlap < MIN_CHUNK_TOKENS:
        raise ValueError(f"first_hop must be at least {MIN_CHUNK_TOKENS - TOKEN_OVERLAP} tokens")
    if schedule.max_hop < schedule.first_hop or schedule.growth < 1.0:
        raise ValueError("max_hop must be >= first_hop and growth >= 1")


def smallest_hop(schedule: StreamSchedule) -> int:
    """The smallest hop the flow can cut (its chunk holds the overlap too)."""
    return MIN_CHUNK_TOKENS - schedule.overlap


def stream_audio(
    tokens: Iterable[int],
    vocoder: ChunkVocoder,
    schedule: StreamSchedule,
    pacer: ChunkPacer | None = None,
) -> Iterator[torch.Tensor]:
    """Cut a token stream into overlapping chunks per ``schedule`` and yield their audio, at
    ``pacer``'s hops (engine.core.pacing; None: the schedule's own)."""
    check_schedule(schedule)
    pacer = pacer or ChunkPacer.fixed(hop_sizes(schedule))
    hop = pacer.hop
    window: list[int] = []
    made = 0  # tokens the LM made since the last chunk went out
    for token in tokens:
        if not window:
            pacer.started()
        window.append(token)
        made += 1
        if len(window) >= hop + schedule.overlap:
            chunk = torch.tensor([window[: hop + schedule.overlap]], dtype=torch.int64)
            audio = vocoder.chunk(chunk, finalize=False)
            pacer.delivered(audio.shape[-1], made)
            yield audio
            window, made = window[hop:], 0
            hop = pacer.next()
    if window:
        yield vocoder.chunk(torch.tensor([window], dtype=torch.int64), finalize=True)


def whole_audio(tokens: Iterable[int], vocoder: ChunkVocoder) -> torch.Tensor:
    """Non-streaming: all tokens in one flow + HiFT call."""
    return vocoder.chunk(torch.tensor([list(tokens)], dtype=torch.int64), finalize=True)
