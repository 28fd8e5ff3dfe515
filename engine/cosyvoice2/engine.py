"""CosyVoice2Engine: text in, 24 kHz audio chunks out, for a CosyVoice2-0.5B model directory.

The same public surface as v1's :class:`engine.engine.CosyVoiceEngine` (``load``,
``synthesize``, ``warmup``, ``speakers``, ``kind``, ``sample_rate``, custom voices), so a caller
picks the engine by the model directory (:func:`engine.family.load_engine`) and drives either.

Per text segment: the v2 frontend's ids → the speech LM (the first chunk's tokens in the
caller's thread, the rest in the LM thread of :mod:`engine.lm_thread`) → the incremental flow
(:class:`~engine.cosyvoice2.flow.FlowStream`: each chunk's frames computed once) → HiFT at 24 kHz
→ :class:`~engine.types.AudioChunk`.

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
import math
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch

from engine.cosyvoice2.flow import FlowStream
from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
from engine.cosyvoice2.growing_text import GrowingTextIds
from engine.cosyvoice2.lm import BACKBONE_DIR
from engine.cosyvoice2.model_dir import PARTS, CosyVoice2Models
from engine.cosyvoice2.prompt import COSYVOICE2, VoiceConditioning, conditioning, flow_prompt
from engine.cosyvoice2.streaming import (
    FlowPrompt,
    GeneratorNoise,
    HiftNoiseSource,
    SpeechStream,
    chunk_aligned,
    official_hops,
    stream_audio,
    whole_audio,
)
from engine.engine_base import EngineBase, by_format
from engine.flow_estimator import TransformerBlock
from engine.lm_thread import LmTokens
from engine.onednn_layers import use_onednn_linears
from engine.runtime import (
    extra_weight_formats,
    give_back_free_heap,
    pick_weights,
    prepared_loads,
    setup_cpu,
)
from engine.start_policy import GAPLESS, estimate_speech_seconds, hold_until_gapless
from engine.text_feed import TextFeed
from engine.thread_budget import apply_thread_budget, vocoder_busy
from engine.types import (
    OFFICIAL_SCHEDULE,
    AudioChunk,
    StreamSchedule,
    SynthesisCancelled,
    SynthesisOptions,
    UnknownSpeakerError,
)

if TYPE_CHECKING:
    from engine.cosyvoice2.flow import CausalFlow
    from engine.prompt.voices import CustomVoice, ScanResult, VoiceLibrary

_LOGGER = logging.getLogger(__name__)

KIND = "cosyvoice2"
# Primed prompt streams are kept for the last voice used only (their flow state: 2.3 MB a mel
# frame at full size in float16 for 10 steps with guidance, so a 5 s prompt holds about 0.5 GB),
# one per flow setting it was asked in, up to this many: a server choosing among profiles per
# request (auto) then never recomputes a prompt.
PRIMED_SETTINGS = 4
# The HiFT noise generator's seed is the request's seed plus this (independent of the LM's).
_NOISE_SEED_OFFSET = 1_000_003
# How often a wait for more of a sentence's text looks at the request's cancel event.
_TEXT_POLL_S = 0.05
# A schedule's hops count 20 ms units (v1's 50 Hz speech tokens) for every family, so one
# profile asks the same audio durations of both; CosyVoice2's tokens are 40 ms.
SCHEDULE_UNITS_PER_SECOND = 50


def seeded_noise(seed: int) -> HiftNoiseSource:
    """HiFT's random draws for a request of this seed (a generator of its own)."""
    return GeneratorNoise(torch.Generator().manual_seed(seed + _NOISE_SEED_OFFSET))


