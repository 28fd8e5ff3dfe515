"""What every engine class keeps of its load: the flow and HiFT in each loaded weight format,
the prepared files the load had to prepare and the CPU choices; how a segment's waves become
audio chunks; and its warm-up's runs, one per weight format. Each model family's engine
inherits :class:`EngineBase`."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar, cast

import torch
from torch import nn

from engine.core.runtime import audio_chunks, loaded_format, pick_weights, weight_pairs
from engine.core.types import AudioChunk, SynthesisOptions

if TYPE_CHECKING:
    from engine.core import cpu
    from engine.core.hift import HiFTGenerator
    from engine.core.lm_thread import LmTokens
    from engine.core.prepared import PreparedLoad

FlowT = TypeVar("FlowT", bound=nn.Module)
ModuleT = TypeVar("ModuleT", bound=nn.Module)

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
    """The flow and HiFT by weight format, what the load prepared and chose for this CPU."""

    sample_rate: int  # of the audio chunks, the family's

    def __init__(self, flow: FlowT, hift: HiFTGenerator) -> None:
        # The prepared files load() had to prepare first (e.g. "llm.int8"; empty: none).
        self.prepared_at_load: tuple[str, ...] = ()
        # What load() chose for this CPU (int8 kernels, bfloat16, thread ceiling).
        self.cpu_choices: cpu.CpuChoices | None = None
        # The flow and HiFT by weight format: the primary ones, and any loaded beside them
        # (``extra_formats``) for a request to choose (SynthesisOptions.flow_weights).
        self.flows: dict[str, FlowT] = {loaded_format(flow): flow}
        self.hifts: dict[str, HiFTGenerator] = {loaded_format(hift): hift}

    def _record_load(
        self,
        flows: dict[str, FlowT],
        hifts: dict[str, HiFTGenerator],
        loads: Sequence[PreparedLoad],
        choices: cpu.CpuChoices,
    ) -> None:
        """Keep what load() made beside the models: the flows and HiFTs by format (primary
        first), the names of the files ``loads`` prepared, and ``choices``."""
        self.flows = flows
        self.hifts = hifts
        self.prepared_at_load = tuple(name for load in loads for name in load.prepared_now)
        self.cpu_choices = choices

    @property
    def weight_formats(self) -> dict[str, tuple[str, ...]]:
        """The loaded formats of the flow and HiFT, the primary one first."""
        return {"flow": tuple(self.flows), "hift": tuple(self.hifts)}

    @property
    def hift_dtype(self) -> str:
        """``float32`` or ``bfloat16``: what the primary HiFT's filter runs in."""
        _, hift = pick_weights(self.hifts, None)
        return str(hift.filter_dtype).removeprefix("torch.")

    @abstractmethod
    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Yield audio for ``text``: per streamed chunk, or one chunk per segment."""

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
        for flow_weights, hift_weights in weight_pairs(self.flows, self.hifts):
            options = SynthesisOptions(
                speaker=speaker,
                stream=True,
                seed=0,
                force_tokens=force_tokens,
                n_timesteps=_WARMUP_STEPS,
                flow_weights=flow_weights,
                hift_weights=hift_weights,
            )
            for _ in self.synthesize(_WARMUP_TEXT, options):
                pass
