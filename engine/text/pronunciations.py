"""Pronunciations a user gives for words and names, and how a text takes them.

A pronunciation is a line ``word = entry``; the entry is one of

* CMU phones (ARPAbet, upper case, a vowel with its stress digit as CMUdict writes it):
  ``M AY1 K AH0 L``;
* pinyin, a tone per syllable (a digit 1–5 or a tone mark): ``zhang1 san1`` or ``zhāng sān``;
* a plain respelling, any other text: ``Mykul``;
* phones or pinyin, then ``|`` and a respelling: ``SH IH0 V AO1 N | Shivawn``.

A model whose tokenizer has the phone and pinyin tokens (:data:`CMU_PHONE_TOKENS`,
:data:`PINYIN_TOKENS`: Fun-CosyVoice3's) reads phones or pinyin as those tokens, typed into the
text in place of the word (``[M][AY1][K][AH0][L]``, pinyin as initial and toned final,
``[zh][āng][s][ān]``); any model reads a respelling as plain text. :class:`Pronunciations` is
the list checked for one kind of model: each word's replacement, and a line of explanation per
entry it cannot apply (docs/dev/pronunciations.md).

Pure Python: the settings check and the server's start read it without torch.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# --- the tokens (Fun-CosyVoice3's tokenizer adds them, in this order) ------------------------

_VOWELS = ("AA", "AE", "AH", "AO", "AW", "AY", "EH", "ER", "EY", "IH", "IY", "OW", "OY", "UH", "UW")
_CONSONANTS = (
    "B", "CH", "D", "DH", "F", "G", "HH", "JH", "K", "L", "M", "N", "NG", "P", "R", "S", "SH",
    "T", "TH", "V", "W", "Y", "Z", "ZH",
)  # fmt: skip
# The CMU phone tokens: the 39 ARPAbet phones in alphabetical order, each vowel bare and with
# stress 0, 1 and 2.
CMU_PHONE_TOKENS: tuple[str, ...] = tuple(
    token
    for phone in sorted(_VOWELS + _CONSONANTS)
    for token in (
        (f"[{phone}]", *(f"[{phone}{stress}]" for stress in "012"))
        if phone in _VOWELS
        else (f"[{phone}]",)
    )
)
_PINYIN_UNITS = """
    a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè
    ié iòng ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p
    q r s sh t u uang ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng
    uē uě uī uō uǎ uǎi uǎn uǎng uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr
    é éi én éng ér ì ìn ìng í ín íng ò òng òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi
    ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
