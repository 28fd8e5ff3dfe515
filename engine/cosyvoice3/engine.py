"""CosyVoice3Engine: text in, 24 kHz audio chunks out, for a Fun-CosyVoice3-0.5B model directory.

CosyVoice2's engine with the v3 models: the same surface, voices, segments, LM thread, schedules
and primed prompt streams (:class:`~engine.cosyvoice2.engine.CosyVoice2Engine`), with

* the v3 LM (:class:`~engine.cosyvoice3.lm.CosyVoice3LM`) and text frontend: every request's
  LM text carries the system prompt (zero-shot: in front of the transcript; cross-lingual: in
  front of the segment's text; instruct2: around the instruction);
* the DiT flow (:class:`~engine.cosyvoice3.flow.DiTFlow`) on CosyVoice2's incremental
  :class:`~engine.cosyvoice2.flow.FlowStream`;
* the causal HiFT through :class:`~engine.cosyvoice3.hift.CausalHiftStream`: each mel frame's
  audio is made once, when the 8 frames after it are known, and nothing is cross-faded; its
  source noise is drawn in order from the request's seed (the official model draws one fixed
  table when it is built);
* voices made with the v3 recipe (:mod:`engine.cosyvoice3.prompt`);
* silent and breath tokens beyond five in a row dropped (:mod:`engine.cosyvoice3.silence`).

Streaming schedules: ``official`` is CosyVoice3Model.tts's — the first hop 25 tokens plus the
prompt's padding to whole 25-token chunks, then 50 and 100, each chunk once its 3 look-ahead
tokens arrived, the last chunk from one non-streaming flow call over the whole answer — the
same orchestration as CosyVoice2's, so the same code runs it. The incremental (default) schedule
is CosyVoice2's: hops ending on attention chunk boundaries, the prompt cut so that the first hop
completes its last chunk, every chunk computed once in chunk attention.

A sentence whose text is still arriving is read by the LM as it comes, as CosyVoice2's, in the v3
bistream layout (:class:`~engine.cosyvoice3.bistream.CosyVoice3BistreamSession`: the system prompt
read first).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor, nn

from engine.core.stage_times import StageListener, report, since
from engine.core.text_feed import TextFeed
from engine.core.types import SynthesisOptions
from engine.cosyvoice2.engine import ChunkedStreamGeometry, CosyVoice2Engine
from engine.cosyvoice2.frontend import END_OF_PROMPT
from engine.cosyvoice2.growing_speech import growing_tokens
from engine.cosyvoice2.lm import BACKBONE_DIR
from engine.cosyvoice2.prompt import CROSS_LINGUAL, VoiceConditioning
from engine.cosyvoice2.streaming import MelVocoder
from engine.cosyvoice3.bistream import CosyVoice3BistreamSession
from engine.cosyvoice3.flow import DiTFlow, modulation_layer_names, use_onednn_frame_linears
from engine.cosyvoice3.frontend import CosyVoice3TextFrontend
from engine.cosyvoice3.hift import CausalHiFT, CausalHiftStream, SourceNoise, UniformSourceNoise
from engine.cosyvoice3.model_dir import (
    LM_FILE,
    PARTS,
    RL_LM_FILE,
    RL_PARTS,
    CosyVoice3Models,
)
from engine.cosyvoice3.prompt import COSYVOICE3
from engine.cosyvoice3.silence import capped_silences
from engine.family_facts import COSYVOICE3 as COSYVOICE3_FAMILY

if TYPE_CHECKING:
    from engine.core.hift import HiFTGenerator
    from engine.core.mapped_weights import MappedWeights
    from engine.core.prepared import ModelParts, PreparedLoad
    from engine.cosyvoice2.model_dir import CosyVoice2Models
    from engine.text.frontend import Segment

KIND = "cosyvoice3"

# The source noise generator's seed is the request's seed plus this (independent of the LM's).
_NOISE_SEED_OFFSET = 1_000_003


def _map_afresh_under(mapped: MappedWeights, layers: Sequence[str]) -> None:
    """Point the mapped weights of these layers at a mapping of their own."""
    mapped.map_afresh(mapped.under(layers))


def seeded_source_noise(seed: int) -> SourceNoise:
    """The causal HiFT's source draws for a request of this seed (a generator of its own)."""
    return UniformSourceNoise(torch.Generator().manual_seed(seed + _NOISE_SEED_OFFSET))


@dataclass
class ReportedHiftStream:
    """A :class:`CausalHiftStream` that tells ``on_stage`` what each push cost."""

    stream: CausalHiftStream
    on_stage: StageListener | None
    weights: str

    def push(self, mel: Tensor, *, finalize: bool) -> Tensor:
        start = time.perf_counter()
        audio = self.stream.push(mel, finalize=finalize)
        hift = self.stream.hift
        fed_s = mel.shape[2] * hift.upp / hift.args.sampling_rate
        report(self.on_stage, "hift", self.weights, since(start), fed_s)
        return audio


