"""The CosyVoice3 engine: the tiny v3 model directory through its prepared files, the family
picker, the LM's text per mode, the silence cap, and its audio (whole and streamed on the
official schedule) against the official CosyVoice3Model.tts for the same speech tokens and
source noise (tests/data/cosyvoice3/engine_cases.*)."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TESTS
from growing_speech import speak_while_arriving
from torch import Tensor

from engine.core.prepared import PREPARED_DIR
from engine.core.text_feed import TextFeed
from engine.core.types import LOW_LATENCY_SCHEDULE, OFFICIAL_SCHEDULE, SynthesisOptions
from engine.cosyvoice3.engine import CosyVoice3Engine
from engine.cosyvoice3.silence import MAX_SILENT_RUN, SILENT_TOKENS, capped_silences
from engine.family import load_engine, model_family
from engine.prompt.extract import PromptFeatures
from engine.prompt.voices import CustomVoice

DATA = TESTS / "data" / "cosyvoice3"
TINY = DATA / "tiny"
CASES: dict[str, Tensor] = torch.load(DATA / "engine_cases.pt", weights_only=True)
META = json.loads((DATA / "engine_cases.json").read_text(encoding="utf-8"))
SCENARIOS = sorted(META["scenarios"])
# 4x the official code's largest spread on these cases (README, ## engine).
WHOLE_ATOL = float(META["tolerances"]["whole_atol"])
STREAM_ATOL = float(META["tolerances"]["stream_atol"])


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Bit-stable sums, and no oversubscription of the shared cores."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> CosyVoice3Engine:
    target = tmp_path_factory.mktemp("v3") / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    torch.set_num_threads(1)
    loaded = load_engine(target, threads=1)
    assert isinstance(loaded, CosyVoice3Engine)
    for name in SCENARIOS:
        loaded.add_voice(_official_voice(name))
    return loaded


class ForcedTokens:
    """Stands in for the LM's ``generate``: yields planned tokens, keeping what it was asked."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens: list[int] = tokens
        self.calls: list[tuple[object, ...]] = []

    def __call__(self, *args: object, **kwargs: object) -> Iterator[int]:
        self.calls.append(args)
        yield from self.tokens


@pytest.fixture
def fresh(engine: CosyVoice3Engine) -> Iterator[CosyVoice3Engine]:
    """The engine, with the LM and source noise a test replaces put back."""
    generate, noise = engine.models.llm.generate, engine.source_noise
    yield engine
    engine.models.llm.generate, engine.source_noise = generate, noise  # type: ignore[method-assign]


class OfficialTable:
    """The official model's fixed source draws as the generator set them: one Generator, the
    initial phases (the fundamental's zeroed), then the uniform table, read in order."""

    def __init__(self) -> None:
        spec = META["source_noise"]
        g = torch.Generator().manual_seed(spec["seed"])
        self.phase = torch.rand((1, 9, 1), generator=g)
        self.phase[:, 0] = 0
        self.rows = torch.rand((1, spec["table_samples"], 9), generator=g)
        self.read = 0

    def initial_phase(self, harmonics: int) -> Tensor:
        return self.phase

    def table(self, harmonics: int, n_samples: int) -> Tensor:
        rows = self.rows[:, self.read : self.read + n_samples]
        self.read += n_samples
        return rows.transpose(1, 2)


def _official_voice(name: str) -> CustomVoice:
    features = PromptFeatures(
        CASES[f"{name}/embedding"],
        CASES[f"{name}/prompt_tokens"].to(torch.int32),
        CASES[f"{name}/prompt_feat"],
    )
    return CustomVoice(name, "Hello there.", "en", features, 1.0, family="cosyvoice3")


def _force(engine: CosyVoice3Engine, tokens: list[int]) -> ForcedTokens:
    forced = ForcedTokens(tokens)
    engine.models.llm.generate = forced  # type: ignore[method-assign]
    return forced


def _official(name: str, kind: str) -> list[Tensor]:
    return [CASES[f"{name}/{kind}/chunk{i}"] for i in range(len(META["scenarios"][name][kind]))]


def _speak(engine: CosyVoice3Engine, name: str, options: SynthesisOptions) -> list[Tensor]:
    _force(engine, CASES[f"{name}/tokens"].tolist())
    engine.source_noise = lambda seed: OfficialTable()
    return [torch.from_numpy(c.samples) for c in engine.synthesize("Hello.", options)]


