"""The engine's surface: what every engine offers its callers, and what some declare beside it.

:class:`Engine` is what a caller may use of any loaded engine, whatever its model family
(``engine.family.load_engine`` returns one). An engine that can do more says so by inheriting
a capability class (:class:`SpeaksGrowingText`, :class:`PrimesVoices`, :class:`TakesVoices`):
a caller asks ``isinstance(engine, PrimesVoices)``, never whether an attribute exists.
:class:`StreamGeometry` is how an engine cuts its speech tokens into streamed chunks, for a
caller that predicts their cost (the server's ``auto`` profile).

Facts a caller needs before an engine has loaded (its sample rate, model files, prompt cache
suffix, whether it takes instructions) are the family's: :mod:`engine.family`.

No torch here: the server imports this module at start-up.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.core.cpu import CpuChoices
    from engine.core.pacing import ChunkPacer
    from engine.core.text_feed import TextFeed
    from engine.core.types import AudioChunk, StreamSchedule, SynthesisOptions
    from engine.prompt.voices import ScanResult
    from engine.text.pronunciations import PronunciationCheck


@dataclass(frozen=True)
class StreamGeometry(ABC):
    """How a model family turns speech tokens into flow work, vocoder work and audio."""

    token_rate: float  # speech tokens per second of audio
    frames_per_token: float  # mel frames per speech token
    overlap_tokens: int  # tokens each streamed chunk computes again from the one before
    lookahead_tokens: int  # tokens past a chunk's end needed before it is cut
    chunk_tokens: int  # attention chunk: hops end on its boundaries (1: anywhere)
    held_back_s: float  # audio each streamed chunk keeps back for the next one's cross-fade
    hift_context_s: float  # left context HiFT computes again in each chunk after the first

    @abstractmethod
    def hops(self, schedule: StreamSchedule) -> Iterator[int]:
        """New tokens per streamed chunk, as the engine cuts them."""

    @abstractmethod
    def prompt_tail(self, schedule: StreamSchedule) -> int:
        """Prompt tokens the first streamed chunk computes again."""

    @abstractmethod
    def smallest_hop(self, schedule: StreamSchedule) -> int:
        """The smallest hop a paced schedule cuts after the first (engine.core.pacing)."""

    def pacer(
        self,
        schedule: StreamSchedule,
        *,
        paced: bool,
        sample_rate: int,
        hops: Iterator[int] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> ChunkPacer:
        """The hops of one streamed answer under ``schedule`` (``hops``: the engine's own, else
        :meth:`hops`), cut as this family cuts them and, ``paced``, each sized to the audio the
        listener still has (engine.core.pacing; ``clock``: the time it reads)."""
        from engine.core.pacing import ChunkPacer

        return ChunkPacer(
            self.hops(schedule) if hops is None else hops,
            paced=paced,
            growth=schedule.growth,
            step=self.chunk_tokens,
            smallest=self.smallest_hop(schedule),
            token_s=1 / self.token_rate,
            sample_rate=sample_rate,
            clock=clock,
        )


class Engine(Protocol):
    """What every loaded engine offers, whatever its model family."""

    model_dir: Path
    # The model's kind, for people and logs: v1's "sft", "base" or "instruct"; "cosyvoice2".
    kind: str
    sample_rate: int  # of the audio chunks
    speakers: list[str]  # the built-in voices, the default first
    # What load() had to prepare first (e.g. "llm.int8"; empty: none), and chose for the CPU.
    prepared_at_load: tuple[str, ...]
    cpu_choices: CpuChoices | None

    @property
    def instruction_form(self) -> str | None:
        """How the engine reads ``SynthesisOptions.instruct`` (``engine.family``'s
        ``DESCRIBED_SPEAKER``, ``INSTRUCT2``, ``INSTRUCT3``); None: it takes no instruction."""

    @property
    def weight_formats(self) -> dict[str, tuple[str, ...]]:
        """The loaded formats of the LM ("llm"), flow and HiFT, the primary one first."""

    @property
    def hift_dtype(self) -> str:
        """``float32`` or ``bfloat16``: what the primary HiFT's filter runs in."""

    @property
    def stream_geometry(self) -> StreamGeometry:
        """How streamed chunks are cut."""

    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Audio for ``text``: per streamed chunk, or one chunk per segment. Stops within a
        chunk once ``cancel`` is set."""

    def warmup(self) -> None:
        """One short synthesis per loaded weight format, so a first request is not slower."""

    def use_pronunciations(self, lines: Sequence[str]) -> list[PronunciationCheck]:
        """Say words as these ``word = entry`` lines tell (:mod:`engine.text.pronunciations`)
        in every text from now on: as phone or pinyin tokens where the model has them, else as
        a line's respelling. How each line fares; a line with a problem is not applied."""

    def enable_custom_voices(self, voices_dir: Path | str) -> ScanResult:
        """Speak NAME.wav + NAME.txt voices of ``voices_dir`` too (call again to re-scan)."""

    def flow_prompt_frames(self, speaker: str | None) -> int:
        """Mel frames of a voice's prompt that the flow computes again in every chunk."""


class SpeaksGrowingText(ABC):
    """An engine that can speak a sentence while its text is still arriving."""

    @abstractmethod
    def synthesize_growing(
        self,
        text: TextFeed,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Audio for one sentence whose text is still arriving, as :meth:`Engine.synthesize`."""


class PrimesVoices(ABC):
    """An engine that computes a voice's prompt once per set of flow settings, and can do so
    before the first request (and let go of it for settings no request will use)."""

    @abstractmethod
    def prime_voice(self, options: SynthesisOptions | None = None) -> None:
        """Prepare ``options.speaker``'s voice (None: the default) for these flow settings."""

    @abstractmethod
    def unprime_voice(self, options: SynthesisOptions | None = None) -> None:
        """Let go of what :meth:`prime_voice` prepared for these settings."""


class TakesVoices(ABC):
    """An engine whose model ships no speakers: its built-in voices are prompts made for it
    once from another model's speakers (``engine.family.Family.voices_from`` names it) and
    added after each load."""

    @classmethod
    @abstractmethod
    def make_voices(
        cls,
        source: Engine,
        model_dir: Path,
        folder: Path,
        options: SynthesisOptions,
        on_speaker: Callable[[int, int, str], None] = lambda number, count, speaker: None,
    ) -> None:
        """Have ``source`` (a loaded engine of the ``voices_from`` model) say a sentence in
        each of its speakers into ``folder`` as prompt voices for the model in ``model_dir``,
        with ``options``, telling ``on_speaker(number, count, speaker)`` before each; speakers
        whose voice is there already are kept as they are, failures are logged."""

    @abstractmethod
    def add_voices_from(self, folder: Path) -> ScanResult:
        """Offer the prompt voices of ``folder`` as built-in speakers; what the scan found."""
