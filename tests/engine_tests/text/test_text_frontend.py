"""TextFrontend API, garbage input, thread safety and the debugging CLI."""

from __future__ import annotations

import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.text.cli import main as cli_main
from engine.text.frontend import MAX_TEXT_CHARS, Segment, TextFrontend, TextInputError
from engine.text.tokenizer import get_tokenizer

ENDOFPROMPT_IDS = [27, 521, 2670, 28722, 662, 29]


@pytest.fixture(scope="module")
def frontend() -> TextFrontend:
    return TextFrontend()


def test_segments_carry_token_ids(frontend: TextFrontend) -> None:
    segs = frontend.segments("你好，世界！")
    assert segs == [Segment("你好，世界！", [26410, 171, 120, 234, 24486, 171, 120, 223])]
    with pytest.raises(AttributeError):
        segs[0].text = "x"  # type: ignore[misc]  # frozen


def test_language_tags_on_every_segment() -> None:
    fe = TextFrontend(language_tags=True)
    segs = fe.segments("Hello there. " * 60)
    assert len(segs) > 1 and all(s.text.startswith("<|en|>") for s in segs)
    assert all(s.token_ids[0] == 50259 for s in segs)


def test_a_sentence_split_by_the_caller_stays_one_segment(frontend: TextFrontend) -> None:
    text = "Hello there, this is a long sentence. " * 30
    assert len(frontend.segments(text)) > 1
    (whole,) = frontend.segments(text, split=False)
    assert whole.token_ids == frontend.tokenizer.encode(whole.text)


def test_a_language_given_by_the_caller_tags_the_segments() -> None:
    fe = TextFrontend(language_tags=True)
    (seg,) = fe.segments("Hello there.", language="zh")
    assert seg.text.startswith("<|zh|>")


def test_instruct_ids_append_v1_suffix(frontend: TextFrontend) -> None:
    ids = frontend.instruct_ids("A happy girl, speaking at 2x speed")
    assert ids[-6:] == ENDOFPROMPT_IDS
    assert get_tokenizer().decode(ids) == "A happy girl, speaking at two times speed<endofprompt>"
    # a suffix typed by the user (either spelling) is replaced, not doubled
    for typed in ("Theo is angry.<|endofprompt|>", "Theo is angry.<endofprompt>"):
        assert frontend.instruct_ids(typed) == frontend.instruct_ids("Theo is angry.")
    with pytest.raises(TextInputError):
        frontend.instruct_ids("  <|endofprompt|> ")


def test_prompt_text_ids_unsplit(frontend: TextFrontend) -> None:
    text = "希望你以后能够做的比我还好呦。" * 8
    ids = frontend.prompt_text_ids(text)
    assert get_tokenizer().decode(ids) == text
    assert frontend.prompt_text_ids("   ") == []


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \t\n ",
        "...!!!",
        "。，、？",
        "😀😀🎉",
        "\ud800\udfff",
        "\x00\x01\x1b[0m\x7f",
        "\u200b\ufeff",
    ],
    ids=[
        "empty",
        "whitespace",
        "punct",
        "zh-punct",
        "emoji",
        "surrogates",
        "controls",
        "zero-width",
    ],
)
def test_garbage_gives_no_segments(frontend: TextFrontend, text: str) -> None:
    assert frontend.segments(text) == []


def test_garbage_mixed_with_text_keeps_the_words(frontend: TextFrontend) -> None:
    segs = frontend.segments("a\ud800b\x00 costs $5\x07 😀")
    assert [s.text for s in segs] == ["ab costs five dollars."]


def test_very_long_text_is_refused_clearly(frontend: TextFrontend) -> None:
    with pytest.raises(TextInputError, match="limit"):
        frontend.segments("今天天气很好。" * 15_000)  # ~100 KB
    with pytest.raises(TextInputError, match="string"):
        frontend.segments(None)  # type: ignore[arg-type]


def test_long_text_gives_bounded_segments(frontend: TextFrontend) -> None:
    text = "今天天气很好，气温25度，湿度45%。" * 100 + "The temperature is 21.5°C. " * 10
    segs = frontend.segments(text)
    assert len(segs) > 20
    assert all(len(s.text) <= 120 for s in segs)
    assert "25" not in "".join(s.text for s in segs)
    assert len(text) < MAX_TEXT_CHARS


def test_threads_get_identical_results(frontend: TextFrontend) -> None:
    texts = ["明天早上7:30提醒我", "The temperature is 21.5°C.", "您的订单#A123已经发货。"]
    expected = {t: frontend.segments(t) for t in texts}
    errors: list[BaseException] = []

    def work() -> None:
        try:
            for _ in range(10):
                for t in texts:
                    assert frontend.segments(t) == expected[t]
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["明天早上7:30提醒我", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "segments": [
            {
                "text": "明天早上七点三十分提醒我。",
                "token_ids": get_tokenizer().encode("明天早上七点三十分提醒我。"),
            }
        ]
    }


def test_cli_text_and_empty(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["Hello 5"]) == 0
    assert "Hello five." in capsys.readouterr().out
    assert cli_main(["..."]) == 0
    assert "nothing to say" in capsys.readouterr().out
    assert cli_main(["Be calm<|endofprompt|>", "--instruct", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["segments"][0]["token_ids"][-6:] == ENDOFPROMPT_IDS


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=60))
def test_random_text_never_raises_library_errors(text: str) -> None:
    fe = TextFrontend()
    for seg in fe.segments(text):
        assert seg.text.strip() and seg.token_ids
        assert max(seg.token_ids) < 51866