def test_the_family_is_picked_by_its_config_file() -> None:
    assert model_family(TINY).name == "cosyvoice3"


@pytest.mark.parity
@pytest.mark.parametrize("name", SCENARIOS)
def test_whole_audio_equals_the_official_tts(fresh: CosyVoice3Engine, name: str) -> None:
    chunks = _speak(fresh, name, SynthesisOptions(speaker=name, stream=False, seed=0))
    (want,) = _official(name, "whole")
    (got,) = chunks
    torch.testing.assert_close(got, want, atol=WHOLE_ATOL, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("name", SCENARIOS)
def test_streamed_audio_equals_the_official_stream(fresh: CosyVoice3Engine, name: str) -> None:
    """The official schedule: the official chunks (token hops 25 + the prompt's padding, 50,
    100; the last from a full-attention call), chunk for chunk."""
    options = SynthesisOptions(speaker=name, stream=True, schedule=OFFICIAL_SCHEDULE, seed=0)
    chunks = _speak(fresh, name, options)
    want = _official(name, "stream")
    assert [len(c) for c in chunks] == [len(w) for w in want]
    for i, (got, expected) in enumerate(zip(chunks, want, strict=True)):
        torch.testing.assert_close(got, expected, atol=STREAM_ATOL, rtol=0, msg=f"chunk {i}")


def test_the_incremental_stream_says_every_frame_once(fresh: CosyVoice3Engine) -> None:
    """The default schedule: the same number of samples as the whole answer, in more than one
    chunk, each frame's audio made once (no cross-fade in the causal HiFT)."""
    name = "prompt37"
    options = SynthesisOptions(speaker=name, stream=True, schedule=LOW_LATENCY_SCHEDULE, seed=0)
    chunks = _speak(fresh, name, options)
    (whole,) = _official(name, "whole")
    assert len(chunks) > 2
    assert sum(len(c) for c in chunks) == len(whole)
    assert all(bool(torch.isfinite(c).all()) for c in chunks)


def test_the_lm_reads_the_system_prompt_in_every_mode(fresh: CosyVoice3Engine) -> None:
    """Zero-shot: in front of the transcript; cross-lingual: in front of the text (which then
    counts in the text's length, as the official LM counts it); instruct2: around the
    instruction."""
    system = fresh.frontend.system_prompt_ids()
    forced = _force(fresh, [])
    text_ids = fresh.frontend.segments("Hello.")[0].token_ids
    list(fresh.synthesize("Hello.", SynthesisOptions(speaker="prompt37", stream=False)))
    list(fresh.synthesize("你好。", SynthesisOptions(speaker="prompt37", stream=False)))
    options = SynthesisOptions(speaker="prompt37", stream=False, instruct="Speak slowly.")
    list(fresh.synthesize("Hello.", options))
    (zero_text, zero_prompt, zero_tokens), (cross_text, cross_prompt, cross_tokens) = [
        call[:3] for call in forced.calls[:2]
    ]
    assert zero_text == text_ids
    assert list(zero_prompt)[: len(system)] == system  # type: ignore[call-overload]
    assert zero_tokens == CASES["prompt37/prompt_tokens"][0].tolist()
    assert list(cross_text)[: len(system)] == system  # type: ignore[call-overload]
    assert cross_prompt == [] and cross_tokens == []
    assert forced.calls[2][1] == fresh.frontend.instruct_ids("Speak slowly.")


def test_a_voice_of_another_family_is_refused(fresh: CosyVoice3Engine) -> None:
    voice = _official_voice("prompt37")
    other = CustomVoice("v2", voice.transcript, "en", voice.prompt, 1.0, family="cosyvoice2")
    with pytest.raises(ValueError, match="prepared for cosyvoice2, not cosyvoice3"):
        fresh.add_voice(other)


def test_silent_tokens_beyond_five_in_a_row_are_dropped() -> None:
    silent = sorted(SILENT_TOKENS)
    tokens = [7, *silent[:8], 9, silent[0], silent[1], 11]
    kept = list(capped_silences(tokens))
    assert kept == [7, *silent[:MAX_SILENT_RUN], 9, silent[0], silent[1], 11]


def test_the_int8_models_load_from_their_prepared_files_and_speak(tmp_path: Path) -> None:
    """``lm_int8`` / ``flow_int8``: the prepared int8 files are made and run (a streamed answer
    of every planned token; close to float32 is the flow's own test)."""
    target = tmp_path / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    loaded = load_engine(target, threads=1, lm_int8=True, flow_int8=True)
    assert isinstance(loaded, CosyVoice3Engine)
    assert {"llm.int8", "flow.int8"} <= set(loaded.prepared_at_load)
    loaded.add_voice(_official_voice("prompt37"))
    chunks = _speak(loaded, "prompt37", SynthesisOptions(speaker="prompt37", stream=True, seed=0))
    (whole,) = _official("prompt37", "whole")
    assert sum(len(c) for c in chunks) == len(whole)
    assert all(bool(torch.isfinite(c).all()) for c in chunks)


def test_every_quantised_format_loads_as_this_cpu_runs_it_and_speaks(tmp_path: Path) -> None:
    """The int4 LM, int8 flow and int8 HiFT asked for at once: each part is prepared in the format
    this CPU runs (the int4 LM as int8 where torch's int4 kernel is missing or slower, HiFT float32
    where its int8 convolutions are not faster: the Arm boards' fallbacks), and the real LM, flow
    and HiFT speak a streamed answer in them."""
    from engine.core.runtime import int4_kernel_for_lm, int8_hift_fast

    target = tmp_path / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    loaded = load_engine(target, threads=1, lm_int4=True, flow_int8=True, hift_int8=True)
    assert isinstance(loaded, CosyVoice3Engine)
    lm = "int4" if int4_kernel_for_lm() else "int8"
    hift = "int8" if int8_hift_fast() else "fp32"
    assert loaded.weight_formats == {"llm": (lm,), "flow": ("int8",), "hift": (hift,)}
    assert loaded.hift_dtype == ("int8" if hift == "int8" else "float32")
    assert f"llm.{lm}" in loaded.prepared_at_load and "flow.int8" in loaded.prepared_at_load
    loaded.add_voice(_official_voice("prompt37"))
    options = SynthesisOptions(speaker="prompt37", stream=True, seed=0, force_tokens=30)
    chunks = [torch.from_numpy(c.samples) for c in loaded.synthesize("Hello there.", options)]
    audio = torch.cat(chunks)
    assert audio.numel() > 0 and bool(torch.isfinite(audio).all()) and float(audio.abs().max()) > 0


def test_text_still_arriving_is_read_by_the_v3_bistream_session(
    fresh: CosyVoice3Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A growing sentence goes to CosyVoice3's session, the system prompt (through
    ``<|endofprompt|>``) in front of the transcript; the answer ends when the text does."""
    import engine.cosyvoice3.engine as engine_module

    made: list[list[int]] = []
    started = threading.Event()

    class Recording(engine_module.CosyVoice3BistreamSession):  # type: ignore[misc]
        def __init__(self, lm: Any, prompt_text_ids: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(lm, prompt_text_ids, *args, **kwargs)
            made.append(list(prompt_text_ids))
            started.set()

    monkeypatch.setattr(engine_module, "CosyVoice3BistreamSession", Recording)
    text = TextFeed("Hello there, this is a")
    full = "Hello there, this is a sentence that keeps coming."

    options = SynthesisOptions(speaker="prompt37", stream=True, seed=0, force_tokens=30)
    chunks = speak_while_arriving(fresh, text, full, started, options)
    system = fresh.frontend.system_prompt_ids()
    assert made and made[0][: len(system)] == system
    assert all(bool(torch.isfinite(torch.from_numpy(c.samples)).all()) for c in chunks)


def test_forced_token_counts_are_exact(fresh: CosyVoice3Engine) -> None:
    """``force_tokens`` (benchmarks on random weights) masks all 200 stop ids, not EOS alone:
    the tiny LM would draw one of the others within a few tokens."""
    text = fresh.frontend.segments("Hello there, this is a test.")[0].token_ids
    prompt = fresh.frontend.prompt_text_ids("Hello there.")
    for seed in range(3):
        generator = torch.Generator().manual_seed(seed)
        drawn = list(
            fresh.models.llm.generate(text, prompt, [], generator=generator, max_tokens=90)
        )
        assert len(drawn) == 90
