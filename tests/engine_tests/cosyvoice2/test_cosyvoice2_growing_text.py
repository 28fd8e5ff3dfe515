"""A sentence's text ids committed as its text grows: the joined ids are the whole sentence's."""

from __future__ import annotations

import logging
import random
import re
from collections.abc import Callable

import pytest
from conftest import DATA

import engine.cosyvoice2.frontend as cosyvoice2_frontend
import engine.cosyvoice2.growing_text as growing_text
from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
from engine.cosyvoice2.growing_text import GrowingTextIds
from engine.text.errors import TextInputError
from engine.text.frontend import MAX_TEXT_CHARS
from engine.text.normalize import normalize, normalize_text

BLANK_EN = DATA / "cosyvoice2" / "tiny" / "CosyVoice-BlankEN"

ENGLISH = (
    "I've turned on the kitchen lights and set the thermostat to 21.5°C for you.",
    "Sure, I'll remind you at 7:30 am tomorrow to take out the trash.",
    "The living room is currently 22 degrees, and the humidity is at 45%.",
    "Your electricity bill this month is $42.75, which is about 10% lower than last month.",
    "Okay, the bedroom blinds will close at 9 pm tonight, and the porch light stays on.",
    "**Done!** I switched off all the lights on the ground floor except the hallway.",
    "You can find the manual [here](https://example.com/manual) if you need more details.",
    "See [the kitchen light manual](https://example.com/a) for the details please.",
    "[laughter] That's a good one, but I can't actually open the garage door without your PIN.",
    "The <strong>front door</strong> is locked and the alarm is armed in away mode.",
    "It's 3 pm in Tokyo right now, and the weather there is sunny with a high of 28°C.",
    "Dr. Smith's appointment is on March 5th, 2024 at 10:30 am in room 204.",
    "The washing machine finished its cycle 15 minutes ago, so don't forget to unload it.",
    "I've added milk, eggs, and bread to your shopping list, and removed the coffee beans.",
    "The garage door has been open for 2 hours; would you like me to close it now?",
    "Your package is expected to arrive between 2 and 4 pm on Friday, Jan 12.",
    "The air quality in the nursery is good, with CO2 at 650 ppm and PM2.5 at 8 µg/m³.",
    "The solar panels produced 12.4 kWh today, covering about 80% of the house's usage.",
    "Set a timer for 25 minutes: the lasagna should be ready at around 6:45.",
    "The temperature outside dropped to -3°C overnight, so the heating ran a bit longer.",
    "The sensor (the one in the hall way) is offline, and the e.g. backup is too.",
    "You can say **turn on the kitchen lights** to switch them on again.",
    "Use `turn on the lights` as the command when you ask next time.",
    "It’s quite warm today, isn’t it, my friend from the north?",
    "Okay,  double  spaced  words and a\u3000wide space are here as well.",
    "'Cause it's late, y'all should turn the lights off now.",
)
CHINESE = (
    "好的，客厅的灯已经打开了，空调设置为21.5°C。",
    "明天早上7:30，我会提醒你倒垃圾，别忘了带伞。",
    "现在室内温度是22度，湿度45%，空气质量良好。",
    "这个月的电费是42.75元，比上个月低了10%左右。",
    "**完成！**我已经关闭了一楼所有的灯，只留下了走廊灯。",
    "[laughter]这个笑话不错，不过我没法在没有密码的情况下打开车库门。",
    "<strong>前门</strong>已经上锁，警报系统处于离家模式。",
    "您的快递预计在2024年3月5日下午2点到4点之间送达，请注意查收。",
    "我已经把牛奶、鸡蛋和面包加入购物清单，并删除了咖啡豆。",
    "车库门已经开了2个小时；需要我现在关上吗？",
    "太阳能板今天发电12.4kWh，覆盖了家里大约80%的用电量。",
    "定一个25分钟的计时器：千层面大约在6:45就好了。",
    "提醒一下，后门传感器的电池电量低，请尽快更换（型号CR2032），谢谢！",
    "已为你打开living room的灯，亮度调到80%，色温3000K。",
    "你好,今天的天气不错,最高气温25度,适合出门散步!",
    "共计1,000元,请在3天内付款;时间:7:30,地点:客厅。",
    "选项有1、2、3，第1、第2和第3个房间的灯都关了。",
    "请拨打400-820-8820，或者发邮件到help@example.com。",
    "客厅灯——已经关闭，卧室灯——仍然开着，他说：“我马上回来！”",
    "今日は晴れ、2024年3月5日、明日も晴れです。",
    "真的吗？！太好了，他说“好的”，然后就走了。",
)
# Begun on the English path, then Han characters arrive: the whole sentence is Chinese.
MIXED = (
    "Turn on the lights in the 客厅 now, please and thanks.",
    "Play some music in the 书房 and the bedroom, at 30% volume.",
)
CORPUS = ENGLISH + CHINESE + MIXED


