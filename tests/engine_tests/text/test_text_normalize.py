"""Normalisation: parity with the official HEAD + wetext 0.1.8 frontend, our documented
improvements, and a table of realistic smart-home / customer-service sentences."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import DATA, ROOT

from engine.text.normalize import detect_language, normalize
from engine.text.numbers import en_cardinal, zh_cardinal

FIXTURE = json.loads((DATA / "text_frontend.json").read_text("utf-8"))
EXAMPLES = {e["name"]: e for e in FIXTURE["examples"]}
REFERENCE = "head_wetext_0.1.8"

# Deliberate differences from the reference, each with the reason and our output.
IMPROVEMENTS: dict[str, tuple[str, list[str]]] = {
    "en_numbers": (
        "wetext 0.1.8 drops the leading 'one' of $1,234.56; money is read as dollars and cents",
        [
            "I have twenty five apples and three point five oranges, and I paid one thousand "
            "two hundred thirty four dollars and fifty six cents on the fourteenth of march "
            "twenty twenty five at ten thirty AM."
        ],
    ),
    "mixed_phone_email": (
        "'.'->'。' turned the e-mail domain into a sentence end; e-mails are read 艾特/点",
        ["请拨打四零零八二零八八二零或发邮件到test艾特example点com咨询。"],
    ),
    "instruct_endofprompt": (
        "upstream's current code skips normalisation when '<|'...'|>' occurs; v1-era code "
        "normalised and added the final '.', we protect the tag and do the same",
        [
            "Theo 'Crimson', is a fiery, passionate rebel leader. Fights with fervor for "
            "justice, but struggles with impulsiveness.<|endofprompt|>."
        ],
    ),
    "whisper_special_lang_tokens": (
        "same as above: tags are protected, the text is normalised (matches pre-2025 output)",
        ["<|zh|>你好<|en|>hello<|yue|>。"],
    ),
    "whisper_endoftext": ("same as above", ["end<|endoftext|>."]),
    "brackets_dash_zh": (
        "the official ' - ' -> '，' rule never fires (replace_blank removes the spaces "
        "first); we apply it before, as intended",
        ["注意这是 一个测试，对吧。"],
    ),
    "emoji": (
        "emoji have no reading; their byte-level BPE pieces are removed",
        ["Emoji test, café naïve."],
    ),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_fixture_segments(name: str) -> None:
    ref = EXAMPLES[name]["normalized"][REFERENCE]
    got = normalize(EXAMPLES[name]["text"])
    if name in IMPROVEMENTS:
        reason, expected = IMPROVEMENTS[name]
        assert got != ref["split_true"], f"no longer an improvement: {reason}"
        assert got == expected, reason
    else:
        assert got == ref["split_true"]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_fixture_unsplit(name: str) -> None:
    ref = EXAMPLES[name]["normalized"][REFERENCE]
    got = normalize(EXAMPLES[name]["text"], split=False)
    if name == "only_punct":
        assert got == []  # deliberate: nothing speakable -> no text (HEAD returns "...!!!")
    elif name in IMPROVEMENTS:
        # split=False has no final punctuation added by the splitter.
        expected = IMPROVEMENTS[name][1][0]
        assert got[0] in (expected, expected[:-1])
    else:
        assert got == [ref["split_false"]]


def test_improvements_listed_in_docs() -> None:
    doc = (ROOT / "docs" / "text-normalisation.md").read_text("utf-8")
    for name in IMPROVEMENTS:
        assert name in doc


SENTENCES: list[tuple[str, str]] = [
    # Chinese: times, dates, temperatures, percentages, money, phones, units, codes
    ("明天早上7:30提醒我", "明天早上七点三十分提醒我。"),
    ("把客厅空调调到21.5°C", "把客厅空调调到二十一点五摄氏度。"),
    ("现在室温是25℃，湿度45%。", "现在室温是二十五摄氏度，湿度百分之四十五。"),
    ("您的订单将于2026-12-03送达。", "您的订单将于二零二六年十二月三日送达。"),
    ("本月电费是¥128.50，比上月少了12%。", "本月电费是一百二十八元五角，比上月少了百分之十二。"),
    (
        "这款耳机售价$199，折合人民币约1400元。",
        "这款耳机售价一百九十九美元，折合人民币约一千四百元。",
    ),
    ("欧洲站价格是€49.99。", "欧洲站价格是四十九点九九欧元。"),
    ("请拨打客服热线400-820-8820。", "请拨打客服热线四零零八二零八八二零。"),
    ("我的手机号是13812345678。", "我的手机号是幺三八幺二三四五六七八。"),
    ("国际用户请拨打+86 138 1234 5678。", "国际用户请拨打加八六幺三八幺二三四五六七八。"),
    ("您咨询的iPhone15 Pro壳子有现货。", "您咨询的iPhone十五Pro壳子有现货。"),
    ("这台RTX4090显卡明天发货。", "这台RTX四零九零显卡明天发货。"),
    ("您的订单#A123已经发货。", "您的订单A一二三已经发货。"),
    ("您的快递单号是SF1234567890。", "您的快递单号是SF一二三四五六七八九零。"),
    ("卧室灯的亮度已调到70%。", "卧室灯的亮度已调到百分之七十。"),
    ("这个灯泡的功率是100W。", "这个灯泡的功率是一百瓦。"),
    ("今天用电5kWh，电压220V。", "今天用电五千瓦时，电压两百二十伏。"),
    ("PM2.5指数是35，空气质量优。", "PM二点五指数是三十五，空气质量优。"),
    ("固件已升级到2.0.1版本。", "固件已升级到二点零点一版本。"),
    ("第2代智能音箱已经上市。", "第二代智能音箱已经上市。"),
    ("预计3~5天送达。", "预计三到五天送达。"),
    ("会议定在下午3点。", "会议定在下午三点。"),
    ("闹钟设置在23:59。", "闹钟设置在二十三点五十九分。"),
    ("这是一个5G网络。", "这是一个五G网络。"),
    ("包裹重2.5kg，长30cm。", "包裹重二点五千克，长三十厘米。"),
    ("充电宝容量是10000mAh。", "充电宝容量是一万毫安时。"),
    ("如有疑问请发邮件到service@example.com。", "如有疑问请发邮件到service艾特example点com。"),
    ("优惠活动截止到12月31日。", "优惠活动截止到十二月三十一日。"),
    ("今年是2026年。", "今年是二零二六年。"),
    ("您的积分是1,250分。", "您的积分是一千二百五十分。"),
    # Chinese: LLM markdown and emoji
    ("**温馨提示**：请在*24小时*内完成支付。", "温馨提示：请在二十四小时内完成支付。"),
    ("## 今日天气\n- 温度：18°C\n- 湿度：60%", "今日天气。温度：十八摄氏度。湿度：百分之六十。"),
    ("步骤如下：\n1. 打开App\n2) 点击设置", "步骤如下：打开App。点击设置。"),
    ("好的😊，已经为您打开客厅的灯💡", "好的，已经为您打开客厅的灯。"),
    # mixed zh/en
    (
        "我想订一张3月5日去上海的机票，预算¥800以内。",
        "我想订一张三月五日去上海的机票，预算八百元以内。",
    ),
    ("帮我把Living Room的灯调到50%", "帮我把Living Room的灯调到百分之五十。"),
    ("Hey Siri，明天7:00叫我起床", "Hey Siri，明天七点叫我起床。"),
    # English
    ("The temperature is 21.5°C.", "The temperature is twenty one point five degrees Celsius."),
    ("Set the thermostat to 72°F.", "Set the thermostat to seventy two degrees Fahrenheit."),
    ("Remind me at 7:30 tomorrow morning.", "Remind me at seven thirty tomorrow morning."),
    (
        "Your order #A123 ships on 2026-12-03.",
        "Your order number A one two three ships on the third of december twenty twenty six.",
    ),
    ("The meeting is at 14:00.", "The meeting is at two PM."),
    (
        "Your bill is $1,234.56 this month.",
        "Your bill is one thousand two hundred thirty four dollars and fifty six cents this month.",
    ),
    ("That costs $0.99.", "That costs ninety nine cents."),
    ("It costs €5 per month.", "It costs five euros per month."),
    ("The ticket costs £12.50.", "The ticket costs twelve pounds and fifty pence."),
    ("The living room humidity is 45%.", "The living room humidity is forty five percent."),
    ("Battery at 85%, please charge soon.", "Battery at eighty five percent, please charge soon."),
    ("Call us at 555-123-4567.", "Call us at five five five, one two three, four five six seven."),
    (
        "Call +1 650 253 0000 for support.",
        "Call plus one, six five zero, two five three, zero zero zero zero for support.",
    ),
    ("The new iPhone15 Pro is in stock.", "The new iPhone fifteen Pro is in stock."),
    (
        "The bulb uses 9 W and gives 800 lm.",
        "The bulb uses nine watts and gives eight hundred lumens.",
    ),
    (
        "Firmware version 2.0.1 is available.",
        "Firmware version two point zero point one is available.",
    ),
    ("PM2.5 levels are 35 today.", "PM two point five levels are thirty five today."),
    ("Delivery takes 3~5 days.", "Delivery takes three to five days."),
    ("Mr. Smith will arrive at 5 p.m.", "Mister Smith will arrive at five PM."),
    ("Your total is 1,000 points.", "Your total is one thousand points."),
    (
        "The garage door has been open for 15 minutes.",
        "The garage door has been open for fifteen minutes.",
    ),
    (
        "Your order number is 12345678.",
        "Your order number is one two three four five six seven eight.",
    ),
    ("Email us at support@example.com.", "Email us at support at example dot com."),
    ("The washer finished at 9:45 PM.", "The washer finished at nine forty five PM."),
    ("Turn the volume to 30 percent.", "Turn the volume to thirty percent."),
    # English: LLM markdown and emoji
    ("**Note:** the door is *unlocked*.", "Note: the door is unlocked."),
    ("# Summary\n- Lights are off\n- Door is locked", "Summary. Lights are off. Door is locked."),
    (
        "Here is the plan:\n1. Turn off the lights\n2. Lock the door\n\n**Done!**",
        "Here is the plan: Turn off the lights. Lock the door. Done!",
    ),
    ("Good morning! ☀️ Have a great day 😀", "Good morning! Have a great day."),
    ("See [the manual](https://example.com/m) for details.", "See the manual for details."),
]


def test_table_is_large_enough() -> None:
    assert len(SENTENCES) >= 60


@pytest.mark.parametrize(("text", "expected"), SENTENCES, ids=[s[0][:30] for s in SENTENCES])
def test_realistic_sentences(text: str, expected: str) -> None:
    assert "".join(normalize(text)) == expected


@pytest.mark.parametrize(
    ("text", "lang"),
    [
        ("你好", "zh"),
        ("Hello", "en"),
        ("こんにちは、元気ですか？今日はいい天気ですね。", "ja"),
        ("안녕하세요", "ko"),
        ("佢哋今日好开心", "yue"),
        ("iPhone15 Pro壳子", "zh"),
        ("", "en"),
    ],
)
def test_detect_language(text: str, lang: str) -> None:
    assert detect_language(text) == lang


def test_japanese_numbers_use_the_japanese_grammar() -> None:
    assert normalize("今日は2026年12月3日です。") == ["今日は二千二十六年十二月三日です。"]


@pytest.mark.parametrize(
    ("n", "en", "zh"),
    [
        (0, "zero", "零"),
        (15, "fifteen", "十五"),
        (101, "one hundred one", "一百零一"),
        (1234, "one thousand two hundred thirty four", "一千二百三十四"),
        (100005, "one hundred thousand five", "十万零五"),
        (20_000_000, "twenty million", "二千万"),
    ],
)
def test_cardinals(n: int, en: str, zh: str) -> None:
    assert en_cardinal(n) == en and zh_cardinal(n) == zh


def test_wetext_loads_bundled_grammars_offline() -> None:
    """Import and use the frontend in a fresh process where any network access raises."""
    code = (
        "import socket\n"
        "def deny(*a, **k): raise RuntimeError('network access attempted')\n"
        "socket.socket.connect = deny\n"
        "socket.create_connection = deny\n"
        "socket.getaddrinfo = deny\n"
        "from engine.text.normalize import normalize\n"
        "assert normalize('气温25.5度') == ['气温二十五点五度。'], normalize('气温25.5度')\n"
        "assert normalize('It is 5 pm') == ['It is five PM.']\n"
        "import wetext, sys\n"
        "assert 'modelscope' not in sys.modules\n"
    )
    root = ROOT
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
