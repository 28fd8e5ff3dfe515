"""What both engine classes inherit (engine.core.engine_base): the weights by format, a segment's
audio, the warm-up's runs."""

from __future__ import annotations

import threading
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import cast

import torch
from torch import nn

from engine.core.engine_base import EngineBase, by_format
from engine.core.hift import HiFTGenerator
from engine.core.lm_thread import LmTokens
from engine.core.types import AudioChunk, SynthesisOptions


class _Hift(nn.Module):
    """A stand-in HiFT: only the filter's dtype matters here."""

    def __init__(self, filter_dtype: torch.dtype) -> None:
        super().__init__()
        self.filter_dtype = filter_dtype


class _Tokens:
    """A stand-in for the LM's tokens: remembers being closed."""

    closed = False

    def close(self) -> None:
        self.closed = True


class _Engine(EngineBase[nn.Linear]):
    """Only what every engine inherits; it is never loaded (no load hooks)."""

    def __init__(self) -> None:
        super().__init__(
            nn.Linear(1, 1),
            cast(HiFTGenerator, _Hift(torch.float32)),
            lm=nn.Linear(1, 1),
            model_dir=Path("no-model"),
            kind="none",
            threads=None,
            sample_rate=16000,
            token_rate=25,
        )
        self.asked: list[SynthesisOptions] = []

    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        assert options is not None
        self.asked.append(options)
        yield AudioChunk(torch.zeros(4).numpy(), self.sample_rate)


def test_a_part_lists_its_primary_format_first_then_its_extra_one() -> None:
    primary, extra = nn.Linear(1, 1), nn.Linear(1, 1)
    both = by_format("flow", ("fp32", primary), {"flow": extra}, {"flow": "int8"})
    assert list(both.items()) == [("fp32", primary), ("int8", extra)]
    # The second load brought only a HiFT: the flow keeps its primary format alone.
    hift_only = {"hift": nn.Linear(1, 1)}
    assert by_format("flow", ("int8", primary), hift_only, {"hift": "bf16"}) == {"int8": primary}


def test_hift_dtype_is_the_primary_hifts_beside_an_extra_format() -> None:
    engine = _Engine()
    engine.hifts["bf16"] = cast(HiFTGenerator, _Hift(torch.bfloat16))
    assert engine.weight_formats == {"llm": ("fp32",), "flow": ("fp32",), "hift": ("fp32", "bf16")}
    assert engine.hift_dtype == "float32"


def test_a_dropped_segment_closes_its_waves_and_stops_the_lm() -> None:
    waves_closed = threading.Event()

    def waves() -> Generator[torch.Tensor, None, None]:
        try:
            while True:
                yield torch.ones(8)
        finally:
            waves_closed.set()

    tokens = _Tokens()
    chunks = _Engine()._segment_audio(waves(), cast(LmTokens, tokens), None)
    first = next(chunks)
    assert first.sample_rate == 16000 and len(first.samples) == 8
    chunks.close()  # the caller stops listening after the first chunk
    assert waves_closed.is_set() and tokens.closed


def test_the_warm_up_speaks_once_per_weight_format_in_the_voice_given() -> None:
    engine = _Engine()
    engine.lms["int4"] = nn.Linear(1, 1)
    engine.flows["int8"] = nn.Linear(1, 1)
    engine.hifts["bf16"] = cast(HiFTGenerator, _Hift(torch.bfloat16))
    engine._speak_in_each_format("anna", force_tokens=60)
    ran = [(o.lm_weights, o.flow_weights, o.hift_weights) for o in engine.asked]
    assert ran == [("fp32", "fp32", "fp32"), ("int4", "int8", "bf16")]
    assert all(o.speaker == "anna" and o.force_tokens == 60 and o.stream for o in engine.asked)
