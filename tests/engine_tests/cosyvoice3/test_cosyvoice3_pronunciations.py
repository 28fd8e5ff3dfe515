"""Pronunciations on CosyVoice3: a listed word reaches the tiny v3 LM's token embedding as the
phone or pinyin token ids, whole and while a sentence's text is still arriving."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import TESTS
from growing_speech import speak_while_arriving

import engine.cosyvoice3.engine as engine_module
from engine.core.prepared import PREPARED_DIR
from engine.core.text_feed import TextFeed
from engine.core.types import SynthesisOptions
from engine.cosyvoice2.growing_text import GrowingTextIds
from engine.cosyvoice3.engine import CosyVoice3Engine
from engine.cosyvoice3.frontend import CosyVoice3TextFrontend
from engine.family import load_engine
from engine.prompt.extract import PromptFeatures
from engine.prompt.voices import CustomVoice

DATA = TESTS / "data" / "cosyvoice3"
TINY = DATA / "tiny"
LINES = [
    "Siobhan = SH IH0 V AO1 N | Shivawn",
    "张三 = zhang1 san1",
    "Niamh = Neev",
    "Michael = M AX0 K",  # refused: AX0 is no phone
]
PHONES = ["[SH]", "[IH0]", "[V]", "[AO1]", "[N]"]
PINYIN = ["[zh]", "[āng]", "[s]", "[ān]"]


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Bit-stable sums, and no oversubscription of the shared cores."""


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CosyVoice3Engine]:
    target = tmp_path_factory.mktemp("v3") / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    loaded = load_engine(target, threads=1)
    assert isinstance(loaded, CosyVoice3Engine)
    cases = torch.load(DATA / "engine_cases.pt", weights_only=True)
    features = PromptFeatures(
        cases["prompt37/embedding"],
        cases["prompt37/prompt_tokens"].to(torch.int32),
        cases["prompt37/prompt_feat"],
    )
    loaded.add_voice(CustomVoice("v", "Hello there.", "en", features, 1.0, family="cosyvoice3"))
    checks = loaded.use_pronunciations(LINES)
    assert [c.problem is None for c in checks] == [True, True, True, False]
    yield loaded
    loaded.use_pronunciations([])


class EmbeddedIds:
    """Every token id the LM's Qwen2 embedding looks up, in order."""

    def __init__(self, engine: CosyVoice3Engine) -> None:
        self.ids: list[int] = []
        embed = engine.models.llm.llm.model.model.embed_tokens
        self._hook = embed.register_forward_hook(self._record)

    def _record(self, module: Any, args: tuple[torch.Tensor, ...], output: Any) -> None:
        self.ids += args[0].flatten().tolist()

    def close(self) -> None:
        self._hook.remove()

    def holds(self, run: list[int]) -> bool:
        return any(self.ids[i : i + len(run)] == run for i in range(len(self.ids)))


@pytest.fixture
def embedded(engine: CosyVoice3Engine) -> Iterator[EmbeddedIds]:
    spy = EmbeddedIds(engine)
    yield spy
    spy.close()


def _ids(engine: CosyVoice3Engine, tokens: list[str]) -> list[int]:
    return [engine.frontend.tokenizer.token_id(t) for t in tokens]


def test_phone_and_pinyin_tokens_reach_the_lm(
    engine: CosyVoice3Engine, embedded: EmbeddedIds
) -> None:
    options = SynthesisOptions(speaker="v", stream=False, seed=0, force_tokens=4)
    list(engine.synthesize("Siobhan is home.", options))
    list(engine.synthesize("张三回家了。", options))
    assert embedded.holds(_ids(engine, PHONES))
    assert embedded.holds(_ids(engine, PINYIN))
    for word in ("Siobhan", "张三", "Shivawn"):  # neither the word nor the respelling
        assert not embedded.holds(engine.frontend.tokenizer.encode(word))


def test_a_respelling_and_a_refused_line_reach_it_as_text(
    engine: CosyVoice3Engine, embedded: EmbeddedIds
) -> None:
    options = SynthesisOptions(speaker="v", stream=False, seed=0, force_tokens=4)
    list(engine.synthesize("Niamh met Michael.", options))
    plain = engine.frontend.tokenizer.encode("Neev met Michael.")
    assert embedded.holds(plain)
    assert not embedded.holds(_ids(engine, ["[M]"]))


def test_tokens_reach_the_lm_while_the_sentence_arrives(
    engine: CosyVoice3Engine, embedded: EmbeddedIds, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sentence ends only once the LM has spoken from it as it arrives (a bistream
    session), so the word goes in through the growing path, not a whole sentence's."""
    started = threading.Event()

    class Started(engine_module.CosyVoice3BistreamSession):  # type: ignore[misc]
        def ready_tokens(self) -> Iterator[int]:
            for token in super().ready_tokens():
                started.set()
                yield token

    monkeypatch.setattr(engine_module, "CosyVoice3BistreamSession", Started)
    so_far = "Please tell Siobhan that the kettle is on, the door is open and the lights are"
    text = TextFeed(so_far)
    full = so_far + " off."

    options = SynthesisOptions(speaker="v", stream=True, seed=0, force_tokens=30)
    speak_while_arriving(engine, text, full, started, options)
    assert started.is_set()
    assert embedded.holds(_ids(engine, PHONES))
    assert not embedded.holds(engine.frontend.tokenizer.encode(" Siobhan"))


@pytest.mark.parametrize("cut", ["by word", "whole"])
def test_growing_ids_equal_the_whole_sentences(cut: str) -> None:
    """Pieces of a sentence committed early carry the tokens as the whole sentence does."""
    frontend = CosyVoice3TextFrontend(TINY / "CosyVoice-BlankEN")
    frontend.use_pronunciations(LINES)
    sentence = "Please tell Siobhan and Niamh that the kettle is on."
    growing = GrowingTextIds(frontend)
    ids: list[int] = []
    if cut == "by word":
        so_far = ""
        for word in sentence.split(" "):
            so_far += word + " "
            ids += growing.update(so_far)
        assert ids  # some went out before the end
    ids += growing.finish(sentence)
    assert growing.exact
    assert ids == frontend.segments(sentence, split=False)[0].token_ids
    phones = [frontend.tokenizer.token_id(t) for t in PHONES]
    assert any(ids[i : i + len(phones)] == phones for i in range(len(ids)))
