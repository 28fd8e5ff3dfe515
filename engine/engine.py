"""CosyVoiceEngine: text in, audio chunks out, for a CosyVoice v1 model directory.

CosyVoice2 has its own engine with the same surface (engine.cosyvoice2.engine);
``engine.load_engine`` picks one by the model directory.

The engine is a plain synchronous generator API (no asyncio, no wyoming). Callers drive
``synthesize()`` from any thread; once a streamed segment's first chunk is out, the LM goes on
in a helper thread so it overlaps with the flow and vocoder (engine.lm_thread).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Generator, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.constants import SAMPLE_RATE
from engine.engine_base import EngineBase, by_format
from engine.flow_estimator import TransformerBlock
from engine.lm_thread import LmTokens
from engine.onednn_layers import use_onednn_convs, use_onednn_linears
from engine.runtime import (
    extra_weight_formats,
    pick_weights,
    prepared_loads,
    setup_cpu,
)
from engine.start_policy import GAPLESS, estimate_speech_seconds, hold_until_gapless
from engine.streaming import ChunkVocoder, FlowPrompt, GeneratorNoise, stream_audio, whole_audio
from engine.types import (
    AudioChunk,
    SynthesisOptions,
    UnknownSpeakerError,
)
from engine.voice import Voice
from engine.weights import LoadedModels

if TYPE_CHECKING:
    from engine.flow import FlowModel
    from engine.prompt.voices import CustomVoice, ScanResult, VoiceLibrary
    from engine.text.frontend import Segment, TextFrontend

_LOGGER = logging.getLogger(__name__)


def detect_model_kind(model_dir: Path) -> str:
    """'instruct', 'base' or 'sft', from the official directory names."""
    name = model_dir.name.lower()
    if "instruct" in name:
        return "instruct"
    if name.endswith("300m") or name.endswith("300m-base"):
        return "base"
    return "sft"


def _estimator_on_onednn(flow: FlowModel, weights: str) -> int:
    """Put the flow estimator's layers on oneDNN (engine.onednn_layers: faster passes): every
    estimator's convolutions, a float32 one's transformer layers too; how many were moved."""
    estimator = flow.decoder.estimator
    packed = use_onednn_convs(estimator)
    if weights != "int8":
        packed += use_onednn_linears(estimator, TransformerBlock)
    return packed


class CosyVoiceEngine(EngineBase["FlowModel"]):
    """A loaded CosyVoice v1 model directory plus the text frontend."""

    def __init__(
        self,
        models: LoadedModels,
        *,
        kind: str | None = None,
        threads: int | None = None,
        frontend: TextFrontend | None = None,
    ) -> None:
        from engine.text.frontend import TextFrontend

        super().__init__(models.flow, models.hift)
        self.models = models
        self.model_dir = models.model_dir
        self.kind = kind or detect_model_kind(models.model_dir)
        self.threads = threads
        self.sample_rate = SAMPLE_RATE
        self.speakers: list[str] = list(models.speakers)
        self.frontend = frontend or TextFrontend()
        self.custom_voices: VoiceLibrary | None = None

    @classmethod
    def load(
        cls,
        model_dir: Path | str,
        *,
        threads: int | None = None,
        kind: str | None = None,
        lm_int8: bool = False,
        flow_int8: bool = False,
        hift_bf16: bool = False,
        cache_dir: Path | str | None = None,
        extra_formats: Iterable[str] = (),
        lm_int4: bool = False,
    ) -> CosyVoiceEngine:
        """Load a model directory in the official layout (raises ModelLoadError).

        ``lm_int8`` swaps the LM decoder's weights for int8 (faster, slightly different
        sampling distribution; see engine.quantize), ``lm_int4`` for 4-bit groups (engine.int4; int8
        where no int4 kernel works); ``flow_int8`` the flow's (an approximation
        for the fast profiles: faster estimator passes, 300 MB less memory); ``hift_bf16`` runs
        HiFT's filter in bfloat16 where oneDNN supports it (another approximation: about twice
        as fast with AVX-512 BF16, half its weights' memory; ``hift_dtype`` on the engine says
        what was used). Kernels and threads are chosen for this CPU (engine.cpu; the engine's
        ``cpu_choices`` say which): int8 falls back to float32 where no int8 kernel works, and
        ``threads`` is capped where more would crash.

        The models run from their prepared files (engine.prepared), in ``prepared/`` beside the
        model files, or under ``cache_dir`` when the model directory cannot be written (None:
        ``$XDG_CACHE_HOME/cosyvoice-engine``). A file missing or out of date is prepared
        first, which takes seconds; ``prepared_at_load`` on the engine names those prepared.

        ``extra_formats`` ("flow.int8", "hift.bf16", ...) loads the flow and HiFT in these
        formats too, beside the primary ones, so that each request may choose
        (``SynthesisOptions.flow_weights``, ``hift_weights``); those this CPU cannot run are
        left out, as the primary ones fall back.
        """
        from engine.text.frontend import TextFrontend

        setup = setup_cpu(
            threads, lm_int8=lm_int8, flow_int8=flow_int8, hift_bf16=hift_bf16, lm_int4=lm_int4
        )
        threads, choices, formats = setup.threads, setup.choices, setup.formats
        extras = extra_weight_formats(extra_formats, setup)
        start = time.perf_counter()
        model_dir = Path(model_dir)
        cache = Path(cache_dir) if cache_dir else None
        # Prepares what is missing, then packs the int8 layers in the background.
        with prepared_loads(model_dir, formats, extras, cache) as loads:
            models = loads[0].models()
            alternates = loads[1].assigned() if extras else {}
            flows = by_format("flow", (formats.flow, models.flow), alternates, extras)
            # Reordered here, on this thread while the int8 layers are packed, where it adds
            # the least to the load time.
            packed = sum(_estimator_on_onednn(flow, weights) for weights, flow in flows.items())
            frontend = TextFrontend()  # built while the int8 layers are still being packed
        _LOGGER.debug("%d estimator layers on oneDNN", packed)
        _LOGGER.info("Loaded %s in %.2f s", model_dir, time.perf_counter() - start)
        engine = cls(models, kind=kind, threads=threads, frontend=frontend)
        hifts = by_format("hift", (formats.hift, models.hift), alternates, extras)
        engine._record_load(flows, hifts, loads, choices)
        return engine

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
        seed = options.seed if options.seed is not None else random.randrange(2**31)

        def chunks() -> Iterator[AudioChunk]:
            for index, segment in enumerate(segments):
                if custom is not None:
                    ids, voice = self._segment_input(custom, segment, options)
                else:
                    assert builtin is not None  # resolved above whenever custom is None
                    ids, voice = segment.token_ids, builtin
                yield from self._segment(ids, voice, options, seed + index, cancel)

        if options.stream and options.start_policy == GAPLESS:
            expected = sum(estimate_speech_seconds(s.text, options.force_tokens) for s in segments)
            yield from hold_until_gapless(chunks(), expected / options.speed)
        else:
            yield from chunks()

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
            threads=options.threads,
            speed=options.speed,
            on_stage=options.on_stage,
            weights=(flow_weights, hift_weights),
        )

        def make_tokens() -> Iterator[int]:
            return self.models.llm.generate(
                text_ids,
                voice.prompt_text_ids,
                voice.llm_prompt_tokens,
                voice.llm_embedding,
                generator=lm_generator,
                max_tokens=options.force_tokens,
            )

        # The first chunk's tokens (all tokens when not streaming) come from this thread; an LM
        # thread takes over once that chunk is out (engine.lm_thread says why).
        first_chunk = options.schedule.first_hop + options.schedule.overlap
        tokens = LmTokens(
            make_tokens,
            cancel,
            inline=first_chunk if options.stream else None,
            threads=options.threads,
            on_stage=options.on_stage,
        )

        def waves() -> Generator[torch.Tensor, None, None]:
            if options.stream:
                yield from stream_audio(tokens, vocoder, options.schedule)
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
