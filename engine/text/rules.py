"""Our normalisation rules on top of the official frontend + wetext.

Each rule fixes something wetext 0.1.8 leaves unspoken or reads wrongly for a smart-home /
customer-service voice.  Every rule is listed with an example in docs/text-normalisation.md
and pinned by tests/engine_tests/text/test_text_normalize.py.  Rules run *before* wetext (they turn
the text into something wetext reads correctly, or verbalise it completely).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable

from engine.text.numbers import en_cardinal, en_digits, zh_cardinal, zh_digits

# --- language independent -------------------------------------------------------------------

_SURROGATES = re.compile("[\ud800-\udfff]")
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
# C0/C1 controls except tab/newline, zero-width characters, BOM, bidi marks.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200b\u200c\u200e\u200f\u2028\u2029\ufeff]")
_EMOJI = re.compile(
    "[\U0001f000-\U0001faff\u2600-\u27bf\u2b00-\u2bff\u2300-\u23ff\ufe0e\ufe0f\u200d\u20e3"
    "\U000e0020-\U000e007f]"
)


def sanitize(text: str) -> str:
    """Drop lone surrogates (tiktoken/kaldifst reject them) and invisible control chars."""
    text = _ANSI_ESCAPE.sub("", _SURROGATES.sub("", text))
    text = _CONTROLS.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    return text.replace("\t", " ")


def remove_emoji(text: str) -> str:
    """Emoji have no reading; their BPE byte pieces only confuse the LLM."""
    return _EMOJI.sub("", text)


_MD_LINK = re.compile(r"!?\[([^\]\n]*)\]\((?:[^)\n]*)\)")
# Headings, quotes, bullets and "1." / "2)" list numbers at the start of a line.
_MD_LINE_PREFIX = re.compile(
    r"^[ \t]*(?:#{1,6}[ \t]+|>[ \t]*|[-*+•][ \t]+|\d{1,2}[.)][ \t]+)", re.MULTILINE
)
_MD_RULE = re.compile(r"^[ \t]*(?:[-*_][ \t]*){3,}$", re.MULTILINE)
_MD_EMPHASIS = re.compile(r"\*+|(?<![\w])__|__(?![\w])|`+")


def strip_markdown(text: str) -> str:
    """LLM replies arrive as markdown: keep the words, drop the markup."""
    text = _MD_LINK.sub(r"\1", text)
    text = _MD_RULE.sub("", text)
    text = _MD_LINE_PREFIX.sub("", text)
    return _MD_EMPHASIS.sub("", text)


_LINE_END_PUNCT = set("。！？；：，、.!?;:,…")


def close_lines(text: str, is_zh: bool) -> str:
    """Each non-empty line that lacks final punctuation gets one, so list items and headings
    keep their pause after the official frontend removes the newlines."""
    if "\n" not in text:
        return text
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    stop = "。" if is_zh else "."
    closed = [line if line[-1] in _LINE_END_PUNCT else line + stop for line in lines[:-1]]
    # Chinese keeps the newline (the official zh path deletes it); English needs a space.
    return ("\n" if is_zh else " ").join(closed + lines[-1:])


def collapse_spaces(text: str) -> str:
    """wetext 0.1.8's English grammar raises on two consecutive spaces."""
    return re.sub(r"[ \u00a0\u3000]{2,}", " ", text)


# --- shared helpers ----------------------------------------------------------------------------

_NUM = r"\d{1,3}(?:,\d{3})+|\d+"
_VERSION = re.compile(r"(?<![\d.])\d+(?:\.\d+){2,}(?![\d.])")
_PLUS_PHONE = re.compile(r"\+(\d{1,3})((?:[ -]?\d){6,14})(?!\d)")


def _version(m: re.Match[str], point: str, num: Callable[[int], str]) -> str:
    return point.join(num(int(part)) for part in m.group(0).split("."))


def _groups(digits: str, read: Callable[[str], str], sep: str) -> str:
    return sep.join(read(g) for g in re.split(r"[ -]+", digits.strip(" -")) if g)


# --- English -------------------------------------------------------------------------------

_CURRENCY_EN = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", "", ""),
}
_MONEY_EN = re.compile(r"([$€£¥])\s?(" + _NUM + r")(?:\.(\d{1,2}))?(?!\d)")
_GROUPED_EN = re.compile(r"(?<![\d.,])(\d{1,3}(?:,\d{3})+)(?:\.(\d+))?(?![\d,]\d)")
_TIME24_EN = re.compile(r"(?<![\d:])(1[3-9]|2[0-3]):([0-5]\d)(?![\d:])(?!\s*[AaPp]\.?[Mm]\b)")
_HASH_CODE = re.compile(r"#\s?([A-Za-z]*)(\d+)\b")
_LONG_DIGITS = re.compile(r"(?<![\d.,])\d{8,}(?![\d.,]\d)")
_LETTER_DECIMAL = re.compile(r"(?<=[A-Za-z])(?=\d+\.\d)")
_RANGE = re.compile(r"(\d%?)\s?[~～]\s?(?=\d)")
_UNITS_EN = {
    "kWh": "kilowatt hours", "kW": "kilowatts", "W": "watts", "V": "volts",
    "mAh": "milliamp hours", "Hz": "hertz", "kHz": "kilohertz", "MHz": "megahertz",
    "GHz": "gigahertz", "dB": "decibels", "lm": "lumens", "lx": "lux", "ppm": "p p m",
}  # fmt: skip
_UNIT_EN = re.compile(r"(\d)\s?(" + "|".join(sorted(_UNITS_EN, key=len, reverse=True)) + r")\b")


