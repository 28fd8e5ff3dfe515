"""Text normalisation: the official v1 frontend with wetext 0.1.8, plus our rules.

Pipeline (the official frontend's current ``text_normalize`` with wetext), with our additions
marked [+]:

0. [+] sanitize (surrogates, control chars), strip markdown, drop emoji, close lines,
   collapse runs of spaces; whisper ``<|...|>`` tags are protected and the text between them
   is normalised (HEAD skips normalisation entirely when a tag is present; v1-era code did not).
1. strip; empty -> nothing.
2. Chinese path (any char U+4E00-U+9FFF): [+] Chinese rules, wetext, remove newlines,
   ``replace_blank``, ²/³, ``.``->``。``, `` - ``->``，``, remove （）【】` and ``——``->space,
   trailing ``，,、`` -> ``。``, split by characters.
3. Otherwise: [+] English rules, wetext, spell out leftover digits, split by BPE tokens.
4. drop segments without a letter or digit.

``normalize(text, split=False)`` returns a one-element list (the normalised text, without the
final punctuation the splitter would add), or ``[]`` when nothing speakable is left — a list in
both modes so callers never branch on the type.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from engine.text import rules, wetext_backend
from engine.text.numbers import en_cardinal
from engine.text.segment import split_paragraph
from engine.text.tokenizer import get_tokenizer

_CJK = re.compile("[\u4e00-\u9fff]")
_KANA = re.compile("[\u3040-\u30ff\u31f0-\u31ff]")
_HANGUL = re.compile("[\uac00-\ud7af\u1100-\u11ff\u3130-\u318f]")
# Characters that only occur in written Cantonese.
_YUE = re.compile("[佢哋咗嘢冇喺嘅啲乜噉咁嚟睇啱嗰]")
_TAG = re.compile(r"(<\|[^|<>\s]{1,32}\|>)")
_DIGITS = re.compile(r"\d+")


def contains_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def detect_language(text: str) -> str:
    """'ja' (kana), 'ko' (hangul), 'yue' (Cantonese-only characters), 'zh' (CJK) or 'en'."""
    if _KANA.search(text):
        return "ja"
    if _HANGUL.search(text):
        return "ko"
    if _YUE.search(text):
        return "yue"
    if _CJK.search(text):
        return "zh"
    return "en"


def _replace_blank(text: str) -> str:
    """Keep a space only between two non-space ASCII characters (official rule)."""
    out = []
    for i, ch in enumerate(text):
        if ch == " ":
            prev = text[i - 1] if i > 0 else ""
            nxt = text[i + 1] if i + 1 < len(text) else ""
            if prev.isascii() and nxt.isascii() and prev not in " " and nxt not in " ":
                out.append(ch)
        else:
            out.append(ch)
    return "".join(out)


def _normalize_zh_piece(text: str, wetext_lang: str) -> str:
    text = rules.chinese_rules(text)
    # [+] the official " - " -> "，" never fires after replace_blank; apply it first.
    text = re.sub(r"\s+-\s+", "，", text)
    text = wetext_backend.normalize(text, wetext_lang)
    text = text.replace("\n", "")
    text = _replace_blank(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    text = re.sub(r"[（）【】`]", "", text)
    return text.replace("——", " ")


def _normalize_en_piece(text: str, wetext_lang: str) -> str:
    text = rules.english_rules(text)
    text = wetext_backend.normalize(text, wetext_lang)
    # The official code spells leftover digit runs with inflect; ours uses the same words
    # style as wetext (no hyphens, no "and").
    return _DIGITS.sub(lambda m: en_cardinal(int(m.group(0))), text)


def _prepare(text: str, chinese: bool | None) -> str:
    text = rules.sanitize(text)
    text = rules.strip_markdown(text)
    text = rules.remove_emoji(text)
    text = rules.close_lines(text, contains_chinese(text) if chinese is None else chinese)
    return rules.collapse_spaces(text).strip()


def _wetext_language(text: str, is_zh: bool, *, forced: bool) -> str:
    """The grammar wetext reads ``text`` with on the path taken."""
    # Japanese text with kanji takes the Chinese path (as upstream) but wetext's Japanese
    # grammar reads its numbers ([+]: upstream reads them as Chinese).
    if is_zh and _KANA.search(text):
        return "ja"
    if not forced:
        return "auto"
    # A forced piece may lack the characters "auto" decides by ("，7:30" of a Chinese sentence).
    return "zh" if is_zh else "en"


def normalize_text(text: str, *, chinese: bool | None = None) -> tuple[str, bool]:
    """Normalised text before splitting, and whether it took the Chinese path.

    ``chinese`` forces the path (a piece of a sentence keeps the path of the whole sentence);
    ``None`` decides from the text itself.
    """
    text = _prepare(text, chinese)
    is_zh = contains_chinese(text) if chinese is None else chinese
    wetext_lang = _wetext_language(text, is_zh, forced=chinese is not None)
    parts = _TAG.split(text)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 1 or not part.strip():
            out.append(part.strip() if i % 2 == 0 else part)
        elif is_zh:
            out.append(_normalize_zh_piece(part, wetext_lang))
        else:
            out.append(_normalize_en_piece(part, wetext_lang))
    text = "".join(out).strip()
    if is_zh:
        text = re.sub(r"[，,、]+$", "。", text)
    return text, is_zh


def normalize(
    text: str,
    *,
    split: bool = True,
    token_len: Callable[[str], int] | None = None,
    chinese: bool | None = None,
) -> list[str]:
    """Normalise ``text`` into the segments the models synthesise one by one.

    ``split=False`` (prompt and instruct text) returns ``[normalised_text]`` or ``[]``.
    ``token_len`` measures English text for the split (default: whisper BPE tokens, the v1
    vocabulary; a model with another vocabulary passes its own). ``chinese`` forces the
    language path as in :func:`normalize_text`.
    """
    normalized, is_zh = normalize_text(text, chinese=chinese)
    if not rules.is_speakable(normalized):
        return []
    if not split:
        return [normalized]
    if token_len is None:
        tokenizer = get_tokenizer()

        def token_len(s: str) -> int:
            return len(tokenizer.encode(s))

    segments = split_paragraph(normalized, token_len, "zh" if is_zh else "en")
    return [seg for seg in segments if rules.is_speakable(seg)]