def chunk_hops(
    schedule: StreamSchedule,
    chunk: int,
    prompt_tokens: int = 0,
    token_rate: int = SCHEDULE_UNITS_PER_SECOND,
) -> Iterator[int]:
    """The schedule's hops in speech tokens of ``token_rate`` per second, ending on attention
    chunk boundaries (chunks of ``chunk`` tokens counted from the first of ``prompt_tokens``):
    ``first_hop`` rounded up to a chunk, less the prompt's tokens in its unfinished last chunk;
    then growing by ``growth`` up to ``max_hop`` (rounded down, at least one chunk)."""
    scale = token_rate / SCHEDULE_UNITS_PER_SECOND
    limit = max(chunk, int(schedule.max_hop * scale) // chunk * chunk)
    hop = max(1.0, schedule.first_hop * scale)
    into_chunk = prompt_tokens % chunk
    while True:
        yield min(limit, -(-math.ceil(hop) // chunk) * chunk) - into_chunk
        into_chunk = 0
        hop *= max(1.0, schedule.growth)


def prompt_tail(schedule: StreamSchedule, chunk: int, lookahead: int, token_rate: int) -> int:
    """How many prompt tokens to leave in the prompt's last, unfinished attention chunk.

    The answer's first chunk completes that chunk, so it holds ``chunk − tail`` new tokens:
    the schedule's first hop when it fits (audio after that hop and the look-ahead), else the
    look-ahead alone stays in the prompt (the first hop then ends on a later chunk boundary).
    The prompt's last whole chunk needs its look-ahead, hence at least ``lookahead`` tokens.
    """
    first = max(1, math.ceil(schedule.first_hop * token_rate / SCHEDULE_UNITS_PER_SECOND))
    return chunk - first if first <= chunk - lookahead else lookahead


@dataclass
class _Primed:
    """A voice's flow stream with its prompt chunks computed, for one set of flow settings."""

    voice: CustomVoice
    stream: FlowStream


class CosyVoice2Engine(EngineBase["CausalFlow"]):
    """A loaded CosyVoice2 model directory plus its text frontend and voices."""

    def __init__(
        self,
        models: CosyVoice2Models,
        *,
        threads: int | None = None,
        frontend: CosyVoice2TextFrontend | None = None,
        flow_cache_dtype: torch.dtype | None = torch.float16,
    ) -> None:
        super().__init__(models.flow, models.hift)
        self.models = models
        self.model_dir = models.model_dir
        self.kind = KIND
        self.threads = threads
        self.sample_rate = models.args.sample_rate
        self.token_rate = models.args.token_rate
        self.frontend = frontend or CosyVoice2TextFrontend(models.model_dir / BACKBONE_DIR)
        # The type the flow keeps its keys and values in between chunks (None: float32). Half
        # precision by default: half the memory, the mel within 2e-5 (docs/dev/cosyvoice2-flow.md).
        self.flow_cache_dtype = flow_cache_dtype
        # Voices offered without a voices folder (none ship with the model).
        self.voices: dict[str, CustomVoice] = {}
        self.speakers: list[str] = []
        self.custom_voices: VoiceLibrary | None = None
        # Where each segment's HiFT draws come from, by its seed (parity tests inject the
        # official run's draws here).
        self.hift_noise: Callable[[int], HiftNoiseSource] = seeded_noise
        # (voice, flow steps, guidance, prompt tokens kept, flow weights) -> the voice's
        # primed stream
        self._primed: OrderedDict[tuple[str, int, float, int, str], _Primed] = OrderedDict()
        self._primed_lock = threading.Lock()

    @classmethod
    def load(
        cls,
        model_dir: Path | str,
        *,
        threads: int | None = None,
        lm_int8: bool = False,
        flow_int8: bool = False,
        hift_bf16: bool = False,
        cache_dir: Path | str | None = None,
        flow_cache_dtype: torch.dtype | None = torch.float16,
        extra_formats: Iterable[str] = (),
        lm_int4: bool = False,
    ) -> CosyVoice2Engine:
        """Load a CosyVoice2 directory in the official layout (raises ModelLoadError).

        The options are v1's (:meth:`engine.engine.CosyVoiceEngine.load`): int8 (or int4) LM
        and int8 flow layers, a bfloat16 HiFT, the threads, where prepared files go when the model
        directory cannot be written, and extra formats of the flow and HiFT for requests to
        choose. ``flow_cache_dtype``: what the incremental flow keeps its keys and values in
        (the default ``torch.float16`` halves that memory for a tested small deviation; None:
        float32, exact).
        """
        setup = setup_cpu(
            threads, lm_int8=lm_int8, flow_int8=flow_int8, hift_bf16=hift_bf16, lm_int4=lm_int4
        )
        extras = extra_weight_formats(extra_formats, setup)
        start = time.perf_counter()
        model_dir = Path(model_dir)
        cache = Path(cache_dir) if cache_dir else None
        with prepared_loads(model_dir, setup.formats, extras, cache, PARTS) as loads:
            modules = loads[0].modules()
            alternates = loads[1].assigned() if extras else {}
            primary = (setup.formats.flow, cast("CausalFlow", modules[1]))
            flows = by_format("flow", primary, alternates, extras)
            for weights, flow in flows.items():
                if weights != "int8":
                    # A float32 estimator's transformer layers run on oneDNN, as v1's
                    # (engine.onednn_layers); its convolutions stay: the chunk caches read them.
                    use_onednn_linears(flow.decoder.estimator, TransformerBlock)
            frontend = CosyVoice2TextFrontend(model_dir / BACKBONE_DIR)
        models = CosyVoice2Models.of(model_dir, loads[0].args, modules)
        _LOGGER.info("Loaded %s in %.2f s", model_dir, time.perf_counter() - start)
        engine = cls(
            models, threads=setup.threads, frontend=frontend, flow_cache_dtype=flow_cache_dtype
        )
        hifts = by_format("hift", (setup.formats.hift, models.hift), alternates, extras)
        engine._record_load(flows, hifts, loads, setup.choices)
        return engine

    # --- voices ---------------------------------------------------------------------------

    def add_voice(self, voice: CustomVoice) -> None:
        """Offer ``voice`` (v2 prompt features) as a built-in speaker, by its name."""
        if voice.family != COSYVOICE2.family:
            raise ValueError(f"voice {voice.name!r} was prepared for {voice.family}, not {KIND}")
        if voice.name not in self.voices:
            self.speakers.append(voice.name)
        self.voices[voice.name] = voice

    def enable_custom_voices(self, voices_dir: Path | str) -> ScanResult:
        """Use NAME.wav + NAME.txt voices from ``voices_dir`` (call again to re-scan)."""
        from engine.cosyvoice2.prompt import prompt_models, voice_library

        if self.custom_voices is None or self.custom_voices.voices_dir != Path(voices_dir):
            self.custom_voices = voice_library(
                voices_dir, prompt_models(self.model_dir), reserved=self.speakers
            )
        return self.custom_voices.scan()

    def _voice(self, name: str | None) -> CustomVoice:
        """The voice a request names (None: the first built-in one, else the first custom)."""
        custom = self.custom_voices
        if name:
            found = custom.get(name) if custom is not None else None
            found = found or self.voices.get(name)
            if found is not None:
                return found
            names = [*self.speakers, *(custom.names() if custom is not None else [])]
            available = ", ".join(names) or "none"
            raise UnknownSpeakerError(f"unknown voice {name!r}; available: {available}")
        if self.speakers:
            return self.voices[self.speakers[0]]
        first = custom.names()[:1] if custom is not None else []
        if first and custom is not None and (voice := custom.get(first[0])) is not None:
            return voice
        raise UnknownSpeakerError(
            f"model {self.model_dir.name} has no built-in speakers and no voice was given: "
            "it speaks in the voice of a prompt recording (a voices folder with NAME.wav + "
            "NAME.txt)"
        )

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
        seed = options.seed if options.seed is not None else random.randrange(2**31)

        def chunks() -> Iterator[AudioChunk]:
            for index, segment in enumerate(segments):
                cond = conditioning(
                    voice,
                    self.frontend,
                    segment.text,
                    instruct=options.instruct,
                    language=options.language,
                )
                yield from self._segment(
                    segment.token_ids, voice, cond, options, seed + index, cancel
                )

        try:
            if options.stream and options.start_policy == GAPLESS:
                expected = sum(
                    self._expected_seconds(s.text, options.force_tokens) for s in segments
                )
                yield from hold_until_gapless(chunks(), expected / options.speed)
            else:
                yield from chunks()
        finally:
            # The answer's flow state (hundreds of MB for a long sentence) is free by now: give
            # it back at once rather than hold it until the next request's first chunk.
            give_back_free_heap()

    def _expected_seconds(self, text: str, forced_tokens: int | None) -> float:
        if forced_tokens is not None:
            return forced_tokens / self.token_rate
        return estimate_speech_seconds(text)

    def _segment(
        self,
        text_ids: list[int],
        voice: CustomVoice,
        cond: VoiceConditioning,
        options: SynthesisOptions,
        seed: int,
        cancel: threading.Event | None,
    ) -> Iterator[AudioChunk]:
        def make_tokens(generator: torch.Generator) -> Iterator[int]:
            return self.models.llm.generate(
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
        noise = self.hift_noise(seed)
        speech, hops = self._speech_stream(voice, cond.flow_prompt, options, noise)
        # The first chunk's tokens (all tokens when not streaming) come from this thread; the LM
        # thread takes over once that chunk is out (engine.lm_thread says why).
        first = next(hops) if speech is not None else 0
        inline = first + self.models.flow.args.pre_lookahead_len if speech is not None else None
        tokens = LmTokens(
            lambda: make_tokens(lm_generator),
            cancel,
            inline=inline,
            threads=options.threads,
            on_stage=options.on_stage if lm_stage_times else None,
        )

        def waves() -> Generator[torch.Tensor, None, None]:
            if speech is not None:
                yield from stream_audio(tokens, speech, _starting_with(first, hops))
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
                        noise,
                        n_timesteps=options.n_timesteps,
                        cfg_rate=options.cfg_rate,
                        speed=options.speed,
                        on_stage=options.on_stage,
                        weights=(flow_weights, hift_weights),
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
        :class:`~engine.cosyvoice2.lm.BistreamSession`), so audio can start before the sentence
        has ended. A sentence that ends before the LM could start is spoken the usual way, as
        :meth:`synthesize` would. Not streamed (``options.stream`` off): the whole sentence is
        awaited, then spoken as :meth:`synthesize` would.
        """
        options = options or SynthesisOptions()
        if not options.stream:
            yield from self.synthesize(_whole_text(text, cancel), options, cancel)
            return
        voice = self._voice(options.speaker)
        cond = conditioning(
            voice,
            self.frontend,
            text.now.text,
            instruct=options.instruct,
            language=options.language,
        )
        seed = options.seed if options.seed is not None else random.randrange(2**31)

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
        """Speech tokens for a growing sentence: its safely cut pieces fed to a bistream
        session while it grows; the usual layout when it ends before the LM could start."""
        lm = self.models.llm
        ids = GrowingTextIds(self.frontend)
        session = lm.bistream(
            cond.prompt_text_ids,
            cond.llm_prompt_tokens,
            generator=generator,
            cancel=cancel,
            max_tokens=options.force_tokens,
        )
        seen = None
        while not (now := text.wait(seen, _TEXT_POLL_S)).final:
            _check_cancel(cancel)
            if now != seen:
                session.feed_text(ids.update(now.text))
                seen = now
            yield from session.ready_tokens()
            if session.done:
                return
        _check_cancel(cancel)
        if session.cache is None:  # the LM never started: the sentence's own layout
            segments = self.frontend.segments(now.text, split=False) if now.text.strip() else []
            if segments:
                yield from lm.generate(
                    segments[0].token_ids,
                    cond.prompt_text_ids,
                    cond.llm_prompt_tokens,
                    generator=generator,
                    max_tokens=options.force_tokens,
                    cancel=cancel,
                )
            return
        session.feed_text(ids.finish(now.text))
        session.finish()
        yield from session.tokens()

    def _speech_stream(
        self,
        voice: CustomVoice,
        prompt: FlowPrompt,
        options: SynthesisOptions,
        noise: HiftNoiseSource,
    ) -> tuple[SpeechStream | None, Iterator[int]]:
        """The flow + vocoder stream of one streamed segment and its hops (None: not streamed)."""
        if not options.stream:
            return None, iter(())
        chunk = self.models.flow.args.encoder.static_chunk_size
        flow_weights, flow = pick_weights(self.flows, options.flow_weights)
        hift_weights, hift = pick_weights(self.hifts, options.hift_weights)

        def speech_stream(
            prompt: FlowPrompt, *, official: bool, primed: FlowStream | None = None
        ) -> SpeechStream:
            return SpeechStream(
                flow,
                hift,
                prompt,
                noise,
                n_timesteps=options.n_timesteps,
                cfg_rate=options.cfg_rate,
                full_attention_last=official,
                # The official schedule is for parity: its keys and values stay exact.
                cache_dtype=None if official else self.flow_cache_dtype,
                flow_stream=primed,
                threads=options.threads,
                speed=options.speed,
                on_stage=options.on_stage,
                weights=(flow_weights, hift_weights),
            )

        if options.schedule.name == OFFICIAL_SCHEDULE.name:
            return speech_stream(prompt, official=True), official_hops(prompt.tokens.shape[1])
        aligned = self._aligned_prompt(prompt, options.schedule)
        primed = self._primed_stream(voice, aligned, options).fork()
        speech = speech_stream(aligned, official=False, primed=primed)
        return speech, chunk_hops(options.schedule, chunk, aligned.tokens.shape[1], self.token_rate)

    def _aligned_prompt(self, prompt: FlowPrompt, schedule: StreamSchedule) -> FlowPrompt:
        """The flow prompt cut so that the answer's first chunk holds the schedule's first hop."""
        args = self.models.flow.args
        chunk = args.encoder.static_chunk_size
        tail = prompt_tail(schedule, chunk, args.pre_lookahead_len, self.token_rate)
        return chunk_aligned(prompt, chunk, tail)

    def _primed_stream(
        self, voice: CustomVoice, prompt: FlowPrompt, options: SynthesisOptions
    ) -> FlowStream:
        """The voice's flow stream with every prompt chunk computed that the prompt alone
        allows, for these flow settings and this cut of the prompt: computed on first use, then
        shared by forks."""
        flow_weights, flow = pick_weights(self.flows, options.flow_weights)
        key = self._primed_key(voice, prompt, options)
        with self._primed_lock:
            primed = self._primed.get(key)
            if primed is not None and primed.voice is voice:
                self._primed.move_to_end(key)
                return primed.stream
            stream = flow.stream(
                prompt.tokens,
                prompt.feat,
                prompt.embedding,
                n_timesteps=options.n_timesteps,
                cfg_rate=options.cfg_rate,
                cache_dtype=self.flow_cache_dtype,
            )
            with vocoder_busy():
                apply_thread_budget(options.threads)
                stream.push([])
            for other in [k for k, p in self._primed.items() if p.voice is not voice]:
                del self._primed[other]  # another voice (or an older copy of this one)
            self._primed[key] = _Primed(voice, stream)
            self._primed.move_to_end(key)
            while len(self._primed) > PRIMED_SETTINGS:
                self._primed.popitem(last=False)
            return stream

    def _primed_key(
        self, voice: CustomVoice, prompt: FlowPrompt, options: SynthesisOptions
    ) -> tuple[str, int, float, int, str]:
        flow_weights, _ = pick_weights(self.flows, options.flow_weights)
        cut = prompt.tokens.shape[1]
        return (voice.name, options.n_timesteps, float(options.cfg_rate), cut, flow_weights)

    def unprime_voice(self, options: SynthesisOptions | None = None) -> None:
        """Let go of the computed prompt chunks of ``options.speaker``'s voice (None: the
        default voice) for the flow settings of ``options``: settings no request is expected
        to use (a request that does computes them again)."""
        options = options or SynthesisOptions()
        voice = self._voice(options.speaker)
        prompt = self._aligned_prompt(flow_prompt(voice.prompt), options.schedule)
        with self._primed_lock:
            dropped = self._primed.pop(self._primed_key(voice, prompt, options), None)
        if dropped is not None:
            del dropped
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
        tokens = 2 * self.models.flow.args.encoder.static_chunk_size + 10
        self._speak_in_each_format(voice.name, force_tokens=tokens)
        with self._primed_lock:
            # The warm-up's steps are not the requests': a caller primes the settings it will
            # use (prime_voice), and a setting no request uses would hold its memory for nothing.
            self._primed.clear()
        _LOGGER.info("Warm-up took %.2f s", time.perf_counter() - start)

    def flow_prompt_frames(self, speaker: str | None) -> int:
        """Mel frames of a voice's prompt that the flow computes again in every chunk: none
        (a voice's prompt chunks are computed once, when it is primed)."""
        return 0


def _whole_text(text: TextFeed, cancel: threading.Event | None) -> str:
    """The sentence once it has ended (waits; :class:`SynthesisCancelled` on ``cancel``)."""
    now = text.now
    while not now.final:
        _check_cancel(cancel)
        now = text.wait(now, _TEXT_POLL_S)
    return now.text


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise SynthesisCancelled("synthesis cancelled")


def _starting_with(first: int, rest: Iterator[int]) -> Iterator[int]:
    yield first
    yield from rest
