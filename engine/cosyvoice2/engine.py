"""CosyVoice2Engine: text in, 24 kHz audio chunks out, for a CosyVoice2-0.5B model directory.

The same public surface as v1's :class:`engine.cosyvoice1.engine.CosyVoiceEngine` (``load``,
``synthesize``, ``warmup``, ``speakers``, ``kind``, ``sample_rate``, custom voices), so a caller
picks the engine by the model directory (:func:`engine.family.load_engine`) and drives either.

Per text segment: the v2 frontend's ids → the speech LM (the first chunk's tokens in the
caller's thread, the rest taking turns with the vocoder or beside it: :mod:`engine.core.lm_thread`)
→ the incremental flow (:class:`~engine.cosyvoice2.flow.FlowStream`: each chunk's frames
computed once) → HiFT at 24 kHz → :class:`~engine.core.types.AudioChunk`.

v2 ships no built-in speakers: it speaks in the voice of a prompt recording. A voice is a
:class:`~engine.prompt.voices.CustomVoice` with v2 features — from a voices folder
(:meth:`CosyVoice2Engine.enable_custom_voices`) or added as a built-in one
(:meth:`CosyVoice2Engine.add_voice`). Per segment, the voice conditions the LM in zero-shot,
cross-lingual or instruct2 mode (:func:`engine.cosyvoice2.prompt.conditioning`).

Streaming schedules:

* ``low_latency`` (the default): hops are the schedule's durations (in 20 ms units, as v1's)
  ending on 25-token attention chunk boundaries. The flow prompt is cut so that it ends inside
  an attention chunk with room for the first hop (:func:`prompt_tail`,
  :func:`~engine.cosyvoice2.streaming.chunk_aligned`): every whole prompt chunk is computed
  once per voice and shared by its utterances (a primed stream, :meth:`FlowStream.fork`), and
  an answer's first chunk completes the prompt's last one — audio after the first hop (11
  tokens for the default schedule) and the 3-token look-ahead. The last chunk is computed like
  the others (chunk attention).
* ``official``: the official orchestration — the whole prompt, the first hop padded to whole
  chunks, hops 25·2ⁿ up to 100 and the last chunk in full attention — its audio equals the
  official runtime's for the same tokens and noise.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.api import Engine, PrimesVoices, SpeaksGrowingText, StreamGeometry, TakesVoices
from engine.core.engine_base import EngineBase
from engine.core.estimator_blocks import TransformerBlock
from engine.core.lm_thread import LmTokens
from engine.core.onednn_layers import use_onednn_linears
from engine.core.pacing import ChunkPacer, paces
from engine.core.runtime import (
    give_back_free_heap,
    pick_weights,
)
from engine.core.streaming import FlowPrompt, GeneratorNoise, HiftNoiseSource
from engine.core.text_feed import TextFeed
from engine.core.thread_budget import apply_thread_budget, vocoder_busy
from engine.core.types import (
    OFFICIAL_SCHEDULE,
    AudioChunk,
    StreamSchedule,
    SynthesisOptions,
    UnknownSpeakerError,
)
from engine.cosyvoice2.flow import FlowStream
from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
from engine.cosyvoice2.growing_speech import growing_tokens, whole_text
from engine.cosyvoice2.lm import BACKBONE_DIR
from engine.cosyvoice2.model_dir import PARTS, CosyVoice2Models
from engine.cosyvoice2.priming import PrimedKey, PrimedStreams
from engine.cosyvoice2.prompt import VoiceConditioning, conditioning, flow_prompt
from engine.cosyvoice2.schedule import chunk_hops, prompt_tail
from engine.cosyvoice2.streaming import (
    MEL_CACHE,
    MelVocoder,
    SpeechStream,
    VocoderStream,
    chunk_aligned,
    official_hops,
    stream_audio,
    whole_audio,
)
from engine.cosyvoice2.voices import KIND, VoicesMixin
from engine.family_facts import OfFamily, family_named

if TYPE_CHECKING:
    from engine.core.hift import HiFTGenerator
    from engine.core.prepared import PreparedLoad
    from engine.cosyvoice2.flow import CausalFlow
    from engine.prompt.voices import CustomVoice, VoiceLibrary
    from engine.text.frontend import Segment

_LOGGER = logging.getLogger(__name__)

# The HiFT noise generator's seed is the request's seed plus this (independent of the LM's).
_NOISE_SEED_OFFSET = 1_000_003


def seeded_noise(seed: int) -> HiftNoiseSource:
    """HiFT's random draws for a request of this seed (a generator of its own)."""
    return GeneratorNoise(torch.Generator().manual_seed(seed + _NOISE_SEED_OFFSET))


