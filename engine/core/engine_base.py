"""What every engine class keeps of its load: the LM, flow and HiFT in each loaded weight format,
the prepared files the load had to prepare and the CPU choices; the load itself, one sequence
with the family's hooks; how a segment's waves become audio chunks; and its warm-up's runs, one
per weight format. Each model family's engine inherits :class:`EngineBase`."""

from __future__ import annotations

import logging
import random
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

import torch
from torch import nn

from engine.core.huge_pages import move_to_huge_pages
from engine.core.runtime import (
    audio_chunks,
    extra_weight_formats,
    loaded_format,
    pick_weights,
    prepared_loads,
    setup_cpu,
    weight_combinations,
)
from engine.core.shared_layers import share_unchanged_layers
from engine.core.start_policy import GAPLESS, estimate_speech_seconds, hold_until_gapless
from engine.core.types import AudioChunk, SynthesisOptions

if TYPE_CHECKING:
    from engine.core import cpu
    from engine.core.hift import HiFTGenerator
    from engine.core.lm_thread import LmTokens
    from engine.core.mapped_weights import MappedWeights
    from engine.core.prepared import ModelParts, PreparedLoad
    from engine.text.pronunciations import PronouncingFrontend, PronunciationCheck

_LOGGER = logging.getLogger(__name__)

FlowT = TypeVar("FlowT", bound=nn.Module)
ModuleT = TypeVar("ModuleT", bound=nn.Module)
EngineT = TypeVar("EngineT", bound="EngineBase[Any]")

# The warm-up's text and flow steps: every code path runs once, at low cost.
_WARMUP_TEXT = "Hello."
_WARMUP_STEPS = 2


def by_format(
    part: str,
    primary: tuple[str, ModuleT],
    alternates: Mapping[str, nn.Module],
    extras: Mapping[str, str],
) -> dict[str, ModuleT]:
    """One part's loaded models by weight format: ``primary`` (format, model) first, then the
    model of its extra format (``extras``), if the second load brought one (``alternates``:
    that load's models by part)."""
    loaded = dict([primary])
    if part in alternates:
        loaded[extras[part]] = cast("ModuleT", alternates[part])
    return loaded


