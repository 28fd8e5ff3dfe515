"""CosyVoice3 text frontend: its special tokens, pronunciation tokens through normalisation, and
the prompt text the official CosyVoice3 hands its LM in each mode."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TESTS

from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
from engine.cosyvoice3.frontend import (
    CMU_PHONE_TOKENS,
    END_OF_SYSTEM,
    PINYIN_TOKENS,
    SPECIAL_TOKENS,
    SYSTEM_PROMPT,
    CosyVoice3TextFrontend,
)
from engine.text.errors import TextInputError

DATA = TESTS / "data" / "cosyvoice3"
BLANK_EN = DATA / "tiny" / "CosyVoice-BlankEN"
OFFICIAL = json.loads((DATA / "frontend_cases.json").read_text())
SYSTEM = SYSTEM_PROMPT + "<|endofprompt|>"
# Modes whose official model input we reproduce from the same user text. The others differ by
# design: the official run had no normaliser installed and reads "123" with inflect ("one
# hundred and twenty-three"; ours has no hyphen), and it does not normalise a cross-lingual
# text at all (the system prompt in it holds "<|", which turns normalisation off), where ours
# normalises the user's part ("25" -> "twenty five").
SAME_MODES = ("zero_shot_phones", "cross_lingual", "instruct2", "instruct2_english_digits")
DIFFERENT_MODES = ("zero_shot", "cross_lingual_digits")


@pytest.fixture(scope="module")
def frontend() -> CosyVoice3TextFrontend:
    return CosyVoice3TextFrontend(BLANK_EN)


@pytest.mark.parity
def test_special_tokens_are_the_official_ones_in_order(frontend: CosyVoice3TextFrontend) -> None:
    assert list(SPECIAL_TOKENS) == OFFICIAL["additional_special_tokens"]
    assert len(CMU_PHONE_TOKENS) == 84 and len(PINYIN_TOKENS) == 176
    assert frontend.tokenizer.special_ids == OFFICIAL["special_token_ids"]
    assert frontend.tokenizer.special_ids[END_OF_SYSTEM] == 1020
    assert frontend.tokenizer.n_vocab == 1281
    # the released vocabulary: the same order after its 151643 BPE ids
    released = OFFICIAL["released_special_token_ids"]
    assert released["<|endofprompt|>"] == 151646 and released["[ǜ]"] == 151923


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(OFFICIAL["texts"]))
def test_ids_equal_the_official_tokenizer(frontend: CosyVoice3TextFrontend, name: str) -> None:
    case = OFFICIAL["texts"][name]
    ids = frontend.tokenizer.encode(case["text"])
    assert ids == case["token_ids"]
    assert frontend.tokenizer.decode(ids, skip_special=True) == case["decoded"]
    assert frontend.tokenizer.decode(ids) == case["decoded_keep_special"]


@pytest.mark.parity
def test_lm_case_texts_tokenise_as_official() -> None:
    meta = json.loads((DATA / "llm_cases.json").read_text())
    fx = torch.load(DATA / "llm_cases.pt", weights_only=True)
    tokenizer = CosyVoice3TextFrontend(BLANK_EN).tokenizer
    for case, info in meta["cases"].items():
        texts = info["texts"]
        assert tokenizer.encode(texts["text"]) == fx[f"{case}/in_text"][0].tolist()
        assert tokenizer.encode(texts["prompt_text"]) == fx[f"{case}/in_prompt_text"][0].tolist()


def _user_part(text: str) -> str:
    return text.removeprefix(SYSTEM)


def _model_input(frontend: CosyVoice3TextFrontend, mode: dict) -> dict[str, list[int]]:
    """What our frontend gives the LM for the user input of an official call."""
    args = mode["arguments"]
    (segment,) = frontend.segments(_user_part(args["tts_text"]))
    if mode["method"] == "inference_zero_shot":
        prompt = frontend.prompt_text_ids(_user_part(args["prompt_text"]))
        return {"prompt_text": prompt, "text": segment.token_ids}
    if mode["method"] == "inference_cross_lingual":
        return {"text": frontend.cross_lingual_text_ids(segment)}
    return {"prompt_text": frontend.instruct_ids(args["instruct_text"]), "text": segment.token_ids}


@pytest.mark.parity
def test_model_input_equals_the_official_assembly(frontend: CosyVoice3TextFrontend) -> None:
    """Zero-shot: system prompt + transcript as prompt text; cross-lingual: the system prompt
    before the text; instruct2: the instruction inside the system prompt, no prompt speech."""
    assert set(SAME_MODES + DIFFERENT_MODES) == set(OFFICIAL["modes"])
    for name in SAME_MODES + DIFFERENT_MODES:
        mode = OFFICIAL["modes"][name]
        (call,) = mode["model_calls"]  # one segment each
        ours = _model_input(frontend, mode)
        official = {key: call[key] for key in ours}
        if name in SAME_MODES:
            assert ours == official, name
        else:
            assert ours["text"] != official["text"], name
            assert ours.get("prompt_text") == official.get("prompt_text"), name
        assert ("llm_prompt_speech_token" in call) == (mode["method"] == "inference_zero_shot")


def test_every_request_carries_the_end_of_prompt(frontend: CosyVoice3TextFrontend) -> None:
    """The official LM refuses text without <|endofprompt|>: each assembly has exactly one."""
    eop = frontend.tokenizer.special_ids["<|endofprompt|>"]
    (segment,) = frontend.segments("Hello there.")
    for ids in (
        frontend.prompt_text_ids("A transcript."),
        frontend.cross_lingual_text_ids(segment),
        frontend.instruct_ids("Speak slowly."),
        frontend.system_prompt_ids(),
    ):
        assert ids.count(eop) == 1


@pytest.mark.parametrize(
    "text",
    [
        "Please call [M][AY1][K][AH0][L] now.",
        "高管也通过电话、短信、微信等方式对报道[j][ǐ]予好评。",
        "the[N][UW1]room and [T][AH0][M][EY1][T][OW2]es at 7.",
        "Set [HH][AH0][L][OW1] 2 times.",
    ],
)
def test_pronunciation_tokens_pass_normalisation_unchanged(
    frontend: CosyVoice3TextFrontend, text: str
) -> None:
    """Each typed phone or pinyin token stays one id (the normaliser would read [AY1] as
    [AYone]); the text around them is normalised as usual."""
    pronunciation = {frontend.tokenizer.special_ids[t] for t in CMU_PHONE_TOKENS + PINYIN_TOKENS}
    segments = frontend.segments(text)
    ids = [i for segment in segments for i in segment.token_ids]
    typed = [i for i in frontend.tokenizer.encode(text) if i in pronunciation]
    assert typed and [i for i in ids if i in pronunciation] == typed
    spoken = "".join(segment.text for segment in segments)
    for token in CMU_PHONE_TOKENS:
        spoken = spoken.replace(token, "")
    assert not any(digit in spoken for digit in "0123456789")  # read as words


def test_normalisation_still_applies_around_them(frontend: CosyVoice3TextFrontend) -> None:
    (segment,) = frontend.segments("Call [M][AY1][K] at 7 pm.")
    assert segment.text.startswith("Call [M][AY1][K] at seven")
    assert frontend.segments("[HH][AH0][L][OW1]")[0].text == "[HH][AH0][L][OW1]"
    # a private-use character typed by the user has no sound and cannot stand for a run
    assert frontend.segments("a\ue000b [K]")[0].text == "ab [K]."


def test_instruction_goes_inside_the_system_prompt(frontend: CosyVoice3TextFrontend) -> None:
    expected = frontend.tokenizer.encode(f"{SYSTEM_PROMPT} 请用广东话表达。<|endofprompt|>")
    for typed in (
        "请用广东话表达。",
        "请用广东话表达。<|endofprompt|>",
        f"{SYSTEM_PROMPT} 请用广东话表达。<|endofprompt|>",
    ):
        assert frontend.instruct_ids(typed) == expected, typed
    for empty in ("", " <|endofprompt|>", SYSTEM_PROMPT, "。"):
        with pytest.raises(TextInputError):
            frontend.instruct_ids(empty)


def test_cosyvoice2_frontend_on_the_same_folder_keeps_its_tokens() -> None:
    """Each family's tokenizer is its own: v2's does not know the pronunciation tokens."""
    v2 = CosyVoice2TextFrontend(BLANK_EN)
    v3 = CosyVoice3TextFrontend(BLANK_EN)
    assert v2.tokenizer is not v3.tokenizer
    assert len(v2.tokenizer.encode("[AA1]")) > 1 and len(v3.tokenizer.encode("[AA1]")) == 1
    assert v2.tokenizer.n_vocab == 1020
