"""Sentence splitting: the official whole-text split and the incremental splitter."""

from __future__ import annotations

import json

import pytest
from conftest import DATA
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.text.segment import IncrementalSplitter, split_paragraph, split_sentences
from engine.text.tokenizer import get_tokenizer

FIXTURE = json.loads((DATA / "text_frontend.json").read_text("utf-8"))


def _token_len(text: str) -> int:
    return len(get_tokenizer().encode(text))


@pytest.mark.parametrize(
    ("name", "lang"), [("long_zh_for_split", "zh"), ("long_en_for_split", "en")]
)
def test_split_paragraph_matches_fixture(name: str, lang: str) -> None:
    example = next(e for e in FIXTURE["examples"] if e["name"] == name)
    expected = example["normalized"]["head_wetext_0.1.8"]["split_true"]
    assert split_paragraph(example["text"].strip(), _token_len, lang) == expected


def test_split_paragraph_rules() -> None:
    assert split_paragraph("你好", _token_len, "zh") == ["你好。"]
    assert split_paragraph("Hi there", _token_len, "en") == ["Hi there."]
    # a closing quote stays with its sentence
    assert split_paragraph('他说"好的。"然后走了', _token_len, "zh", token_max_n=5, token_min_n=2,
                           merge_len=1) == ['他说"好的。"', "然后走了。"]  # fmt: skip
    # short tail is merged into the previous segment
    text = "一" * 70 + "。" + "二" * 30 + "。" + "三" * 5 + "。"
    assert split_paragraph(text, _token_len, "zh") == [
        "一" * 70 + "。",
        "二" * 30 + "。三三三三三。",
    ]


STREAM_CASES = [
    ("Mr. Smith went to the U.S. last year. He paid $3.5 for it! Really? yes.",
     ["Mr. Smith went to the U.S. last year.", "He paid $3.5 for it!", "Really? yes."]),
    ("好的!我来。你好。。。第二句？", ["好的!", "我来。", "你好。。。", "第二句？"]),
    ("第一行\n- 第二行\n\nthird line", ["第一行", "- 第二行", "third line"]),
    ('He said "Stop." Then he left.', ['He said "Stop."', "Then he left."]),
    ("It is 3.5 degrees. Take e.g. this one. Dr. Who.",
     ["It is 3.5 degrees.", "Take e.g. this one.", "Dr. Who."]),
    ("see you. then", ["see you. then"]),
    ("...   😀\n 。", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "expected"), STREAM_CASES)
def test_split_sentences(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_sentence_emitted_as_soon_as_complete() -> None:
    sp = IncrementalSplitter()
    assert sp.feed("今天天气很好") == []
    assert sp.feed("。明天") == ["今天天气很好。"]
    assert sp.feed("下雨。") == []  # "。" could still be followed by "」" or "！"
    assert sp.feed("Hello") == ["明天下雨。"]
    assert sp.feed(" world. ") == []  # needs the next sentence's first letter
    assert sp.feed("Bye") == ["Hello world."]
    assert sp.flush() == ["Bye"]
    assert sp.flush() == []


def test_long_sentences_are_cut_at_commas_then_spaces() -> None:
    text = "这是一个很长的句子，" * 20
    parts = split_sentences(text, max_chars=50)
    assert all(len(p) <= 50 for p in parts) and all(p.endswith("，") for p in parts)
    assert "".join(parts) == text
    words = "word " * 100
    parts = split_sentences(words, max_chars=40)
    assert all(len(p) <= 40 for p in parts) and " ".join(parts) == words.strip()
    assert split_sentences("x" * 95, max_chars=40) == ["x" * 40, "x" * 40, "x" * 15]


_ALPHABET = st.sampled_from(
    list('abcXYZ 。！？；，,.!?:;\n"”)”3')
    + ["Mr.", "U.S.", "3.5", "你好", "e.g.", " The", "…", "😀"]
)
_TEXTS = st.lists(_ALPHABET, max_size=80).map("".join)


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=20),
       max_chars=st.integers(min_value=8, max_value=60))  # fmt: skip
def test_incremental_equals_whole_text(text: str, cuts: list[int], max_chars: int) -> None:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    sp = IncrementalSplitter(max_chars=max_chars)
    got: list[str] = []
    for a, b in zip(points, points[1:], strict=False):
        got += sp.feed(text[a:b])
    got += sp.flush()
    assert got == split_sentences(text, max_chars=max_chars)
    assert all(len(s) <= max_chars for s in got)


@settings(max_examples=100, deadline=None)
@given(text=_TEXTS)
def test_char_by_char_equals_whole_text(text: str) -> None:
    sp = IncrementalSplitter(max_chars=30)
    got = [s for ch in text for s in sp.feed(ch)] + sp.flush()
    assert got == split_sentences(text, max_chars=30)


def test_invalid_max_chars() -> None:
    with pytest.raises(ValueError):
        IncrementalSplitter(max_chars=1)
