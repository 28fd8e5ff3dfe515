"""Pronunciation lines: how an entry is read (CMU phones, pinyin, respelling), what is refused
and why, how a model with or without phone tokens applies them, and v1's frontend with them."""

from __future__ import annotations

import pytest

from engine.text.frontend import TextFrontend
from engine.text.pronunciations import (
    CMU_PHONE_TOKENS,
    PINYIN_TOKENS,
    PronunciationError,
    Pronunciations,
    read_entry,
    read_line,
)


@pytest.mark.parametrize(
    ("entry", "tokens"),
    [
        ("M AY1 K AH0 L", "[M][AY1][K][AH0][L]"),
        ("  SH IH0  V AO1 N ", "[SH][IH0][V][AO1][N]"),
        ("M AY K AH L", "[M][AY][K][AH][L]"),  # bare vowels are tokens too
        ("zhang1 san1", "[zh][āng][s][ān]"),
        ("zhāng sān", "[zh][āng][s][ān]"),
        ("ji3", "[j][ǐ]"),  # the official example's 给 as 给予's [j][ǐ]
        ("lv4 nve4 lü3 nu:3", "[l][ǜ][n][vè][l][ǚ][n][ǚ]"),  # ü as v, ü or u:
        ("yue4 liu2 gui4 shui3 xiang1", "[y][uè][l][iú][g][uì][sh][uǐ][x][iāng]"),
        ("er2 ai4 ou1", "[ér][ài][ōu]"),  # no initial
        ("de5 ma0", "[d][e][m][a]"),  # neutral tone: the bare final
        ("Zhang1 San1", "[zh][āng][s][ān]"),
    ],
)
def test_phones_and_pinyin_become_the_models_tokens(entry: str, tokens: str) -> None:
    read = read_entry("word", entry)
    assert (read.tokens, read.respelling) == (tokens, None)
    every = set(CMU_PHONE_TOKENS + PINYIN_TOKENS)
    assert all(f"[{t}" in every for t in tokens.split("[")[1:])


@pytest.mark.parametrize(
    ("entry", "respelling"),
    [("Mykul", "Mykul"), ("shi  vawn", "shi vawn"), ("Dee-ah", "Dee-ah"), ("OK", "OK")],
)
def test_other_text_is_a_respelling(entry: str, respelling: str) -> None:
    assert read_entry("word", entry).tokens is None
    assert read_entry("word", entry).respelling == respelling


def test_phones_then_a_respelling() -> None:
    read = read_line("Siobhan = SH IH0 V AO1 N | Shivawn")
    assert (read.word, read.tokens, read.respelling) == ("Siobhan", "[SH][IH0][V][AO1][N]",
                                                          "Shivawn")  # fmt: skip
    assert read.spoken_as(phone_tokens=True) == "[SH][IH0][V][AO1][N]"
    assert read.spoken_as(phone_tokens=False) == "Shivawn"


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("Michael = M AX0 K AH0 L", "AX0 is not a CMU phone"),
        ("Michael = M AY4 K AH0 L", "AY4 is not a CMU phone"),
        ("Michael = M AY1 Q AH0 LL", "Q, LL are not CMU phones"),
        ("张三 = zhang6 san1", "tone 6"),
        ("张三 = zhāng1", "a tone mark and a tone digit"),
        ("张三 = zhong3 xq1", "no final"),
        ("张三 = lü1", "no token for 'ǖ'"),  # the tokenizer has ǘ ǚ ǜ only
        ("Michael M AY1 K AH0 L", "no '='"),
        (" = M AY1", "no word before '='"),
        ("Michael = ", "no pronunciation after '='"),
        ("Michael = M AY1 |", "nothing after '|'"),
        ("Michael = Mykul | Mikey", "neither CMU phones"),
    ],
)
def test_a_line_no_model_can_read_says_why(line: str, problem: str) -> None:
    with pytest.raises(PronunciationError, match=problem):
        read_line(line)
    for phone_tokens in (True, False):
        (check,) = Pronunciations([line], phone_tokens=phone_tokens).checks
        assert check.spoken_as is None and check.problem is not None
        assert problem in check.problem
        assert check.message().startswith(f"pronunciation {line.strip()!r} is not applied: ")


def test_a_model_without_phone_tokens_needs_a_respelling() -> None:
    lines = ["Michael = M AY1 K AH0 L", "Siobhan = SH IH0 V AO1 N | Shivawn", "Niamh = Neev"]
    without = Pronunciations(lines, phone_tokens=False)
    (problem,) = without.problems
    assert problem.word == "Michael" and "add a respelling" in str(problem.problem)
    assert without.apply("Michael, Siobhan and Niamh.") == "Michael, Shivawn and Neev."
    with_tokens = Pronunciations(lines, phone_tokens=True)
    assert not with_tokens.problems
    assert with_tokens.apply("Michael, Siobhan and Niamh.") == (
        "[M][AY1][K][AH0][L], [SH][IH0][V][AO1][N] and Neev."
    )


def test_whole_words_in_any_case() -> None:
    names = Pronunciations(["Michael = Mykul", "living room = lounge"], phone_tokens=False)
    text = "MICHAEL, michael's michaela Michaels; the Living   Room and livingroom."
    assert names.apply(text) == "Mykul, Mykul's michaela Michaels; the lounge and livingroom."


def test_a_chinese_name_matches_between_other_characters() -> None:
    names = Pronunciations(["张三 = zhang1 san1", "Li = lee"], phone_tokens=True)
    assert names.apply("请张三到客厅。Li说LiLi") == "请[zh][āng][s][ān]到客厅。lee说LiLi"


def test_a_longer_entry_wins_and_a_later_line_replaces_an_earlier() -> None:
    names = Pronunciations(
        ["Anne = Ann", "Anne Marie = Ann Maree", "Anne = Anna"], phone_tokens=False
    )
    assert names.apply("Anne Marie and Anne") == "Ann Maree and Anna"
    assert [c.problem for c in names.checks] == [None, None, None]


def test_no_lines_leave_the_text_as_it_is() -> None:
    assert Pronunciations().apply("Michael [AY1]") == "Michael [AY1]"
    assert Pronunciations(["bad line"]).apply("bad line") == "bad line"


def test_v1_frontend_speaks_the_respelling() -> None:
    frontend = TextFrontend()
    checks = frontend.use_pronunciations(["Siobhan = SH IH0 V AO1 N | Shivawn", "Niamh = N IY1 V"])
    assert [c.problem is None for c in checks] == [True, False]
    try:
        (segment,) = frontend.segments("Siobhan and Niamh are home.")
        (respelled,) = TextFrontend().segments("Shivawn and Niamh are home.")
        assert segment == respelled
    finally:
        frontend.use_pronunciations([])