def _money_en(m: re.Match[str]) -> str:
    one, many, cent, cents = _CURRENCY_EN[m.group(1)]
    whole = int(m.group(2).replace(",", ""))
    frac = m.group(3)
    sub = int(frac.ljust(2, "0")) if frac else 0
    if sub and not cent:  # yen has no minor unit: read the decimals
        return f"{en_cardinal(whole)} point {en_digits(frac)} {many}"
    parts = []
    if whole or not sub:
        parts.append(f"{en_cardinal(whole)} {one if whole == 1 else many}")
    if sub:
        parts.append(f"{en_cardinal(sub)} {cent if sub == 1 else cents}")
    return " and ".join(parts)


def _grouped_en(m: re.Match[str]) -> str:
    words = en_cardinal(int(m.group(1).replace(",", "")))
    return f"{words} point {en_digits(m.group(2))}" if m.group(2) else words


def _time24_en(m: re.Match[str]) -> str:
    hour, minute = int(m.group(1)) - 12, m.group(2)
    return f"{hour} PM" if minute == "00" else f"{hour}:{minute} PM"


def _hash_en(m: re.Match[str]) -> str:
    letters, digits = m.group(1), m.group(2)
    if letters or len(digits) >= 4:
        return f"number {' '.join(letters)} {en_digits(digits)}".replace("  ", " ")
    return f"number {digits}"


def _unit_en(m: re.Match[str]) -> str:
    return f"{m.group(1)} {_UNITS_EN[m.group(2)]}"


def english_rules(text: str) -> str:
    text = _PLUS_PHONE.sub(
        lambda m: "plus " + en_digits(m.group(1)) + ", " + _groups(m.group(2), en_digits, ", "),
        text,
    )
    text = _MONEY_EN.sub(_money_en, text)
    text = _HASH_CODE.sub(_hash_en, text)
    text = _VERSION.sub(lambda m: _version(m, " point ", en_cardinal), text)
    text = _GROUPED_EN.sub(_grouped_en, text)
    text = _LONG_DIGITS.sub(lambda m: en_digits(m.group(0)), text)
    text = _TIME24_EN.sub(_time24_en, text)
    text = _LETTER_DECIMAL.sub(" ", text)
    text = _RANGE.sub(r"\1 to ", text)
    return _UNIT_EN.sub(_unit_en, text)


# --- Chinese -------------------------------------------------------------------------------

_EMAIL = re.compile(r"[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+")
_MONEY_ZH = re.compile(r"[¥￥](\d+)\.(\d{1,2})(?!\d)|(?<![\d.])(\d+)\.(\d{1,2})元")
_ORDINAL_ZH = re.compile(r"第(\d+)")
_HASH_NUM_ZH = re.compile(r"#\s?(\d+)(?![\d.])")
_HASH_CODE_ZH = re.compile(r"#\s?(?=[A-Za-z])")
_CODE_ZH = re.compile(r"(?<![A-Za-z])([A-Z]{1,4})(\d{3,})(?![\d.])")
_UNITS_ZH = {"kWh": "千瓦时", "kW": "千瓦", "W": "瓦", "V": "伏", "mAh": "毫安时", "Hz": "赫兹",
             "dB": "分贝", "lm": "流明", "ppm": "ppm"}  # fmt: skip
_UNIT_ZH = re.compile(
    r"(\d)\s?(" + "|".join(sorted(_UNITS_ZH, key=len, reverse=True)) + r")(?![A-Za-z])"
)


def _email_zh(m: re.Match[str]) -> str:
    return m.group(0).replace("@", "艾特").replace(".", "点")


def _money_zh(m: re.Match[str]) -> str:
    whole, frac = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    jiao, fen = int(frac[0]), int(frac[1]) if len(frac) > 1 else 0
    out = f"{zh_cardinal(int(whole))}元" if int(whole) else ""
    if jiao:
        out += f"{zh_digits(str(jiao))}角"
    elif fen and out:
        out += "零"
    if fen:
        out += f"{zh_digits(str(fen))}分"
    return out or "零元"


def _phone_zh(m: re.Match[str]) -> str:
    def read(group: str) -> str:
        return zh_digits(group, "幺")

    return "加" + read(m.group(1)) + _groups(m.group(2), read, "")


def _hash_num_zh(m: re.Match[str]) -> str:
    digits = m.group(1)
    return zh_digits(digits) if len(digits) >= 3 else digits + "号"


def chinese_rules(text: str) -> str:
    text = _EMAIL.sub(_email_zh, text)
    text = _PLUS_PHONE.sub(_phone_zh, text)
    text = _MONEY_ZH.sub(_money_zh, text)
    text = _VERSION.sub(lambda m: _version(m, "点", lambda n: zh_digits(str(n))), text)
    text = _ORDINAL_ZH.sub(lambda m: "第" + zh_cardinal(int(m.group(1))), text)
    text = _HASH_NUM_ZH.sub(_hash_num_zh, text)
    text = _HASH_CODE_ZH.sub("", text)
    text = _CODE_ZH.sub(lambda m: m.group(1) + zh_digits(m.group(2)), text)
    return _UNIT_ZH.sub(lambda m: m.group(1) + _UNITS_ZH[m.group(2)], text)


def is_speakable(text: str) -> bool:
    """False when nothing but punctuation, symbols, whitespace or marks is left."""
    return any(unicodedata.category(ch)[0] in "LN" for ch in text)
