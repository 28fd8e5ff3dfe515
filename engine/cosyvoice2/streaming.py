"""CosyVoice2 speech tokens → audio, whole or streamed chunk by chunk (official ``token2wav``).

The flow is a :class:`~engine.cosyvoice2.flow.FlowStream`: each chunk's mel is computed once,
on that chunk's frames only. The vocoder hides the seams as the official runtime does:

* HiFT gets the previous chunk's last ``MEL_CACHE`` (8) mel frames as left context, and its
  source signal is pinned over those frames' samples (8 · 480 = 3840);
* the first 3840 output samples are cross-faded (Hamming, float64) with the 3840 held back
  from the previous chunk, and every chunk but the last holds back its own last 3840.

A speed other than 1 resamples the mel in time before HiFT (engine.core.speed), chunk by chunk as
the whole mel would be.

The official schedule: the first chunk after ``TOKEN_HOP`` (25) tokens — plus what brings the
prompt to a whole number of 25-token chunks — and the 3-token look-ahead; then hops doubling to
``MAX_TOKEN_HOP`` (100). Every hop is a whole number of attention chunks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from torch import Tensor

from engine.core.hift import HiftNoise
from engine.core.pacing import ChunkPacer
from engine.core.solver import EXACT_SOLVER
from engine.core.speed import MelStretcher, stretch_mel
from engine.core.stage_times import StageListener, report, report_flow, since
from engine.core.streaming import FlowPrompt, HiftNoiseSource, fade_in_out
from engine.core.thread_budget import ThreadBudget, apply_thread_budget, vocoder_busy
from engine.cosyvoice2.flow import ChunkCausalFlow, FlowStream

if TYPE_CHECKING:
    from engine.core.hift import HiFTGenerator

TOKEN_HOP = 25  # the official first hop: one attention chunk
MAX_TOKEN_HOP = 100  # hops double up to this (four chunks)
MEL_CACHE = 8  # mel frames of HiFT context carried to the next chunk
N_MELS = 80


class MelVocoder(Protocol):
    """Mel chunks → audio chunks of one utterance (a family's vocoder stream)."""

    def push(self, mel: Tensor, *, finalize: bool) -> Tensor:
        """Audio (1, S) for the next mel frames (1, 80, f); ``finalize`` on the last."""
        ...


class VocoderStream:
    """HiFT over the mel chunks of one utterance, carrying the cross-chunk state."""

    def __init__(
        self,
        hift: HiFTGenerator,
        noise: HiftNoiseSource,
        *,
        threads: ThreadBudget | None = None,
        on_stage: StageListener | None = None,
        weights: str = "fp32",
    ) -> None:
        self.hift, self.noise, self.threads = hift, noise, threads
        self.on_stage, self.weights = on_stage, weights  # told what each HiFT call cost
        self.source_cache = MEL_CACHE * hift.upp  # samples pinned and cross-faded
        self.window = torch.from_numpy(np.hamming(2 * self.source_cache))  # float64, as upstream
        self.mel: Tensor | None = None  # (1, 80, 8) left context
        self.source: Tensor | None = None  # (1, 1, 3840) pinned source samples
        self.speech: Tensor | None = None  # (1, 3840) held-back output tail

    def push(self, mel: Tensor, *, finalize: bool) -> Tensor:
        """Audio (1, S) for the next mel frames (1, 80, f); ``finalize`` on the last."""
        if self.mel is not None and self.source is not None:  # set together
            mel = torch.cat([self.mel, mel], dim=2)
            cache_source = self.source
        else:
            cache_source = torch.zeros(1, 1, 0)
        if mel.shape[2] == 0:
            return torch.zeros(1, 0)
        phase, sine_noise = self.noise.hift_noise(mel.shape[2] * self.hift.upp)
        apply_thread_budget(self.threads)
        start = time.perf_counter()
        speech, source = self.hift.inference(
            mel, cache_source, noise=HiftNoise(phase_uniform=phase, sine_noise=sine_noise)
        )
        fed_s = mel.shape[2] * self.hift.upp / self.hift.args.sampling_rate
        report(self.on_stage, "hift", self.weights, since(start), fed_s)
        if self.speech is not None:
            speech = fade_in_out(speech, self.speech, self.window)
        if finalize:
            return speech
        self.mel = mel[:, :, -MEL_CACHE:]
        self.source = source[:, :, -self.source_cache :]
        self.speech = speech[:, -self.source_cache :]
        return speech[:, : -self.source_cache]


class SpeechStream:
    """One utterance's tokens → audio: the incremental flow, then the vocoder.

    ``full_attention_last``: compute the last chunk as the official runtime does, with one
    non-streaming flow call over the whole utterance (every frame attends to every other) of
    which the new frames are kept. That call redoes all earlier chunks' work; by default the
    last chunk is one more incremental chunk (chunk attention, its own frames only).
    ``flow_stream``: a fork of the voice's primed prompt stream (:meth:`FlowStream.fork`) to
    go on from, instead of a fresh stream that computes the prompt's frames in its first chunk.
    ``vocoder``: the mel → audio stream (None: CosyVoice2's, HiFT with ``noise``'s draws).
    """

    def __init__(
        self,
        flow: ChunkCausalFlow,
        hift: HiFTGenerator,
        prompt: FlowPrompt,
        noise: HiftNoiseSource | None = None,
        *,
        n_timesteps: int = 10,
        cfg_rate: float | None = None,
        solver: str = EXACT_SOLVER,
        full_attention_last: bool = False,
        cache_dtype: torch.dtype | None = None,
        flow_stream: FlowStream | None = None,
        threads: ThreadBudget | None = None,
        speed: float = 1.0,
        on_stage: StageListener | None = None,
        weights: tuple[str, str] = ("fp32", "fp32"),
        vocoder: MelVocoder | None = None,
    ) -> None:
        self.prompt, self.threads = prompt, threads
        self.full_attention_last = full_attention_last
        # Told what each flow and HiFT call cost, by (flow, HiFT) weight format.
        self.on_stage, self.weights = on_stage, weights
        if flow_stream is None:
            flow_stream = flow.stream(
                prompt.tokens,
                prompt.feat,
                prompt.embedding,
                n_timesteps=n_timesteps,
                cfg_rate=cfg_rate,
                solver=solver,
                cache_dtype=cache_dtype,
            )
        self.flow: FlowStream = flow_stream
        self.vocoder = vocoder or _hift_stream(hift, noise, threads, on_stage, weights[1])
        # HiFT's first chunk must hold the frames of context the next one starts with.
        self.stretcher = MelStretcher(speed, min_first=MEL_CACHE) if speed != 1.0 else None

    @property
    def lookahead(self) -> int:
        return self.flow.flow.args.pre_lookahead_len

    def _rebalance(self, *_: object) -> None:
        apply_thread_budget(self.threads)

    def push(self, tokens: Tensor | list[int], *, finalize: bool = False) -> Tensor:
        """Audio (1, S) made computable by these new tokens (all that is left on finalize)."""
        with vocoder_busy():
            apply_thread_budget(self.threads)
            start = time.perf_counter()
            if finalize and self.full_attention_last:
                mel = self._full_attention_rest(tokens)
                computed = mel.shape[2]
            else:
                encoded = self.flow.encoded
                # The thread count is asked again after every step: a chunk takes seconds,
                # and the LM beside it may finish (and free its core) within one.
                mel = self.flow.push(tokens, finalize=finalize, step_callback=self._rebalance)
                # The frames computed, the prompt's unfinished chunk's in the first included.
                ratio = self.flow.flow.args.token_mel_ratio
                computed = (self.flow.encoded - encoded) * ratio
            report_flow(self.on_stage, self.weights[0], since(start), computed,
                        self.flow.n_timesteps, self.flow.cfg_rate or 0.0,
                        self.flow.solver)  # fmt: skip
            if self.stretcher is not None:
                mel = self.stretcher.push(mel, finalize=finalize)
            if mel.shape[2] == 0 and not finalize:
                return torch.zeros(1, 0)
            return self.vocoder.push(mel, finalize=finalize)

    def _full_attention_rest(self, tokens: Tensor | list[int]) -> Tensor:
        """The frames after those already streamed, from one non-streaming call over all."""
        stream = self.flow
        done = (stream.encoded - stream.prompt_tokens) * stream.flow.args.token_mel_ratio
        new = tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else list(tokens)
        speech_tokens = [*stream.tokens[stream.prompt_tokens :], *new]
        stream.finished = True
        mel = stream.flow.inference(
            torch.tensor([speech_tokens]),
            self.prompt.tokens,
            self.prompt.feat,
            self.prompt.embedding,
            streaming=False,
            finalize=True,
            n_timesteps=stream.n_timesteps,
            cfg_rate=stream.cfg_rate,
            solver=stream.solver,
        )
        return mel[:, :, max(0, done) :]


def _hift_stream(
    hift: HiFTGenerator,
    noise: HiftNoiseSource | None,
    threads: ThreadBudget | None,
    on_stage: StageListener | None,
    weights: str,
) -> MelVocoder:
    """CosyVoice2's vocoder stream (it needs the HiFT's draws)."""
    if noise is None:
        raise ValueError("CosyVoice2's vocoder needs a noise source")
    return VocoderStream(hift, noise, threads=threads, on_stage=on_stage, weights=weights)


def chunk_aligned(prompt: FlowPrompt, chunk: int = TOKEN_HOP, tail: int = 0) -> FlowPrompt:
    """The prompt less its first few tokens (and their mel frames), so that it ends ``tail``
    tokens into an attention chunk.

    Attention chunks are counted from the first prompt token. With ``tail`` at least the flow's
    look-ahead, the prompt holds its last whole chunk's look-ahead: a voice's prompt stream
    computes every whole prompt chunk once, and an answer's first chunk is one chunk (the
    prompt's last ``tail`` tokens and ``chunk − tail`` new ones, audio after those and the
    look-ahead) instead of the prompt's last chunk and a chunk of its own. The flow then hears
    up to 0.96 s less of the prompt's start (the LM's prompt is not affected). A prompt
    shorter than ``chunk + tail`` tokens is kept whole.
    """
    tokens = prompt.tokens.shape[1]
    if tokens < chunk + tail:
        return prompt
    drop = (tokens - tail) % chunk
    if drop == 0:
        return prompt
    ratio = prompt.feat.shape[1] // tokens
    return FlowPrompt(prompt.embedding, prompt.tokens[:, drop:], prompt.feat[:, ratio * drop :])


def official_hops(prompt_tokens: int) -> Iterator[int]:
    """The official hops: 25 tokens plus the prompt's padding to whole chunks, then 50, 100…"""
    hop = TOKEN_HOP + (-prompt_tokens) % TOKEN_HOP
    yield hop
    hop = TOKEN_HOP
    while True:
        hop = min(MAX_TOKEN_HOP, hop * 2)
        yield hop


def stream_audio(
    tokens: Iterable[int], speech: SpeechStream, hops: Iterator[int] | ChunkPacer
) -> Iterator[Tensor]:
    """Cut a token stream into chunks of ``hops`` new tokens (each once its look-ahead has
    arrived) and yield their audio; the rest when the stream ends. A :class:`ChunkPacer`
    (engine.core.pacing) is told when each chunk's audio goes out, before its next hop."""
    pacer = ChunkPacer.fixed(hops)
    hop = pacer.hop
    received: list[int] = []
    sent = 0  # tokens handed to the stream
    covered = 0  # tokens whose audio the chunks so far cover
    for token in tokens:
        if not received:
            pacer.started()
        received.append(token)
        if len(received) - covered >= hop + speech.lookahead:
            audio = speech.push(received[sent:], finalize=False)
            pacer.delivered(audio.shape[-1], len(received) - sent)
            yield audio
            sent, covered = len(received), covered + hop
            hop = pacer.next()
    yield speech.push(received[sent:], finalize=True)


def whole_audio(
    flow: ChunkCausalFlow,
    hift: HiFTGenerator,
    prompt: FlowPrompt,
    tokens: Iterable[int],
    noise: HiftNoiseSource | None = None,
    *,
    n_timesteps: int = 10,
    cfg_rate: float | None = None,
    solver: str = EXACT_SOLVER,
    speed: float = 1.0,
    on_stage: StageListener | None = None,
    weights: tuple[str, str] = ("fp32", "fp32"),
    vocoder: MelVocoder | None = None,
) -> Tensor:
    """Non-streaming, as upstream: one flow call in full attention, one HiFT call (the mel
    resampled to the speed in between); ``vocoder`` as :class:`SpeechStream`'s."""
    start = time.perf_counter()
    mel = flow.inference(
        torch.tensor([list(tokens)], dtype=torch.int64),
        prompt.tokens,
        prompt.feat,
        prompt.embedding,
        streaming=False,
        finalize=True,
        n_timesteps=n_timesteps,
        cfg_rate=cfg_rate,
        solver=solver,
    )
    frames = prompt.feat.shape[1] + mel.shape[2]
    report_flow(on_stage, weights[0], since(start), frames, n_timesteps, cfg_rate or 0.0, solver)
    vocoder = vocoder or _hift_stream(hift, noise, None, on_stage, weights[1])
    return vocoder.push(stretch_mel(mel, speed), finalize=True)