@pytest.fixture(scope="module")
def frontend() -> CosyVoice2TextFrontend:
    return CosyVoice2TextFrontend(BLANK_EN)


def _whole_ids(frontend: CosyVoice2TextFrontend, text: str) -> list[int]:
    segments = frontend.segments(text, split=False)
    return segments[0].token_ids if segments else []


def _feed(
    frontend: CosyVoice2TextFrontend, fragments: list[str], final: str | None = None
) -> tuple[list[int], list[int], GrowingTextIds]:
    """(ids out before finish, all ids, the committer) for ``fragments`` then ``finish``."""
    growing = GrowingTextIds(frontend)
    so_far, early = "", []
    for fragment in fragments:
        so_far += fragment
        early += growing.update(so_far)
    return early, early + growing.finish(so_far if final is None else final), growing


def _by_char(text: str, frontend: CosyVoice2TextFrontend) -> list[str]:
    return list(text)


def _by_word(text: str, frontend: CosyVoice2TextFrontend) -> list[str]:
    return re.findall(r"\S+\s*|\s+", text)


def _by_token(text: str, frontend: CosyVoice2TextFrontend) -> list[str]:
    """As an LLM streams: one BPE token at a time."""
    offsets = frontend.tokenizer.tokenizer.encode(text, add_special_tokens=False).offsets
    bounds = sorted({0, len(text), *(end for _, end in offsets)})
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def _random(seed: int) -> Callable[[str, CosyVoice2TextFrontend], list[str]]:
    def split(text: str, frontend: CosyVoice2TextFrontend) -> list[str]:
        rng = random.Random(seed)
        bounds = sorted({0, len(text), *rng.sample(range(1, len(text)), len(text) // 5)})
        return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]

    return split


def _whole(text: str, frontend: CosyVoice2TextFrontend) -> list[str]:
    return [text]


FRAGMENTATIONS = {
    "char": _by_char,
    "word": _by_word,
    "token": _by_token,
    "random1": _random(1),
    "random2": _random(2),
    "whole": _whole,
}


@pytest.mark.parametrize("how", FRAGMENTATIONS)
def test_joined_ids_equal_the_whole_sentence(frontend: CosyVoice2TextFrontend, how: str) -> None:
    assert len(ENGLISH) >= 25 and len(CHINESE) >= 20
    for text in CORPUS:
        fragments = FRAGMENTATIONS[how](text, frontend)
        assert "".join(fragments) == text
        _, ids, growing = _feed(frontend, fragments)
        assert ids == _whole_ids(frontend, text), text
        assert growing.exact, text


def test_most_of_a_plain_english_sentence_is_out_before_its_end(
    frontend: CosyVoice2TextFrontend,
) -> None:
    text = "Please turn off the lights in the kitchen and close the blinds."
    words = text.split(" ")
    assert len(words) == 12
    early, ids, _ = _feed(frontend, _by_word(text, frontend))
    eight_words = frontend.tokenizer.encode(" ".join(words[:8]))
    assert early[: len(eight_words)] == eight_words
    assert len(early) > len(eight_words)
    assert ids == _whole_ids(frontend, text)


def test_a_chinese_sentence_is_committed_clause_by_clause(
    frontend: CosyVoice2TextFrontend,
) -> None:
    text = "好的，客厅的灯已经打开了，空调设置为二十六度。"
    growing = GrowingTextIds(frontend)
    assert growing.update("好的") == []  # no clause mark yet
    first = growing.update("好的，客厅的灯")
    assert frontend.tokenizer.decode(first) == "好的"
    second = growing.update("好的，客厅的灯已经打开了，空调")
    assert frontend.tokenizer.decode(second) == "，客厅的灯已经打开了"
    rest = growing.finish(text)
    assert first + second + rest == _whole_ids(frontend, text)


def test_a_run_of_marks_is_not_cut(frontend: CosyVoice2TextFrontend) -> None:
    """Qwen2 pre-tokenises a run of marks as one piece (the full vocabulary merges some)."""
    pre_tokens = frontend.tokenizer.tokenizer.pre_tokenizer.pre_tokenize_str("吗？！太”，然")
    assert [span for _, span in pre_tokens] == [(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)]
    growing = GrowingTextIds(frontend)
    assert frontend.tokenizer.decode(growing.update("真的吗？！太好了")) == "真的吗"
    assert growing.update("真的吗？！太好了，他说“好的”，然后") == frontend.tokenizer.encode(
        "？！太好了"
    )


def test_cuts_wait_for_the_next_word_and_for_closed_brackets(
    frontend: CosyVoice2TextFrontend,
) -> None:
    def ids(piece: str) -> list[int]:
        return frontend.tokenizer.encode(" " + normalize_text(piece)[0])

    growing = GrowingTextIds(frontend)
    assert growing.update("Turn on") == []  # "on" may still grow
    assert growing.update("Turn on the") == frontend.tokenizer.encode("Turn")
    assert growing.update("Turn on the 21") == ids("on")  # not before a word with digits
    text = "Turn on the 21 degree heater (the one in the hall) now"
    assert growing.update(text) == ids("the 21 degree")  # nothing inside the brackets
    assert growing.update(text + " please ") == ids("heater (the one in the hall) now")


def test_updates_normalise_only_the_new_pieces(
    frontend: CosyVoice2TextFrontend, monkeypatch: pytest.MonkeyPatch
) -> None:
    normalised: list[str] = []
    wholes: list[str] = []

    def counting_normalize_text(text: str, **kwargs: object) -> tuple[str, bool]:
        normalised.append(text)
        return normalize_text(text, **kwargs)  # type: ignore[arg-type]

    segments = frontend.segments

    def counting_segments(text: str, **kwargs: object) -> list:
        wholes.append(text)
        return segments(text, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cosyvoice2_frontend, "normalize_text", counting_normalize_text)
    monkeypatch.setattr(frontend, "segments", counting_segments)
    for text in (ENGLISH[0], CHINESE[0]):
        normalised.clear()
        wholes.clear()
        early, ids, _ = _feed(frontend, list(text))
        assert early and ids == _whole_ids(frontend, text)
        assert "".join(normalised) == text[: len("".join(normalised))]  # each char once
        assert wholes == [text, text]  # finish, then this test's own check


def test_empty_and_blank_fragments_change_nothing(frontend: CosyVoice2TextFrontend) -> None:
    text = "  Turn off the lights in the kitchen, please."
    fragments = ["", "  ", "", "Turn ", "", "off the ", " " * 0, "lights in", "", " the kitchen,"]
    fragments += ["", " please.", ""]
    early, ids, growing = _feed(frontend, fragments)
    assert early and ids == _whole_ids(frontend, text) and growing.exact
    blank = GrowingTextIds(frontend)
    assert blank.update("") == [] and blank.update("   ") == []


def test_finish_with_nothing_committed(frontend: CosyVoice2TextFrontend) -> None:
    for text in (ENGLISH[1], CHINESE[1], "Hi."):
        growing = GrowingTextIds(frontend)
        assert growing.finish(text) == _whole_ids(frontend, text)
        assert growing.exact


def test_a_sentence_with_nothing_to_say(frontend: CosyVoice2TextFrontend) -> None:
    growing = GrowingTextIds(frontend)
    assert growing.update("… !!! ") == []
    assert growing.finish("… !!! 😀") == []
    assert growing.exact


def test_a_rewritten_sentence_keeps_its_promise_when_the_ids_still_match(
    frontend: CosyVoice2TextFrontend,
) -> None:
    """The splitter collapsed a double space: the raw text differs, the ids do not."""
    growing = GrowingTextIds(frontend)
    early = growing.update("Turn on  the kitchen lights ")
    assert early
    final = "Turn on the kitchen lights now."
    assert early + growing.finish(final) == _whole_ids(frontend, final)
    assert growing.exact


def test_a_diverging_sentence_is_flagged_not_fatal(
    frontend: CosyVoice2TextFrontend, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=growing_text.__name__)
    growing = GrowingTextIds(frontend)
    early = growing.update("Turn on the kitchen lights and ")
    assert frontend.tokenizer.decode(early) == "Turn on the kitchen lights"
    final = "Turn off the bedroom lamp."
    rest = growing.finish(final)
    assert not growing.exact
    whole = _whole_ids(frontend, final)
    assert rest == whole[len(early) :]
    assert len(caplog.records) == 1
    # Everything committed is already said: nothing is repeated.
    shorter = GrowingTextIds(frontend)
    assert shorter.update("Turn on the kitchen lights and ")
    assert shorter.finish("Turn on the") == [] and not shorter.exact


def test_a_path_that_turns_out_wrong_continues_with_the_rest(
    frontend: CosyVoice2TextFrontend,
) -> None:
    """Kana arrive after a clause without them: its number was read as Chinese. The rest
    follows the committed text without repeating it."""
    growing = GrowingTextIds(frontend)
    early = growing.update("東京2024年3月5日、")
    assert frontend.tokenizer.decode(early) == "東京二零二四年三月五日"
    rest = growing.finish("東京2024年3月5日、明日は晴れです。")
    assert not growing.exact
    assert frontend.tokenizer.decode(early + rest) == "東京二零二四年三月五日、明日は晴れです。"


def test_japanese_numbers_wait_for_a_piece_with_kana(frontend: CosyVoice2TextFrontend) -> None:
    """After kana, a clause with digits but no kana would be read as Chinese alone."""
    growing = GrowingTextIds(frontend)
    assert growing.update("今日は晴れ、") != []
    assert growing.update("今日は晴れ、2024年3月5日、") == []
    assert growing.update("今日は晴れ、2024年3月5日、明日も晴れ。") != []


def test_bad_text_is_refused(frontend: CosyVoice2TextFrontend) -> None:
    growing = GrowingTextIds(frontend)
    with pytest.raises(TextInputError):
        growing.update(None)  # type: ignore[arg-type]
    with pytest.raises(TextInputError):
        growing.update("a " * (MAX_TEXT_CHARS // 2 + 1))
    growing.finish("Done.")
    with pytest.raises(RuntimeError):
        growing.update("Done. More")


def test_normalisation_can_be_forced_onto_a_path() -> None:
    """A piece keeps its sentence's path: "，7:30" of a Chinese sentence is read in Chinese."""
    assert normalize_text("，7:30") == ("，seven thirty", False)
    assert normalize_text("，7:30", chinese=True) == ("，七点三十分", True)
    assert normalize_text("打开 living room", chinese=False)[1] is False
    assert normalize("，7:30", split=False, chinese=True) == ["，七点三十分"]
    assert normalize("42", split=False) == normalize("42", split=False, chinese=None)