class CosyVoice3Engine(CosyVoice2Engine):
    """A loaded Fun-CosyVoice3 model directory plus its text frontend and voices (``load``'s
    own options: ``flow_cache_dtype``, as CosyVoice2's, and ``rl_lm``: run the RL-tuned LM,
    ``llm.rl.pt``, in place of ``llm.pt``)."""

    model_parts = PARTS
    family = COSYVOICE3_FAMILY
    recipe = COSYVOICE3
    # CosyVoice2's engine reads the same names of its models (the LM's generate, the flow's
    # chunk and look-ahead, the rates); the v3 classes have them.
    models: CosyVoice3Models  # type: ignore[assignment]

    def __init__(
        self,
        models: CosyVoice3Models,
        *,
        threads: int | None = None,
        frontend: CosyVoice3TextFrontend | None = None,
        flow_cache_dtype: torch.dtype | None = torch.float16,
        rl_lm: bool = False,
    ) -> None:
        frontend = frontend or CosyVoice3TextFrontend(models.model_dir / BACKBONE_DIR)
        super().__init__(
            cast("CosyVoice2Models", models),
            threads=threads,
            frontend=frontend,
            flow_cache_dtype=flow_cache_dtype,
        )
        self.frontend: CosyVoice3TextFrontend = frontend
        self.kind = KIND
        # The LM's checkpoint the models were loaded from (what ``rl_lm`` chose).
        self.lm_file = RL_LM_FILE if rl_lm else LM_FILE
        # Where each segment's source noise comes from, by its seed (parity tests inject the
        # official model's fixed table here).
        self.source_noise: Callable[[int], SourceNoise] = seeded_source_noise

    @classmethod
    def _parts_for(cls, engine_options: dict[str, Any]) -> ModelParts:
        return RL_PARTS if engine_options.get("rl_lm") else PARTS

    @classmethod
    def _finish_flow(cls, flow: nn.Module, mapped: MappedWeights | None) -> None:
        """Where oneDNN's matmul is the faster one (AVX-512), the float32 DiT blocks' per-frame
        Linears run on it, on weights reordered a block at a time, each block's read through a
        mapping of its own that goes once they are reordered: a load holds the 0.74 GB of
        these weights once, not twice. The modulation Linears stay mapped and each time grid's
        modulations are kept; where they are read mapped (float32, bfloat16; the int8 ones are
        packed copies) they get a mapping of their own, mapped afresh each time a grid is kept:
        their pages (0.55 GB in float32) are resident only while a grid not seen yet is
        computed (docs/dev/cosyvoice3-flow.md)."""
        dit_flow = cast(DiTFlow, flow)
        dit = dit_flow.decoder.estimator
        reread = None if mapped is None else functools.partial(_map_afresh_under, mapped)
        use_onednn_frame_linears(dit_flow, reread)
        layers = modulation_layer_names(dit_flow)
        names = mapped.under(layers) if mapped is not None else []
        if mapped is None or not names:
            dit.keep_time_biases()
            return
        release = functools.partial(mapped.map_afresh, names)
        release()  # out of the mapping the other weights are read through
        dit.keep_time_biases(release)

    @classmethod
    def _build_frontend(cls, model_dir: Path) -> CosyVoice3TextFrontend:
        return CosyVoice3TextFrontend(model_dir / BACKBONE_DIR)

    @classmethod
    def _models_of(
        cls, load: PreparedLoad, modules: tuple[nn.Module, nn.Module, nn.Module]
    ) -> Any:  # CosyVoice3Models (CosyVoice2's hook says CosyVoice2Models)
        return CosyVoice3Models.of(load.model_dir, load.args, modules)

    def _lm_text_ids(self, segment: Segment, cond: VoiceConditioning) -> list[int]:
        # Without a transcript the system prompt goes in front of the text (the official LM
        # counts it in the text's length, which sets the answer's minimum and maximum).
        if cond.mode == CROSS_LINGUAL:
            return self.frontend.cross_lingual_text_ids(segment)
        return list(segment.token_ids)

    def _kept_tokens(self, tokens: Iterator[int]) -> Iterator[int]:
        return capped_silences(tokens)

    def _mel_vocoder(
        self, hift: HiFTGenerator, seed: int, options: SynthesisOptions, weights: str
    ) -> MelVocoder:
        """A segment's causal HiFT stream, its source noise drawn from the seed."""
        stream = CausalHiftStream(cast(CausalHiFT, hift), self.source_noise(seed))
        return ReportedHiftStream(stream, options.on_stage, weights)

    def _growing_tokens(
        self,
        text: TextFeed,
        cond: VoiceConditioning,
        options: SynthesisOptions,
        generator: torch.Generator,
        cancel: threading.Event | None,
    ) -> Iterator[int]:
        # The v3 session reads the system prompt first; without a transcript (cross-lingual)
        # the system prompt alone is the prompt text.
        if cond.mode == CROSS_LINGUAL:
            cond = dataclasses.replace(cond, prompt_text_ids=self.frontend.system_prompt_ids())
        session = functools.partial(
            CosyVoice3BistreamSession,
            end_of_prompt_id=self.frontend.tokenizer.token_id(END_OF_PROMPT),
        )
        _, llm = self._lm(options)
        frontend = self.frontend
        return growing_tokens(
            llm, frontend, text, cond, options, generator, cancel, new_session=session
        )

    @property
    def stream_geometry(self) -> ChunkedStreamGeometry:
        """How streamed chunks are cut: CosyVoice2's hops; the causal HiFT holds back the
        audio of the last 8 frames and reads its left context again."""
        hift = self.models.hift
        frame_s = hift.upp / self.sample_rate
        return ChunkedStreamGeometry(
            token_rate=self.token_rate,
            frames_per_token=self.models.flow.args.token_mel_ratio,
            overlap_tokens=0,
            lookahead_tokens=self.models.flow.args.pre_lookahead_len,
            chunk_tokens=self.models.flow.chunk_tokens,
            held_back_s=hift.settle_frames * frame_s,
            hift_context_s=hift.left_context_frames() * frame_s,
        )
