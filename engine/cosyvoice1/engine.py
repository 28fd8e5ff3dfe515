"""CosyVoiceEngine: text in, audio chunks out, for a CosyVoice v1 model directory.

CosyVoice2 has its own engine with the same surface (engine.cosyvoice2.engine);
``engine.load_engine`` picks one by the model directory.

The engine is a plain synchronous generator API (no asyncio, no wyoming). Callers drive
``synthesize()`` from any thread; once a streamed segment's first chunk is out, the LM takes turns
with the flow and vocoder on a few cores, or goes on in a thread beside them on more
(engine.core.lm_thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.api import Engine, StreamGeometry
from engine.core.constants import HOP, MEL_CACHE, SAMPLE_RATE, TOKEN_OVERLAP, TOKEN_RATE
from engine.core.engine_base import EngineBase
from engine.core.estimator_blocks import TransformerBlock
from engine.core.lm_thread import LmTokens
from engine.core.onednn_layers import use_onednn_convs, use_onednn_linears
from engine.core.pacing import paces
from engine.core.runtime import (
    pick_weights,
)
from engine.core.streaming import FlowPrompt, GeneratorNoise
from engine.core.types import (
    AudioChunk,
    StreamSchedule,
    SynthesisOptions,
    UnknownSpeakerError,
)
from engine.core.voice import Voice
from engine.cosyvoice1.model_dir import PARTS, LoadedModels
from engine.cosyvoice1.streaming import (
    ChunkVocoder,
    hop_sizes,
    smallest_hop,
    stream_audio,
    whole_audio,
)
from engine.family_facts import OfFamily, detect_model_kind, family_named

if TYPE_CHECKING:
    from engine.core.prepared import PreparedLoad
    from engine.cosyvoice1.flow import FlowModel
    from engine.prompt.voices import CustomVoice, ScanResult, VoiceLibrary
    from engine.text.frontend import Segment, TextFrontend

_LOGGER = logging.getLogger(__name__)


def _estimator_on_onednn(flow: FlowModel, weights: str) -> int:
    """Put the flow estimator's layers on oneDNN (engine.core.onednn_layers: faster passes): every
    estimator's convolutions, a float32 one's transformer layers too; how many were moved."""
    estimator = flow.decoder.estimator
    packed = use_onednn_convs(estimator)
    if weights != "int8":
        packed += use_onednn_linears(estimator, TransformerBlock)
    return packed


@dataclass(frozen=True)
class V1StreamGeometry(StreamGeometry):
    """v1's chunks: the schedule's hops anywhere, each computing the last 20 tokens again."""

    def hops(self, schedule: StreamSchedule) -> Iterator[int]:
        return hop_sizes(schedule)

    def prompt_tail(self, schedule: StreamSchedule) -> int:
        return 0

    def smallest_hop(self, schedule: StreamSchedule) -> int:
        return smallest_hop(schedule)


STREAM_GEOMETRY = V1StreamGeometry(
    token_rate=TOKEN_RATE,
    frames_per_token=SAMPLE_RATE / HOP / TOKEN_RATE,
    overlap_tokens=TOKEN_OVERLAP,
    lookahead_tokens=0,
    chunk_tokens=1,
    held_back_s=MEL_CACHE * HOP / SAMPLE_RATE,
    hift_context_s=MEL_CACHE * HOP / SAMPLE_RATE,
)


class CosyVoiceEngine(EngineBase["FlowModel"], OfFamily):
    """A loaded CosyVoice v1 model directory plus the text frontend (:meth:`load`'s own
    option: ``kind``, the model kind when the directory's name does not tell it)."""

    model_parts = PARTS
    family = family_named("cosyvoice")
    stream_geometry = STREAM_GEOMETRY

    def __init__(
        self,
        models: LoadedModels,
        *,
        kind: str | None = None,
        threads: int | None = None,
        frontend: TextFrontend | None = None,
    ) -> None:
        from engine.text.frontend import TextFrontend

        super().__init__(
            models.flow,
            models.hift,
            lm=models.llm,
            model_dir=models.model_dir,
            kind=kind or detect_model_kind(models.model_dir),
            threads=threads,
            sample_rate=SAMPLE_RATE,
            token_rate=TOKEN_RATE,
            speakers=models.speakers,
        )
        self.models = models
        self.frontend: TextFrontend = frontend or TextFrontend()
        self.custom_voices: VoiceLibrary | None = None

    @classmethod
    def _adapt_flow(cls, flow: nn.Module, weights: str) -> None:
        packed = _estimator_on_onednn(cast("FlowModel", flow), weights)
        _LOGGER.debug("%d estimator layers on oneDNN (%s flow)", packed, weights)

    @classmethod
    def _build_frontend(cls, model_dir: Path) -> TextFrontend:
        from engine.text.frontend import TextFrontend

        return TextFrontend()

    @classmethod
    def _models_of(
        cls, load: PreparedLoad, modules: tuple[nn.Module, nn.Module, nn.Module]
    ) -> LoadedModels:
        return LoadedModels.of(load.model_dir, load.args, modules, load.speakers)

    # --- voices ---------------------------------------------------------------------------

    def enable_custom_voices(self, voices_dir: Path | str) -> ScanResult:
        """Use NAME.wav + NAME.txt voices from ``voices_dir`` (call again to re-scan)."""
        from engine.prompt.onnx_models import PromptModels
        from engine.prompt.voices import VoiceLibrary

        if self.custom_voices is None or self.custom_voices.voices_dir != Path(voices_dir):
            models = PromptModels.from_model_dir(self.model_dir, threads=1)
            self.custom_voices = VoiceLibrary(voices_dir, models, reserved=self.speakers)
        return self.custom_voices.scan()

    def _custom_voice(self, name: str | None) -> CustomVoice | None:
        if self.custom_voices is None or not name:
            return None
        return self.custom_voices.get(name)

    def _segment_input(
        self, custom: CustomVoice, segment: Segment, options: SynthesisOptions
    ) -> tuple[list[int], Voice]:
        """Zero-shot or cross-lingual conditioning, chosen per segment by its language."""
        from engine.prompt.voices import to_engine_voice

        plan = to_engine_voice(
            custom,
            self.frontend,
            segment.text,
            kind=self.kind,
            instruct=options.instruct,
            text_ids=segment.token_ids,
            language=options.language,
        )
        return plan.text_ids or segment.token_ids, plan.voice

    def voice(self, speaker: str | None, instruct: str | None = None) -> Voice:
        """The conditioning for a built-in speaker (and an optional instruct text)."""
        if not self.speakers:
            raise UnknownSpeakerError(f"model {self.model_dir.name} has no built-in speakers")
        name = speaker or self.speakers[0]
        if name not in self.models.speakers:
            raise UnknownSpeakerError(
                f"unknown speaker {name!r}; available: {', '.join(self.speakers)}"
            )
        embedding = self.models.speakers[name].reshape(1, -1)
        if instruct and self.kind == "instruct":
            # Official instruct mode: the LM sees the instruction instead of the speaker.
            return Voice(
                name,
                torch.zeros(0, embedding.shape[1]),
                embedding,
                prompt_text_ids=self.frontend.instruct_ids(instruct),
            )
        return Voice(name, embedding, embedding)

    # --- synthesis ------------------------------------------------------------------------

    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Yield audio for ``text``: per streamed chunk, or one chunk per segment."""
        options = options or SynthesisOptions()
        custom = self._custom_voice(options.speaker)
        # Built-in voices are resolved first so an unknown name fails before any work.
        builtin = None if custom is not None else self.voice(options.speaker, options.instruct)
        segments = self.frontend.segments(text, split=options.split, language=options.language)
        seed = self._seed(options)

        def chunks() -> Iterator[AudioChunk]:
            for index, segment in enumerate(segments):
                if custom is not None:
                    ids, voice = self._segment_input(custom, segment, options)
                else:
                    assert builtin is not None  # resolved above whenever custom is None
                    ids, voice = segment.token_ids, builtin
                yield from self._segment(ids, voice, options, seed + index, cancel)

        yield from self._released(chunks(), (s.text for s in segments), options)

    def _segment(
        self,
        text_ids: list[int],
        voice: Voice,
        options: SynthesisOptions,
        seed: int,
        cancel: threading.Event | None,
    ) -> Iterator[AudioChunk]:
        # Separate generators: the LM thread and the vocoder never share an RNG stream, so a
        # seed reproduces the same audio whatever the thread timing.
        lm_generator = torch.Generator().manual_seed(seed)
        noise_generator = torch.Generator().manual_seed(seed + 1_000_003)
        flow_prompt = voice.flow_prompt or FlowPrompt(voice.flow_embedding)
        flow_weights, flow = pick_weights(self.flows, options.flow_weights)
        hift_weights, hift = pick_weights(self.hifts, options.hift_weights)
        vocoder = ChunkVocoder(
            flow,
            hift,
            flow_prompt,
            GeneratorNoise(noise_generator),
            n_timesteps=options.n_timesteps,
            cfg_rate=options.cfg_rate,
            solver=options.solver,
            threads=options.threads,
            speed=options.speed,
            on_stage=options.on_stage,
            weights=(flow_weights, hift_weights),
        )

        lm_weights, llm = self._lm(options)

        def make_tokens() -> Iterator[int]:
            return llm.generate(
                text_ids,
                voice.prompt_text_ids,
                voice.llm_prompt_tokens,
                voice.llm_embedding,
                generator=lm_generator,
                max_tokens=options.force_tokens,
            )

        # The first chunk's tokens (all tokens when not streaming) come from this thread; an LM
        # thread takes over once that chunk is out (engine.core.lm_thread says why).
        first_chunk = options.schedule.first_hop + options.schedule.overlap
        tokens = LmTokens(
            make_tokens,
            cancel,
            inline=first_chunk if options.stream else None,
            threads=options.threads,
            on_stage=options.on_stage,
            weights=lm_weights,
        )

        def waves() -> Generator[torch.Tensor, None, None]:
            if options.stream:
                pacer = STREAM_GEOMETRY.pacer(
                    options.schedule, paced=paces(options), sample_rate=SAMPLE_RATE
                )
                yield from stream_audio(tokens, vocoder, options.schedule, pacer)
            else:
                yield whole_audio(tokens, vocoder)

        yield from self._segment_audio(waves(), tokens, cancel)

    def warmup(self) -> None:
        """Run one short synthesis so the first real request is not slower than later ones."""
        if not self.speakers:
            _LOGGER.info("No built-in speaker: warm-up skipped")
            return
        start = time.perf_counter()
        # One streamed chunk plus a final one, in each loaded weight format.
        self._speak_in_each_format(None, force_tokens=50)
        _LOGGER.info("Warm-up took %.2f s", time.perf_counter() - start)

    def flow_prompt_frames(self, speaker: str | None) -> int:
        """Mel frames of the voice's prompt, which the flow computes again in every chunk (a
        custom voice's recording; 0 for a built-in speaker)."""
        custom = self._custom_voice(speaker)
        return 0 if custom is None else int(custom.prompt.speech_feat.shape[1])


if TYPE_CHECKING:  # mypy holds the class to the whole surface
    _SURFACE: type[Engine] = CosyVoiceEngine
