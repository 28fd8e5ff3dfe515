"""Small number verbalisers used by the extra normalisation rules.

wetext covers most numbers; these helpers exist for the cases where our own rules
verbalise a whole construct (money, codes, phone numbers) or where wetext leaves digits.
English output follows wetext's style (no hyphens, no "and"), so a sentence reads
consistently whichever component produced the words.
"""

from __future__ import annotations

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen "
    "fourteen fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_SCALES = ("", "thousand", "million", "billion", "trillion")

ZH_DIGITS = "零一二三四五六七八九"
_ZH_UNITS = ("", "十", "百", "千")
_ZH_BIG = ("", "万", "亿", "万亿")


def _en_below_1000(n: int) -> list[str]:
    words: list[str] = []
    hundreds, rest = divmod(n, 100)
    if hundreds:
        words += [_ONES[hundreds], "hundred"]
    if rest >= 20:
        tens, ones = divmod(rest, 10)
        words.append(_TENS[tens])
        if ones:
            words.append(_ONES[ones])
    elif rest:
        words.append(_ONES[rest])
    return words


def en_cardinal(n: int) -> str:
    """1234 -> 'one thousand two hundred thirty four'.  Falls back to digits past 10**15."""
    if n < 0:
        return "minus " + en_cardinal(-n)
    if n == 0:
        return "zero"
    if n >= 10 ** (3 * len(_SCALES)):
        return en_digits(str(n))
    words: list[str] = []
    groups: list[int] = []
    while n:
        n, group = divmod(n, 1000)
        groups.append(group)
    for scale in range(len(groups) - 1, -1, -1):
        if groups[scale]:
            words += _en_below_1000(groups[scale])
            if _SCALES[scale]:
                words.append(_SCALES[scale])
    return " ".join(words)


def en_digits(digits: str) -> str:
    """'0123' -> 'zero one two three' (codes, phone numbers)."""
    return " ".join(_ONES[int(d)] for d in digits if d.isdigit())


def zh_digits(digits: str, one: str = "一") -> str:
    """'0123' -> '零一二三'; phone numbers conventionally use 幺 for 1 (``one='幺'``)."""
    return "".join(one if d == "1" else ZH_DIGITS[int(d)] for d in digits if d.isdigit())


def _zh_below_10000(n: int) -> str:
    out = ""
    zero_pending = False
    for pos in range(3, -1, -1):
        d = (n // 10**pos) % 10
        if d == 0:
            zero_pending = bool(out)
            continue
        if zero_pending:
            out += "零"
            zero_pending = False
        out += ZH_DIGITS[d] + _ZH_UNITS[pos]
    return out


def zh_cardinal(n: int) -> str:
    """128 -> '一百二十八', 10 -> '十', 100005 -> '十万零五'."""
    if n == 0:
        return "零"
    if n < 0:
        return "负" + zh_cardinal(-n)
    if n >= 10**16:
        return zh_digits(str(n))
    groups: list[int] = []
    while n:
        n, group = divmod(n, 10000)
        groups.append(group)
    out = ""
    for idx in range(len(groups) - 1, -1, -1):
        group = groups[idx]
        if not group:
            continue
        if out and group < 1000:
            out += "零"
        out += _zh_below_10000(group) + _ZH_BIG[idx]
    if out.startswith("一十"):
        out = out[1:]  # 10..19 are read 十, 十一 ...
    return out
