"""CosyVoice2 text frontend: the Qwen2 BPE of the model folder, special tokens, instruct2 text."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TESTS

from engine.core.types import ModelLoadError
from engine.cosyvoice2.frontend import (
    END_OF_PROMPT,
    SPECIAL_TOKENS,
    CosyVoice2TextFrontend,
    Qwen2TextTokenizer,
)
from engine.text.errors import TextInputError
from engine.text.normalize import normalize
from engine.text.segment import split_paragraph
from engine.text.tokenizer import get_tokenizer as whisper_tokenizer

DATA = TESTS / "data" / "cosyvoice2"
BLANK_EN = DATA / "tiny" / "CosyVoice-BlankEN"
N_BPE = 1000  # the tiny vocabulary: BPE ids, then Qwen2's three specials, then CosyVoice2's


@pytest.fixture(scope="module")
def tokenizer() -> Qwen2TextTokenizer:
    return Qwen2TextTokenizer(BLANK_EN)


@pytest.fixture(scope="module")
def frontend() -> CosyVoice2TextFrontend:
    return CosyVoice2TextFrontend(BLANK_EN)


def test_ids_equal_the_official_tokenizer(tokenizer: Qwen2TextTokenizer) -> None:
    """The LM cases' texts, tokenised by the official CosyVoice2 tokenizer."""
    meta = json.loads((DATA / "llm_cases.json").read_text())
    fx = torch.load(DATA / "llm_cases.pt", weights_only=True)
    for case, (prompt_text, text) in meta["texts"].items():
        assert tokenizer.encode(prompt_text) == fx[f"{case}/in_prompt_text"][0].tolist(), case
        assert tokenizer.encode(text) == fx[f"{case}/in_text"][0].tolist(), case


def _official_cases() -> list[dict]:
    return json.loads((DATA / "frontend_cases.json").read_text())["cases"]


# Cases whose official segments we reproduce. The others differ by design: the official run had
# no normaliser installed (digits spelled one by one: "3.5 pm" -> "three.five pm"), where ours
# reads numbers with wetext and closes lines before joining them (v1's rules); instruct texts go
# through instruct_ids, not the segmenter.
SAME_SEGMENTS = (
    "zh",
    "zh_laughter",
    "en_breath",
    "zh_strong",
    "en_strong",
    "tags_mixed",
    "text_with_endofprompt",
    "long_zh",
    "long_en",
    "punct_only",
)
INSTRUCT_CASES = ("instruct_text", "instruct_en")


@pytest.mark.parametrize("case", _official_cases(), ids=lambda c: c["name"])
def test_ids_equal_the_official_frontend(tokenizer: Qwen2TextTokenizer, case: dict) -> None:
    """Raw text, and each official normalised segment, tokenised as the official frontend does."""
    assert tokenizer.encode(case["text"]) == case["token_ids"]
    assert tokenizer.decode(case["token_ids"], skip_special=True) == case["decoded"]
    assert tokenizer.decode(case["token_ids"]) == case["decoded_keep_special"]
    for text, ids in zip(case["normalized_split"], case["normalized_split_token_ids"], strict=True):
        assert tokenizer.encode(text) == ids
    assert tokenizer.encode(case["normalized_joined"]) == case["normalized_joined_token_ids"]


def test_segments_equal_the_official_frontend(frontend: CosyVoice2TextFrontend) -> None:
    cases = {c["name"]: c for c in _official_cases()}
    assert set(SAME_SEGMENTS + INSTRUCT_CASES) <= set(cases)
    for name in SAME_SEGMENTS:
        segments = frontend.segments(cases[name]["text"])
        assert [s.text for s in segments] == cases[name]["normalized_split"], name
        assert [s.token_ids for s in segments] == cases[name]["normalized_split_token_ids"], name
    for name in INSTRUCT_CASES:
        assert frontend.instruct_ids(cases[name]["text"]) == cases[name]["token_ids"], name


def test_special_tokens_are_single_ids_in_official_order(tokenizer: Qwen2TextTokenizer) -> None:
    # Qwen2's own three come from tokenizer_config.json; CosyVoice2's follow in its order.
    assert tokenizer.token_id("<|endoftext|>") == N_BPE
    expected = {"<|im_start|>": N_BPE + 1, "<|im_end|>": N_BPE + 2}
    expected |= {tok: N_BPE + 3 + i for i, tok in enumerate(SPECIAL_TOKENS[2:])}
    assert tokenizer.special_ids == expected
    assert tokenizer.special_ids[END_OF_PROMPT] == 1003
    official = json.loads((DATA / "frontend_cases.json").read_text())
    assert {**expected, "<|endoftext|>": N_BPE} == official["special_token_ids"]
    for token, token_id in expected.items():
        assert tokenizer.encode(token) == [token_id]
        assert tokenizer.encode(f"a{token}b") == [
            *tokenizer.encode("a"),
            token_id,
            *tokenizer.encode("b"),
        ]
    assert tokenizer.n_vocab == official["tokenizer_len"] == N_BPE + 3 + len(SPECIAL_TOKENS) - 2