class EngineBase(ABC, Generic[FlowT]):
    """The LM, flow and HiFT by weight format, what the load prepared and chose for this CPU."""

    # How the family's directory is prepared and loaded (its three models, its speakers).
    model_parts: ClassVar[ModelParts]
    # The family's text frontend (each family's engine sets it).
    frontend: PronouncingFrontend

    def __init__(
        self,
        flow: FlowT,
        hift: HiFTGenerator,
        *,
        lm: nn.Module,
        model_dir: Path,
        kind: str,
        threads: int | None,
        sample_rate: int,
        token_rate: int,
        speakers: Iterable[str] = (),
    ) -> None:
        self.model_dir = model_dir
        self.kind = kind  # the model's kind (engine.family: the name its directory goes by)
        self.threads = threads  # torch's threads (None: every core)
        self.sample_rate = sample_rate  # of the audio chunks, the family's
        self.token_rate = token_rate  # speech tokens a second, the family's
        # The built-in speakers (a v1-SFT model's table; voices come on top of them).
        self.speakers: list[str] = list(speakers)
        # The prepared files load() had to prepare first (e.g. "llm.int8"; empty: none).
        self.prepared_at_load: tuple[str, ...] = ()
        # What load() chose for this CPU (int8 kernels, bfloat16, thread ceiling).
        self.cpu_choices: cpu.CpuChoices | None = None
        # The LM, flow and HiFT by weight format: the primary ones, and any loaded beside them
        # (``extra_formats``) for a request to choose (SynthesisOptions.lm_weights, ...).
        self.lms: dict[str, nn.Module] = {loaded_format(lm): lm}
        self.flows: dict[str, FlowT] = {loaded_format(flow): flow}
        self.hifts: dict[str, HiFTGenerator] = {loaded_format(hift): hift}

    # --- the load: one sequence, the family's hooks ----------------------------------------

    @classmethod
    def load(
        cls: type[EngineT],
        model_dir: Path | str,
        *,
        threads: int | None = None,
        lm_int8: bool = False,
        flow_int8: bool = False,
        hift_bf16: bool = False,
        cache_dir: Path | str | None = None,
        extra_formats: Iterable[str] = (),
        lm_int4: bool = False,
        flow_bf16: bool = False,
        hift_int8: bool = False,
        **engine_options: Any,
    ) -> EngineT:
        """Load a model directory of the family in the official layout (raises ModelLoadError).

        ``lm_int8`` swaps the LM decoder's weights for int8 (faster, slightly different
        sampling distribution; see engine.core.quantize), ``lm_int4`` most of them for 4-bit
        groups (engine.core.int4; int8 where no fast int4 kernel works); ``flow_int8`` the
        flow's (an approximation for the fast profiles: faster estimator passes, less memory);
        ``flow_bf16`` runs the flow estimator's Linear layers in bfloat16 where the CPU has
        native bfloat16 matrix units (engine.core.bf16_flow; float32 elsewhere);
        ``hift_bf16`` runs HiFT's filter in bfloat16 where oneDNN supports it (another
        approximation: about twice as fast with AVX-512 BF16, half its weights' memory;
        ``hift_dtype`` on the engine says what was used); ``hift_int8`` its residual blocks'
        convolutions in int8 where they run faster than float32 (engine.core.hift_int8).
        Kernels and threads are chosen for this CPU (engine.core.cpu; the engine's
        ``cpu_choices`` say which): int8 falls back to float32 where no int8 kernel works,
        and ``threads`` is capped where more would crash.

        The models run from their prepared files (engine.core.prepared), in ``prepared/``
        beside the model files, or under ``cache_dir`` when the model directory cannot be
        written (None: ``$XDG_CACHE_HOME/cosyvoice-engine``). A file missing or out of date is
        prepared first, which takes seconds; ``prepared_at_load`` on the engine names those.

        ``extra_formats`` ("llm.int4", "flow.int8", "hift.bf16", ...) loads the LM, flow and
        HiFT in these formats too, beside the primary ones, so that each request may choose
        (``SynthesisOptions.lm_weights``, ``flow_weights``, ``hift_weights``); those this CPU
        cannot run are left out, as the primary ones fall back. A second LM holds only the
        layers its format changes: the rest are the primary LM's (engine.core.shared_layers).
        ``engine_options``: the family's own (its engine class says which).

        The sequence is every family's; the family's hooks adapt each flow for this CPU
        (:meth:`_adapt_flow`), build its text frontend (:meth:`_build_frontend`, while the int8
        layers are packed), see each flow once its weights are final (:meth:`_finish_flow`) and
        make its models (:meth:`_models_of`).
        """
        extra_formats = tuple(extra_formats)  # read twice: for the CPU and for the loads
        setup = setup_cpu(
            threads,
            lm_int8=lm_int8,
            flow_int8=flow_int8,
            hift_bf16=hift_bf16,
            lm_int4=lm_int4,
            flow_bf16=flow_bf16,
            hift_int8=hift_int8,
            extra_formats=extra_formats,
        )
        extras = extra_weight_formats(extra_formats, setup)
        start = time.perf_counter()
        model_dir = Path(model_dir)
        cache = Path(cache_dir) if cache_dir else None
        # Prepares what is missing, then packs the int8 layers in the background.
        parts = cls._parts_for(engine_options)
        with prepared_loads(model_dir, setup.formats, extras, cache, parts) as loads:
            modules = loads[0].modules()
            alternates = loads[1].assigned() if extras else {}
            flows = by_format("flow", (setup.formats.flow, modules[1]), alternates, extras)
            # Adapted here, on this thread while the int8 layers are packed, where it adds the
            # least to the load time; so is the frontend built.
            for weights, flow in flows.items():
                cls._adapt_flow(flow, weights)
            frontend = cls._build_frontend(model_dir)
        for flow in flows.values():  # the loads are finished: the weights are final
            mapped = (load.mapped_weights(flow) for load in loads)
            cls._finish_flow(flow, next((m for m in mapped if m is not None), None))
        _LOGGER.info("Loaded %s in %.2f s", model_dir, time.perf_counter() - start)
        # Every family's engine is made as (models, *, threads, frontend, **its options).
        make = cast("Callable[..., EngineT]", cls)
        models = cls._models_of(loads[0], modules)
        engine = make(models, threads=setup.threads, frontend=frontend, **engine_options)
        hift = cast("HiFTGenerator", modules[2])
        hifts = by_format("hift", (setup.formats.hift, hift), alternates, extras)
        lms = by_format("llm", (setup.formats.llm, modules[0]), alternates, extras)
        for other in list(lms.values())[1:]:
            share_unchanged_layers(modules[0], other)
        # Every token reads all of them: on huge pages it walks far fewer page tables.
        move_to_huge_pages(lms.values())
        engine._record_load(lms, cast("dict[str, Any]", flows), hifts, loads, setup.choices)
        return engine

    @classmethod
    def _parts_for(cls, engine_options: dict[str, Any]) -> ModelParts:
        """How the directory is read for a load with the family's own ``engine_options`` (e.g.
        CosyVoice3's RL-tuned LM in place of ``llm.pt``)."""
        return cls.model_parts

    @classmethod
    def _adapt_flow(cls, flow: nn.Module, weights: str) -> None:
        """Adapt a loaded flow of format ``weights`` for this CPU (e.g. layers on oneDNN)."""

    @classmethod
    def _finish_flow(cls, flow: nn.Module, mapped: MappedWeights | None) -> None:
        """A loaded flow whose weights are final; ``mapped``: those it still reads mapped from
        its prepared file (engine.core.mapped_weights; None: none)."""

    @classmethod
    def _build_frontend(cls, model_dir: Path) -> Any:
        """The family's text frontend for ``model_dir`` (every loadable family has one)."""
        raise NotImplementedError(f"{cls.__name__} cannot be loaded: it builds no frontend")

    @classmethod
    def _models_of(cls, load: PreparedLoad, modules: tuple[nn.Module, nn.Module, nn.Module]) -> Any:
        """The family's models (what its engine is made from) of a finished load."""
        raise NotImplementedError(f"{cls.__name__} cannot be loaded: it makes no models")

    def _record_load(
        self,
        lms: dict[str, nn.Module],
        flows: dict[str, FlowT],
        hifts: dict[str, HiFTGenerator],
        loads: Sequence[PreparedLoad],
        choices: cpu.CpuChoices,
    ) -> None:
        """Keep what load() made beside the models: the LMs, flows and HiFTs by format (primary
        first), the names of the files ``loads`` prepared, and ``choices``."""
        self.lms = lms
        self.flows = flows
        self.hifts = hifts
        self.prepared_at_load = tuple(name for load in loads for name in load.prepared_now)
        self.cpu_choices = choices

    @property
    def weight_formats(self) -> dict[str, tuple[str, ...]]:
        """The loaded formats of the LM, flow and HiFT, the primary one first."""
        return {"llm": tuple(self.lms), "flow": tuple(self.flows), "hift": tuple(self.hifts)}

    def _lm(self, options: SynthesisOptions) -> tuple[str, Any]:
        """(format, LM) a request runs: the one it asks for if loaded, else the primary."""
        return pick_weights(self.lms, options.lm_weights)

    @property
    def hift_dtype(self) -> str:
        """``float32``, ``bfloat16`` or ``int8``: what the primary HiFT's filter runs in."""
        _, hift = pick_weights(self.hifts, None)
        if getattr(hift, "quantized", False):  # int8 convolutions, float32 elsewhere
            return "int8"
        return str(hift.filter_dtype).removeprefix("torch.")

    def use_pronunciations(self, lines: Sequence[str]) -> list[PronunciationCheck]:
        """Say words as these ``word = entry`` lines tell from now on; how each line fares."""
        return self.frontend.use_pronunciations(lines)

    @abstractmethod
    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Yield audio for ``text``: per streamed chunk, or one chunk per segment."""

    @staticmethod
    def _seed(options: SynthesisOptions) -> int:
        """The request's seed, or a random one (each segment adds its index)."""
        return options.seed if options.seed is not None else random.randrange(2**31)

    def _released(
        self, chunks: Iterator[AudioChunk], texts: Iterable[str], options: SynthesisOptions
    ) -> Iterator[AudioChunk]:
        """``chunks`` as the request's start policy releases them: at once, or (gapless,
        streamed) held until playback of the ``texts``' expected speech cannot starve."""
        if not (options.stream and options.start_policy == GAPLESS):
            return chunks
        forced, rate = options.force_tokens, self.token_rate
        expected = sum(estimate_speech_seconds(text, forced, rate) for text in texts)
        return hold_until_gapless(chunks, expected / options.speed)

    def _segment_audio(
        self,
        waves: Generator[torch.Tensor, None, None],
        tokens: LmTokens,
        cancel: threading.Event | None,
    ) -> Iterator[AudioChunk]:
        """A segment's ``waves`` as audio chunks; the waves and the LM's ``tokens`` are closed
        (its thread stopped) however the segment ends: done, cancelled, failed or dropped."""
        try:
            yield from audio_chunks(waves, self.sample_rate, cancel)
        finally:
            waves.close()
            tokens.close()

    def _speak_in_each_format(self, speaker: str | None, force_tokens: int) -> None:
        """The warm-up's runs: a short streamed synthesis of ``force_tokens`` speech tokens in
        ``speaker``'s voice, once in each loaded weight format."""
        for lm_weights, flow_weights, hift_weights in weight_combinations(
            self.lms, self.flows, self.hifts
        ):
            options = SynthesisOptions(
                speaker=speaker,
                stream=True,
                seed=0,
                force_tokens=force_tokens,
                n_timesteps=_WARMUP_STEPS,
                lm_weights=lm_weights,
                flow_weights=flow_weights,
                hift_weights=hift_weights,
            )
            for _ in self.synthesize(_WARMUP_TEXT, options):
                pass