@dataclass(frozen=True)
class ChunkedStreamGeometry(StreamGeometry):
    """CosyVoice2's chunks: hops ending on attention chunk boundaries (:func:`chunk_hops`), the
    first completing the prompt's last chunk (:func:`prompt_tail`); the official schedule's
    hops as the official runtime cuts them."""

    def hops(self, schedule: StreamSchedule) -> Iterator[int]:
        if schedule.name == OFFICIAL_SCHEDULE.name:
            return official_hops(0)
        rate = int(self.token_rate)
        return chunk_hops(schedule, self.chunk_tokens, self.prompt_tail(schedule), rate)

    def prompt_tail(self, schedule: StreamSchedule) -> int:
        if schedule.name == OFFICIAL_SCHEDULE.name:
            return 0
        rate = int(self.token_rate)
        return prompt_tail(schedule, self.chunk_tokens, self.lookahead_tokens, rate)

    def smallest_hop(self, schedule: StreamSchedule) -> int:
        return self.chunk_tokens


class CosyVoice2Engine(
    VoicesMixin,
    EngineBase["CausalFlow"],
    OfFamily,
    SpeaksGrowingText,
    PrimesVoices,
    TakesVoices,
):
    """A loaded CosyVoice2 model directory plus its text frontend and voices (:meth:`load`'s own
    option: ``flow_cache_dtype``, what the incremental flow keeps its keys and values in: the
    default ``torch.float16`` halves that memory for a tested small deviation; None: float32,
    exact)."""

    model_parts = PARTS
    family = family_named(KIND)

    def __init__(
        self,
        models: CosyVoice2Models,
        *,
        threads: int | None = None,
        frontend: CosyVoice2TextFrontend | None = None,
        flow_cache_dtype: torch.dtype | None = torch.float16,
    ) -> None:
        super().__init__(
            models.flow,
            models.hift,
            lm=models.llm,
            model_dir=models.model_dir,
            kind=KIND,
            threads=threads,
            sample_rate=models.args.sample_rate,
            token_rate=models.args.token_rate,
        )
        self.models = models
        self.frontend: CosyVoice2TextFrontend = frontend or CosyVoice2TextFrontend(
            models.model_dir / BACKBONE_DIR
        )
        # The type the flow keeps its keys and values in between chunks (None: float32). Half
        # precision by default: half the memory, the mel within 2e-5 (docs/dev/cosyvoice2-flow.md).
        self.flow_cache_dtype = flow_cache_dtype
        # Voices offered without a voices folder (none ship with the model).
        self.voices: dict[str, CustomVoice] = {}
        self.custom_voices: VoiceLibrary | None = None
        # Where each segment's HiFT draws come from, by its seed (parity tests inject the
        # official run's draws here).
        self.hift_noise: Callable[[int], HiftNoiseSource] = seeded_noise
        # The voice's flow streams with their prompt chunks computed, by flow settings.
        self.primed = PrimedStreams()

    @classmethod
    def _adapt_flow(cls, flow: nn.Module, weights: str) -> None:
        if weights != "int8":
            # A float32 estimator's transformer layers run on oneDNN, as v1's
            # (engine.core.onednn_layers); its convolutions stay: the chunk caches read them.
            use_onednn_linears(cast("CausalFlow", flow).decoder.estimator, TransformerBlock)

    @classmethod
    def _build_frontend(cls, model_dir: Path) -> CosyVoice2TextFrontend:
        return CosyVoice2TextFrontend(model_dir / BACKBONE_DIR)

    @classmethod
    def _models_of(
        cls, load: PreparedLoad, modules: tuple[nn.Module, nn.Module, nn.Module]
    ) -> CosyVoice2Models:
        return CosyVoice2Models.of(load.model_dir, load.args, modules)

    # --- synthesis ------------------------------------------------------------------------

    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Yield audio for ``text``: per streamed chunk, or one chunk per segment."""
        options = options or SynthesisOptions()
        voice = self._voice(options.speaker)  # an unknown name fails before any work
        if options.instruct:
            self.frontend.instruct_ids(options.instruct)  # so does an empty instruction
        segments = self.frontend.segments(text, split=options.split)
        seed = self._seed(options)

        def chunks() -> Iterator[AudioChunk]:
            for index, segment in enumerate(segments):
                cond = conditioning(
                    voice,
                    self.frontend,
                    segment.text,
                    instruct=options.instruct,
                    language=options.language,
                    family=self.recipe.family,
                )
                yield from self._segment(
                    self._lm_text_ids(segment, cond), voice, cond, options, seed + index, cancel
                )

        try:
            yield from self._released(chunks(), (s.text for s in segments), options)
        finally:
            # The answer's flow state (hundreds of MB for a long sentence) is free by now: give
            # it back at once rather than hold it until the next request's first chunk.
            give_back_free_heap()

    def _lm_text_ids(self, segment: Segment, cond: VoiceConditioning) -> list[int]:
        """The ids of a segment's text as the LM reads them in ``cond``'s mode."""
        return list(segment.token_ids)

    def _kept_tokens(self, tokens: Iterator[int]) -> Iterator[int]:
        """The LM's speech tokens that are spoken (CosyVoice2: all)."""
        return tokens

    def _segment(
        self,
        text_ids: list[int],
        voice: CustomVoice,
        cond: VoiceConditioning,
        options: SynthesisOptions,
        seed: int,
        cancel: threading.Event | None,
    ) -> Iterator[AudioChunk]:
        _, llm = self._lm(options)

        def make_tokens(generator: torch.Generator) -> Iterator[int]:
            return llm.generate(
                text_ids,
                cond.prompt_text_ids,
                cond.llm_prompt_tokens,
                generator=generator,
                max_tokens=options.force_tokens,
                cancel=cancel,
            )

        return self._speak(make_tokens, voice, cond, options, seed, cancel)

    def _speak(
        self,
        make_tokens: Callable[[torch.Generator], Iterator[int]],
        voice: CustomVoice,
        cond: VoiceConditioning,
        options: SynthesisOptions,
        seed: int,
        cancel: threading.Event | None,
        *,
        lm_stage_times: bool = True,
    ) -> Iterator[AudioChunk]:
        """One segment's audio from the speech tokens of ``make_tokens(generator)``.

        ``lm_stage_times``: report the LM's cost (False when its tokens wait for text).
        """
        # Separate generators: the LM thread and the vocoder never share an RNG stream, so a
        # seed reproduces the same audio whatever the thread timing.
        lm_generator = torch.Generator().manual_seed(seed)
        speech, hops = self._speech_stream(voice, cond.flow_prompt, options, seed)
        # The first chunk's tokens (all tokens when not streaming) come from this thread; after
        # that chunk the LM takes turns with the vocoder or runs beside it (engine.core.lm_thread).
        first = hops.first() if speech is not None else 0
        inline = first + self.models.flow.args.pre_lookahead_len if speech is not None else None
        tokens = LmTokens(
            lambda: self._kept_tokens(make_tokens(lm_generator)),
            cancel,
            inline=inline,
            threads=options.threads,
            on_stage=options.on_stage if lm_stage_times else None,
            weights=self._lm(options)[0],
        )

        def waves() -> Generator[torch.Tensor, None, None]:
            if speech is not None:
                yield from stream_audio(tokens, speech, hops)
                return
            received = list(tokens)
            if received:
                flow_weights, flow = pick_weights(self.flows, options.flow_weights)
                hift_weights, hift = pick_weights(self.hifts, options.hift_weights)
                with vocoder_busy():
                    apply_thread_budget(options.threads)
                    yield whole_audio(
                        flow,
                        hift,
                        cond.flow_prompt,
                        received,
                        n_timesteps=options.n_timesteps,
                        cfg_rate=options.cfg_rate,
                        solver=options.solver,
                        speed=options.speed,
                        on_stage=options.on_stage,
                        weights=(flow_weights, hift_weights),
                        vocoder=self._mel_vocoder(hift, seed, options, hift_weights),
                    )

        yield from self._segment_audio(waves(), tokens, cancel)

    # --- a sentence whose text is still arriving ----------------------------------------------

    def synthesize_growing(
        self,
        text: TextFeed,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Yield audio for one sentence whose text is still arriving (an LLM's reply).

        The LM reads the text as it comes, interleaved with its speech (the bistream layout,
        :class:`~engine.cosyvoice2.bistream.BistreamSession`), so audio can start before the
        sentence has ended. A sentence that ends before the LM could start is spoken the usual way,
        as :meth:`synthesize` would. Not streamed (``options.stream`` off): the whole sentence is
        awaited, then spoken as :meth:`synthesize` would.
        """
        options = options or SynthesisOptions()
        if not options.stream:
            yield from self.synthesize(whole_text(text, cancel), options, cancel)
            return
        voice = self._voice(options.speaker)
        cond = conditioning(
            voice,
            self.frontend,
            text.now.text,
            instruct=options.instruct,
            language=options.language,
            family=self.recipe.family,
        )
        seed = self._seed(options)

        def make_tokens(generator: torch.Generator) -> Iterator[int]:
            return self._growing_tokens(text, cond, options, generator, cancel)

        try:
            yield from self._speak(
                make_tokens, voice, cond, options, seed, cancel, lm_stage_times=False
            )
        finally:
            give_back_free_heap()

    def _growing_tokens(
        self,
        text: TextFeed,
        cond: VoiceConditioning,
        options: SynthesisOptions,
        generator: torch.Generator,
        cancel: threading.Event | None,
    ) -> Iterator[int]:
        """The LM's speech tokens for a sentence whose text is still arriving."""
        _, llm = self._lm(options)
        return growing_tokens(llm, self.frontend, text, cond, options, generator, cancel)

    def _speech_stream(
        self,
        voice: CustomVoice,
        prompt: FlowPrompt,
        options: SynthesisOptions,
        seed: int,
    ) -> tuple[SpeechStream | None, ChunkPacer]:
        """The flow + vocoder stream of one streamed segment and its hops (None: not streamed)."""
        if not options.stream:
            return None, ChunkPacer.fixed(iter(()))
        chunk = self.models.flow.chunk_tokens
        flow_weights, flow = pick_weights(self.flows, options.flow_weights)
        hift_weights, hift = pick_weights(self.hifts, options.hift_weights)

        def speech_stream(
            prompt: FlowPrompt, *, official: bool, primed: FlowStream | None = None
        ) -> SpeechStream:
            return SpeechStream(
                flow,
                hift,
                prompt,
                n_timesteps=options.n_timesteps,
                cfg_rate=options.cfg_rate,
                solver=options.solver,
                full_attention_last=official,
                # The official schedule is for parity: its keys and values stay exact.
                cache_dtype=None if official else self.flow_cache_dtype,
                flow_stream=primed,
                threads=options.threads,
                speed=options.speed,
                on_stage=options.on_stage,
                weights=(flow_weights, hift_weights),
                vocoder=self._mel_vocoder(hift, seed, options, hift_weights),
            )

        if options.schedule.name == OFFICIAL_SCHEDULE.name:
            official = official_hops(prompt.tokens.shape[1])
            return speech_stream(prompt, official=True), ChunkPacer.fixed(official)
        aligned = self._aligned_prompt(prompt, options.schedule)
        primed = self._primed_stream(voice, aligned, options).fork()
        speech = speech_stream(aligned, official=False, primed=primed)
        hops = chunk_hops(options.schedule, chunk, aligned.tokens.shape[1], self.token_rate)
        pacer = self.stream_geometry.pacer(
            options.schedule, paced=paces(options), sample_rate=self.sample_rate, hops=hops
        )
        return speech, pacer

    def _mel_vocoder(
        self, hift: HiFTGenerator, seed: int, options: SynthesisOptions, weights: str
    ) -> MelVocoder:
        """A segment's mel → audio stream: HiFT with the seed's draws (:attr:`hift_noise`)."""
        noise = self.hift_noise(seed)
        return VocoderStream(
            hift, noise, threads=options.threads, on_stage=options.on_stage, weights=weights
        )

    def _aligned_prompt(self, prompt: FlowPrompt, schedule: StreamSchedule) -> FlowPrompt:
        """The flow prompt cut so that the answer's first chunk holds the schedule's first hop."""
        args = self.models.flow.args
        chunk = self.models.flow.chunk_tokens
        tail = prompt_tail(schedule, chunk, args.pre_lookahead_len, self.token_rate)
        return chunk_aligned(prompt, chunk, tail)

    def _primed_stream(
        self, voice: CustomVoice, prompt: FlowPrompt, options: SynthesisOptions
    ) -> FlowStream:
        """The voice's flow stream with every prompt chunk computed that the prompt alone
        allows, for these flow settings and this cut of the prompt: computed on first use, then
        shared by forks."""
        flow_weights, flow = pick_weights(self.flows, options.flow_weights)

        def prime() -> FlowStream:
            stream = flow.stream(
                prompt.tokens,
                prompt.feat,
                prompt.embedding,
                n_timesteps=options.n_timesteps,
                cfg_rate=options.cfg_rate,
                solver=options.solver,
                cache_dtype=self.flow_cache_dtype,
            )
            with vocoder_busy():
                apply_thread_budget(options.threads)
                stream.push([])
            return stream

        return self.primed.get(voice, self._primed_key(voice, prompt, options), prime)

    def _primed_key(
        self, voice: CustomVoice, prompt: FlowPrompt, options: SynthesisOptions
    ) -> PrimedKey:
        flow_weights, _ = pick_weights(self.flows, options.flow_weights)
        cut = prompt.tokens.shape[1]
        settings = (options.n_timesteps, float(options.cfg_rate))
        return (voice.name, *settings, cut, flow_weights, options.solver)

    def unprime_voice(self, options: SynthesisOptions | None = None) -> None:
        """Let go of the computed prompt chunks of ``options.speaker``'s voice (None: the
        default voice) for the flow settings of ``options``: settings no request is expected
        to use (a request that does computes them again)."""
        options = options or SynthesisOptions()
        voice = self._voice(options.speaker)
        prompt = self._aligned_prompt(flow_prompt(voice.prompt), options.schedule)
        if self.primed.drop(self._primed_key(voice, prompt, options)):
            give_back_free_heap()

    def prime_voice(self, options: SynthesisOptions | None = None) -> None:
        """Compute the prompt chunks of ``options.speaker``'s voice (None: the default voice)
        for the flow settings of ``options`` now, rather than in its first streamed request."""
        options = options or SynthesisOptions()
        voice = self._voice(options.speaker)
        prompt = self._aligned_prompt(flow_prompt(voice.prompt), options.schedule)
        with torch.inference_mode():
            self._primed_stream(voice, prompt, options)

    def warmup(self) -> None:
        """Run one short synthesis in each loaded weight format so the first real request is
        not slower than later ones (priming a voice is :meth:`prime_voice`'s)."""
        try:
            voice = self._voice(None)
        except UnknownSpeakerError:
            _LOGGER.info("No voice yet: warm-up skipped")
            return
        start = time.perf_counter()
        # Two streamed chunks and a final one, in each loaded weight format.
        tokens = 2 * self.models.flow.chunk_tokens + 10
        self._speak_in_each_format(voice.name, force_tokens=tokens)
        # The warm-up's steps are not the requests': a caller primes the settings it will use
        # (prime_voice), and a setting no request uses would hold its memory for nothing.
        self.primed.clear()
        _LOGGER.info("Warm-up took %.2f s", time.perf_counter() - start)

    def flow_prompt_frames(self, speaker: str | None) -> int:
        """Mel frames of a voice's prompt that the flow computes again in every chunk: none
        (a voice's prompt chunks are computed once, when it is primed)."""
        return 0

    @property
    def stream_geometry(self) -> ChunkedStreamGeometry:
        """How streamed chunks are cut, from the flow's and HiFT's configuration."""
        args = self.models.flow.args
        held_back_s = MEL_CACHE * self.models.hift.upp / self.sample_rate
        return ChunkedStreamGeometry(
            token_rate=self.token_rate,
            frames_per_token=args.token_mel_ratio,
            overlap_tokens=0,
            lookahead_tokens=args.pre_lookahead_len,
            chunk_tokens=self.models.flow.chunk_tokens,
            held_back_s=held_back_s,
            hift_context_s=held_back_s,
        )


if TYPE_CHECKING:  # mypy holds the class to the whole surface
    _SURFACE: type[Engine] = CosyVoice2Engine