def test_inline_tags_pass_normalisation_as_single_ids(
    frontend: CosyVoice2TextFrontend, tokenizer: Qwen2TextTokenizer
) -> None:
    text = (
        "在他讲述那个故事的过程中，他突然[laughter]停下来了，<strong>勇气</strong>[breath]。"
        "He said [vocalized-noise] <laughter>no</laughter> [quick_breath] 21 times."
    )
    ids = [i for seg in frontend.segments(text) for i in seg.token_ids]
    for tag in ("[laughter]", "<strong>", "</strong>", "[breath]", "[vocalized-noise]"):
        assert tokenizer.special_ids[tag] in ids, tag
    for tag in ("<laughter>", "</laughter>", "[quick_breath]"):
        assert tokenizer.special_ids[tag] in ids, tag


def test_segments_are_normalised_like_v1(frontend: CosyVoice2TextFrontend) -> None:
    segments = frontend.segments("I have 21 cats. 我有3只猫。")
    assert [s.text for s in segments] == normalize("I have 21 cats. 我有3只猫。")
    assert segments[0].token_ids == frontend.tokenizer.encode(segments[0].text)
    assert frontend.segments("  ...  ") == []


def test_english_segments_are_cut_by_qwen2_token_counts(frontend: CosyVoice2TextFrontend) -> None:
    """The 80-token segments are measured in this model's tokens, not whisper's."""
    text = " ".join(["Stop the music in the living room and turn the lights off."] * 12)
    (normalized,) = normalize(text, split=False)

    def qwen2_len(s: str) -> int:
        return len(frontend.tokenizer.encode(s))

    def whisper_len(s: str) -> int:
        return len(whisper_tokenizer().encode(s))

    ours = split_paragraph(normalized, qwen2_len, "en")
    assert [s.text for s in frontend.segments(text)] == ours
    assert ours != split_paragraph(normalized, whisper_len, "en")  # the test tells them apart


def test_prompt_text_is_normalised(frontend: CosyVoice2TextFrontend) -> None:
    assert frontend.prompt_text_ids("I have 21 cats") == frontend.tokenizer.encode(
        normalize("I have 21 cats", split=False)[0]
    )
    assert frontend.prompt_text_ids("!!!") == []


def test_instruct2_text_is_taken_as_typed(frontend: CosyVoice2TextFrontend) -> None:
    eop = frontend.tokenizer.special_ids[END_OF_PROMPT]
    expected = frontend.tokenizer.encode("用四川话说这句话21遍" + END_OF_PROMPT)
    assert expected[-1] == eop and expected.count(eop) == 1
    for typed in (
        "用四川话说这句话21遍",
        "用四川话说这句话21遍<|endofprompt|>",
        "用四川话说这句话21遍<endofprompt> ",
    ):
        assert frontend.instruct_ids(typed) == expected, typed
    for empty in ("", "  <|endofprompt|> ", "。"):
        with pytest.raises(TextInputError):
            frontend.instruct_ids(empty)


def test_text_limits(frontend: CosyVoice2TextFrontend) -> None:
    with pytest.raises(TextInputError, match="must be a string"):
        frontend.segments(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(TextInputError, match="characters long"):
        frontend.segments("a" * 20_001)


def test_tokenizer_json_is_used_when_present(tmp_path: Path, tokenizer: Qwen2TextTokenizer) -> None:
    """A folder with a full tokenizer.json (and no vocab files) gives the same ids."""
    tokenizer.tokenizer.save(str(tmp_path / "tokenizer.json"))
    from_json = Qwen2TextTokenizer(tmp_path)
    for text in ("Hello, how are you today?", "用四川话说这句话<|endofprompt|>[laughter]"):
        assert from_json.encode(text) == tokenizer.encode(text)
    assert from_json.special_ids == tokenizer.special_ids


def test_missing_or_broken_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        Qwen2TextTokenizer(tmp_path / "nowhere")
    folder = tmp_path / "blank"
    shutil.copytree(BLANK_EN, folder)
    (folder / "merges.txt").unlink()
    with pytest.raises(ModelLoadError, match="merges.txt is missing"):
        Qwen2TextTokenizer(folder)
    shutil.copy(BLANK_EN / "merges.txt", folder / "merges.txt")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"]["1005"] = config["added_tokens_decoder"].pop("1002")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=re.escape("'<|im_end|>' got id 1002, not 1005")):
        Qwen2TextTokenizer(folder)
    (folder / "tokenizer_config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        Qwen2TextTokenizer(folder)


def test_pronunciations_are_respellings_without_phone_tokens(
    frontend: CosyVoice2TextFrontend,
) -> None:
    """CosyVoice2's tokenizer has no phone or pinyin tokens: a line with a respelling says
    it, a line of phones alone is reported and the word left as written."""
    other = CosyVoice2TextFrontend(BLANK_EN)
    checks = other.use_pronunciations(["Siobhan = SH IH0 V AO1 N | Shivawn", "Niamh = N IY1 V"])
    assert [c.spoken_as for c in checks] == ["Shivawn", None]
    assert "no phone or pinyin tokens" in str(checks[1].problem)
    (segment,) = other.segments("Siobhan and Niamh are home.")
    assert segment == frontend.segments("Shivawn and Niamh are home.")[0]
    assert other.piece_text("Tell Siobhan", chinese=False) == "Tell Shivawn"