"""
# The pinyin tokens: initials (y and w among them) and finals, a toned final with its tone
# mark, in code-point order.
PINYIN_TOKENS: tuple[str, ...] = tuple(f"[{unit}]" for unit in sorted(_PINYIN_UNITS.split()))

# --- reading an entry ----------------------------------------------------------------------

_CMU_SHAPED = re.compile(r"[A-Z]{1,3}\d?")
_PINYIN_SHAPED = re.compile(r"[a-zü:]+\d")
_TONE_MARKS = {"a": "āáǎà", "e": "ēéěè", "i": "īíǐì", "o": "ōóǒò", "u": "ūúǔù", "v": "ǖǘǚǜ"}
_MARKED = frozenset("".join(_TONE_MARKS.values()))  # the vowels with a tone mark
_INITIALS = sorted(
    "b p m f d t n l g k h j q x zh ch sh r z c s y w".split(), key=len, reverse=True
)
_CMU_TOKENS = frozenset(CMU_PHONE_TOKENS)
_PINYIN_TOKEN_SET = frozenset(PINYIN_TOKENS)


class PronunciationError(ValueError):
    """An entry that no model can read (an unknown phone, a tone out of range, …)."""


@dataclass(frozen=True)
class Pronunciation:
    """One ``word = entry`` line, read."""

    word: str
    tokens: str | None  # the phone or pinyin tokens, ready to type into a text; None: none
    respelling: str | None  # plain text said instead of the word; None: none

    def spoken_as(self, phone_tokens: bool) -> str | None:
        """What a model replaces the word with (``phone_tokens``: it has the tokens); None:
        this entry gives it nothing it can read."""
        if phone_tokens and self.tokens is not None:
            return self.tokens
        return self.respelling


def _cmu_tokens(items: Sequence[str]) -> str:
    tokens = [f"[{item}]" for item in items]
    if unknown := [t[1:-1] for t in tokens if t not in _CMU_TOKENS]:
        what = "is not a CMU phone" if len(unknown) == 1 else "are not CMU phones"
        raise PronunciationError(
            f"{', '.join(unknown)} {what} (ARPAbet AA … ZH, a vowel with its stress 0, 1 or "
            "2, e.g. M AY1 K AH0 L)"
        )
    return "".join(tokens)


def _syllable_tokens(syllable: str) -> str:
    """One pinyin syllable (``zhang1``, ``lv4``, ``zhāng``) as initial and toned final."""
    text = unicodedata.normalize("NFC", syllable.lower()).replace("u:", "v")
    tone = 5
    if text[-1:].isdigit():
        text, tone = text[:-1], int(text[-1])
        if not 0 <= tone <= 5:
            raise PronunciationError(f"pinyin {syllable!r}: tone {tone} (tones are 1 to 5)")
        if any(ch in _MARKED for ch in text):
            raise PronunciationError(f"pinyin {syllable!r}: a tone mark and a tone digit")
    initial = next((i for i in _INITIALS if text.startswith(i) and len(text) > len(i)), "")
    final = text[len(initial) :]
    marked = [ch for ch in final if ch in _MARKED]
    if len(marked) > 1:
        raise PronunciationError(f"pinyin {syllable!r}: more than one tone mark")
    # A marked ü keeps its mark (ǘ); an unmarked one is written v (lüè: [l][vè]).
    final = final.replace("ü", "v")
    if not any(ch in "aeiouv" or ch in _MARKED for ch in final):
        raise PronunciationError(f"pinyin {syllable!r}: no final (a syllable needs a vowel)")
    if not marked and tone in (1, 2, 3, 4):
        final = _with_tone_mark(final, tone)
    if not final or f"[{final}]" not in _PINYIN_TOKEN_SET:
        raise PronunciationError(
            f"pinyin {syllable!r}: the model has no token for {final or syllable!r} "
            "(write a syllable with its tone, e.g. zhang1 or zhāng)"
        )
    return (f"[{initial}]" if initial else "") + f"[{final}]"


def _with_tone_mark(final: str, tone: int) -> str:
    """``final`` with its tone mark where pinyin puts it: on a or e, on the o of ou, else on
    the last vowel."""
    if "a" in final:
        at = final.index("a")
    elif "e" in final:
        at = final.index("e")
    elif "ou" in final:
        at = final.index("o")
    else:
        vowels = [i for i, ch in enumerate(final) if ch in _TONE_MARKS]
        if not vowels:
            return final
        at = vowels[-1]
    return final[:at] + _TONE_MARKS[final[at]][tone - 1] + final[at + 1 :]


def _is_pinyin_shaped(item: str) -> bool:
    return bool(_PINYIN_SHAPED.fullmatch(item.lower())) or any(ch in _MARKED for ch in item)


def _sound_tokens(text: str) -> str | None:
    """The tokens of phones or pinyin; None when ``text`` is neither (a respelling)."""
    items = text.split()
    if not items:
        return None
    if all(_CMU_SHAPED.fullmatch(i) for i in items) and (
        any(i[-1].isdigit() for i in items) or all(f"[{i}]" in _CMU_TOKENS for i in items)
    ):
        return _cmu_tokens(items)
    if all(_is_pinyin_shaped(i) for i in items):
        return "".join(_syllable_tokens(i) for i in items)
    return None


def read_entry(word: str, entry: str) -> Pronunciation:
    """``entry`` for ``word`` read; raises :class:`PronunciationError` saying what is wrong."""
    word = " ".join(word.split())
    if not word:
        raise PronunciationError("no word before '='")
    sounds, bar, respelling = entry.partition("|")
    sounds, respelling = sounds.strip(), " ".join(respelling.split())
    if bar and not respelling:
        raise PronunciationError("nothing after '|' (the respelling)")
    tokens = _sound_tokens(sounds)
    if bar and tokens is None:
        raise PronunciationError(
            f"{sounds!r} before '|' is neither CMU phones (M AY1 K AH0 L) nor pinyin (zhang1)"
        )
    if not bar:
        respelling = "" if tokens is not None else " ".join(sounds.split())
    if tokens is None and not respelling:
        raise PronunciationError("no pronunciation after '='")
    return Pronunciation(word, tokens, respelling or None)


def read_line(line: str) -> Pronunciation:
    """A ``word = entry`` line read (:func:`read_entry`)."""
    word, equals, entry = line.partition("=")
    if not equals:
        raise PronunciationError("no '=': write it as  word = pronunciation")
    return read_entry(word, entry)


# --- a list, checked for one model ---------------------------------------------------------


@dataclass(frozen=True)
class PronunciationCheck:
    """How one line fares with a model: what its word is said as, or why it is not applied."""

    line: str
    word: str | None
    spoken_as: str | None  # None: not applied
    problem: str | None  # None: applied

    def message(self) -> str:
        """A line for the log."""
        if self.problem is None:
            return f"pronunciation {self.line!r}: {self.word!r} is said as {self.spoken_as!r}"
        return f"pronunciation {self.line!r} is not applied: {self.problem}"


# Scripts written without spaces between words: kana, CJK ideographs, Hangul.
_UNSPACED = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff"
# A letter or digit of a script with spaces: a word must not run on into one.
_SPACED_WORD_CHAR = f"[^\\W{_UNSPACED}]"
_UNSPACED_CHAR = re.compile(f"[{_UNSPACED}]")


def _edge(ch: str) -> str:
    """What must not touch a word at its edge ``ch``: nothing for a character of an unspaced
    script (a Chinese name sits between other characters), else a letter or digit of a
    spaced one (``Li说`` holds the word Li, ``LiLi`` does not)."""
    return "" if _UNSPACED_CHAR.match(ch) else _SPACED_WORD_CHAR


class Pronunciations:
    """A list of pronunciation lines as one model applies them.

    ``phone_tokens``: the model's tokenizer has the phone and pinyin tokens. Words match whole
    and in any case; a word given twice takes its last line.
    """

    def __init__(self, lines: Iterable[str] = (), *, phone_tokens: bool = False) -> None:
        self.checks: list[PronunciationCheck] = []
        applied: dict[str, tuple[str, str]] = {}  # folded word -> (word, replacement)
        for line in lines:
            check = self._check(line.strip(), phone_tokens)
            self.checks.append(check)
            if check.word is not None and check.spoken_as is not None:
                applied[check.word.casefold()] = (check.word, check.spoken_as)
        self._replacement = {key: said for key, (_, said) in applied.items()}
        words = sorted((w for w, _ in applied.values()), key=len, reverse=True)
        self._pattern = re.compile(
            "|".join(self._word_pattern(w) for w in words), re.IGNORECASE
        ) if words else None  # fmt: skip

    @staticmethod
    def _check(line: str, phone_tokens: bool) -> PronunciationCheck:
        try:
            entry = read_line(line)
        except PronunciationError as err:
            return PronunciationCheck(line, None, None, str(err))
        said = entry.spoken_as(phone_tokens)
        if said is None:
            problem = (
                "this model has no phone or pinyin tokens: add a respelling it says right "
                f"after '|' ({line} | …)"
            )
            return PronunciationCheck(line, entry.word, None, problem)
        return PronunciationCheck(line, entry.word, said, None)

    @staticmethod
    def _word_pattern(word: str) -> str:
        body = r"\s+".join(re.escape(part) for part in word.split())
        before, after = _edge(word[0]), _edge(word[-1])
        return (f"(?<!{before})" if before else "") + body + (f"(?!{after})" if after else "")

    @property
    def problems(self) -> list[PronunciationCheck]:
        """The lines not applied."""
        return [check for check in self.checks if check.problem is not None]

    def apply(self, text: str) -> str:
        """``text`` with each listed word replaced by what the model says it as."""
        if self._pattern is None:
            return text
        return self._pattern.sub(
            lambda m: self._replacement.get(" ".join(m.group(0).split()).casefold(), m.group(0)),
            text,
        )


class PronouncingFrontend:
    """What a text frontend adds to take pronunciations: the list its texts are read with."""

    # Whether the frontend's tokenizer has the phone and pinyin tokens.
    PHONE_TOKENS: bool = False
    # Replaced whole when a new list is taken, so a thread reading it sees one list or the other.
    pronunciations: Pronunciations = Pronunciations()

    def use_pronunciations(self, lines: Sequence[str]) -> list[PronunciationCheck]:
        """Read every text from now on with these ``word = entry`` lines; how each fares."""
        self.pronunciations = Pronunciations(lines, phone_tokens=self.PHONE_TOKENS)
        return self.pronunciations.checks
