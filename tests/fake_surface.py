"""What every fake engine of the tests offers besides its synthesis: the engine surface
(``engine.api.Engine``) with a v1 -SFT model's answers. A fake inherits :class:`FakeSurface`,
overrides what its test is about, and declares a capability the way a real engine does: by
inheriting it (``engine.api.SpeaksGrowingText``, ``PrimesVoices``, ``TakesVoices``).

mypy checks this module and conftest.py (``[tool.mypy]`` in pyproject.toml): a fake that
lacks a member of the surface, or gets its signature wrong, fails the lint.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from engine.api import StreamGeometry
from engine.core.types import AudioChunk, SynthesisOptions
from engine.cosyvoice1.engine import STREAM_GEOMETRY
from engine.text.pronunciations import PronunciationCheck, Pronunciations

if TYPE_CHECKING:
    from engine.core.cpu import CpuChoices
    from engine.prompt.voices import ScanResult

SAMPLE_RATE = 22050  # v1's


class FakeSurface(ABC):
    """The surface's members a fake does not test, as a v1 -SFT engine would answer them."""

    model_dir: Path = Path("fake-model")
    kind: str = "sft"
    sample_rate: int = SAMPLE_RATE
    speakers: list[str]  # each fake's own
    prepared_at_load: tuple[str, ...] = ()
    cpu_choices: CpuChoices | None = None
    instruction_form: str | None = None  # takes no instruction
    weight_formats: dict[str, tuple[str, ...]] = {"flow": ("fp32",), "hift": ("fp32",)}
    hift_dtype: str = "float32"

    @property
    def stream_geometry(self) -> StreamGeometry:
        return STREAM_GEOMETRY

    @abstractmethod
    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]: ...

    def warmup(self) -> None:  # noqa: B027 (a fake's warm-up does nothing unless it says)
        pass

    def enable_custom_voices(self, voices_dir: Path | str) -> ScanResult:
        raise NotImplementedError("this fake engine reads no voices folder")

    def use_pronunciations(self, lines: Sequence[str]) -> list[PronunciationCheck]:
        """Checked as a v1 model checks them (no phone tokens); a fake's text is not read."""
        return Pronunciations(lines).checks

    def flow_prompt_frames(self, speaker: str | None) -> int:
        return 0
