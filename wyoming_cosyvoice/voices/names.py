"""Voice names: what a new voice may be called, and when two names are the same voice.

Home Assistant lists voices by name, so two names that look the same cannot be told apart
there: ``grandma``, ``Grandma``, full-width ``ｇｒａｎｄｍａ`` and ``grаndma`` with a Cyrillic
``а`` are one name. :func:`name_key` is what names are compared by, everywhere a voice is
looked up or a new one is checked against the others:

1. NFKC: compatibility forms are their plain letters (full-width and mathematical letters,
   ligatures), and a name typed decomposed (``e`` + a combining accent, as macOS names files)
   is the composed one;
2. case folding;
3. Unicode's confusable mapping (UTS #39's skeleton rule: each character replaced by the
   prototype it is confused with) for the letters of the scripts people type beside Latin,
   before and after folding, so upper- and lower-case look-alikes both count;
4. spaces: runs of white space as one, none at either end; invisible format characters
   (zero-width joiners and the like) dropped.

The table is :data:`_LOOK_ALIKES`: UTS #39's ``confusables.txt`` for the letters of the
Cyrillic, Greek and Armenian scripts whose prototype is one ASCII letter. Why a table of our
own, what it leaves out and how to rebuild it: docs/dev/voice-names.md.
"""

from __future__ import annotations

import unicodedata

MAX_NAME_CHARS = 48
# Besides letters and digits of any script, and the marks that combine with them (Devanagari
# vowel signs, accents with no composed form). No dots: NAME.instruct.txt and NAME.prompt.pt
# are other files of a voice; no path separators.
_PUNCTUATION = frozenset(" -_")

# prototype -> the letters confused with it (UTS #39 confusables.txt, see above)
_LOOK_ALIKES = {
    "A": "ΑА",  # Greek Α, Cyrillic А
    "a": "ɑαа",  # Latin ɑ, Greek α, Cyrillic а
    "B": "ΒВ",  # Greek Β, Cyrillic В
    "b": "Ь",  # Cyrillic Ь
    "C": "С",  # Cyrillic С
    "c": "с",  # Cyrillic с
    "d": "ԁ",  # Cyrillic ԁ
    "E": "ΕЕ",  # Greek Ε, Cyrillic Е
    "e": "еҽ",  # Cyrillic е, ҽ
    "F": "Ϝ",  # Greek Ϝ
    "f": "ք",  # Armenian ք
    "G": "Ԍ",  # Cyrillic Ԍ
    "g": "ɡց",  # Latin ɡ, Armenian ց
    "H": "ΗН",  # Greek Η, Cyrillic Н
    "h": "һհ",  # Cyrillic һ, Armenian հ
    "I": "ΙІӀ",  # Greek Ι, Cyrillic І, Ӏ
    "i": "ıιіꙇӏ",  # Latin ı, Greek ι, Cyrillic і, ꙇ, ӏ
    "J": "ͿЈ",  # Greek Ϳ, Cyrillic Ј
    "j": "ϳј",  # Greek ϳ, Cyrillic ј
    "K": "ΚК",  # Greek Κ, Cyrillic К
    "M": "ΜϺМ",  # Greek Μ, Ϻ, Cyrillic М
    "N": "Ν",  # Greek Ν
    "n": "ոռ",  # Armenian ո, ռ
    "O": "ΟОՕ",  # Greek Ο, Cyrillic О, Armenian Օ
    "o": "οσоօ",  # Greek ο, σ, Cyrillic о, Armenian օ
    "P": "ΡР",  # Greek Ρ, Cyrillic Р
    "p": "ρр",  # Greek ρ, Cyrillic р
    "q": "ԛգզ",  # Cyrillic ԛ, Armenian գ, զ
    "r": "ᴦг",  # Greek ᴦ, Cyrillic г
    "S": "ЅՏ",  # Cyrillic Ѕ, Armenian Տ
    "s": "ѕ",  # Cyrillic ѕ
    "T": "ΤТ",  # Greek Τ, Cyrillic Т
    "U": "Ս",  # Armenian Ս
    "u": "υս",  # Greek υ, Armenian ս
    "V": "Ѵ",  # Cyrillic Ѵ
    "v": "νѵ",  # Greek ν, Cyrillic ѵ
    "W": "Ԝ",  # Cyrillic Ԝ
    "w": "ѡԝա",  # Cyrillic ѡ, ԝ, Armenian ա
    "X": "ΧХ",  # Greek Χ, Cyrillic Х
    "x": "х",  # Cyrillic х
    "Y": "ΥУҮ",  # Greek Υ, Cyrillic У, Ү
    "y": "γуү",  # Greek γ, Cyrillic у, ү
    "Z": "Ζ",  # Greek Ζ
}
_PROTOTYPES = str.maketrans({c: proto for proto, alikes in _LOOK_ALIKES.items() for c in alikes})


class BadVoiceName(ValueError):
    """A name that cannot be a voice's."""


def name_key(name: str) -> str:
    """What ``name`` is compared by: equal keys are names that look the same (see above)."""
    text = unicodedata.normalize("NFKC", name)
    text = "".join(c for c in text if unicodedata.category(c) != "Cf")
    text = text.translate(_PROTOTYPES).casefold().translate(_PROTOTYPES)
    return " ".join(text.split())


def check_name(name: str) -> str:
    """The name a new voice gets: ``name`` in composed form (NFC), else :class:`BadVoiceName`
    with what is allowed. Nothing else is changed: a name with a space at either end is
    refused, not trimmed, so a voice is always called what its maker asked for."""
    if name.strip() and name != name.strip():
        raise BadVoiceName(f"{name!r} starts or ends with a space: remove it")
    name = unicodedata.normalize("NFC", name)
    if (
        not 0 < len(name) <= MAX_NAME_CHARS
        or not name[0].isalnum()
        or not all(
            c.isalnum() or c in _PUNCTUATION or unicodedata.category(c).startswith("M")
            for c in name
        )
    ):
        raise BadVoiceName(
            f"{name!r} cannot be a voice name: use 1 to {MAX_NAME_CHARS} letters (any language), "
            "digits, spaces, '-' or '_', starting with a letter or digit"
        )
    return name
