"""The voice catalogue: voice names ↔ CosyVoice speakers, and which voice a request gets.

CosyVoice's speakers have Chinese names (``中文女`` = "Chinese, female"). Home Assistant shows a
voice's description and stores its name in automations, so every speaker gets a stable ASCII
name (``zh-female``) and keeps the original in the description. Cantonese is advertised as
``zh_HK``: HA's language matching parses tags as language + region, so ``zh_HK`` matches the
``zh-Hant``/``zh-HK`` UI languages, while ``yue`` would match no language HA offers.

Custom voices (cloned from a recording, see docs/custom-voices.md) keep their folder name, even
a non-ASCII one: HA stores voice ids as plain strings and the protocol is UTF-8 JSON. They are
listed under all five languages, the transcript's language first: CosyVoice speaks any of them
cross-lingually, and HA offers a voice only under the languages it lists.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

from wyoming_cosyvoice.errors import VoiceNotFoundError
from wyoming_cosyvoice.voices.names import name_key

# prefix of an official speaker name -> (slug prefix, HA languages, English label)
_LANGUAGE_PREFIXES = {
    "中文": ("zh", ["zh_CN"], "Mandarin Chinese"),
    "英文": ("en", ["en_US"], "English"),
    "日语": ("ja", ["ja_JP"], "Japanese"),
    "日文": ("ja", ["ja_JP"], "Japanese"),
    "粤语": ("yue", ["zh_HK"], "Cantonese"),
    "韩语": ("ko", ["ko_KR"], "Korean"),
    "韩文": ("ko", ["ko_KR"], "Korean"),
}
_GENDERS = {"女": "female", "男": "male"}
# A bare language picks its main region first, as HA's matching prefers (zh -> CN, en -> US).
_MAIN_REGION = {"zh": "zh_cn", "en": "en_us", "ja": "ja_jp", "ko": "ko_kr", "yue": "zh_hk"}
# CosyVoice v1 is multilingual: a speaker of unknown origin is offered for every language.
ALL_LANGUAGES = ["zh_CN", "en_US", "ja_JP", "ko_KR", "zh_HK"]
_LANGUAGE_TAG = re.compile(r"[a-zA-Z]{2,3}([-_][a-zA-Z0-9]{2,4})?")
# language detected from a custom voice's transcript (engine codes) -> (HA language, label)
_CUSTOM_LANGUAGES = {
    "zh": ("zh_CN", "Mandarin Chinese"),
    "en": ("en_US", "English"),
    "ja": ("ja_JP", "Japanese"),
    "ko": ("ko_KR", "Korean"),
    "yue": ("zh_HK", "Cantonese"),
}


@dataclass(frozen=True)
class Voice:
    name: str  # stable ASCII voice name, e.g. "zh-female"
    speaker: str  # the model's speaker key, e.g. "中文女"
    languages: tuple[str, ...]
    description: str
    custom: bool = False  # cloned from a recording in the voices folder


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def describe_speaker(speaker: str) -> tuple[str, list[str], str]:
    """(ASCII name, HA languages, description) for one speaker name; deterministic."""
    for prefix, (code, languages, label) in _LANGUAGE_PREFIXES.items():
        rest = speaker[len(prefix) :]
        if speaker.startswith(prefix) and rest in _GENDERS:
            gender = _GENDERS[rest]
            return f"{code}-{gender}", list(languages), f"{speaker} ({label}, {gender})"
    slug = _slug(speaker) if speaker.isascii() else ""
    if not slug:
        # Non-ASCII names get a short hash: stable across restarts and machines.
        slug = "speaker-" + hashlib.sha1(speaker.encode("utf-8")).hexdigest()[:8]
    return slug, list(ALL_LANGUAGES), speaker


def describe_custom_voice(name: str, language: str) -> Voice:
    """A custom voice: its own name, the transcript's language first, then all the others."""
    code, label = _CUSTOM_LANGUAGES.get(language, ("en_US", "English"))
    languages = (code, *(lang for lang in ALL_LANGUAGES if lang != code))
    return Voice(name, name, languages, f"{name} (custom voice, recorded in {label})", True)


class VoiceCatalog:
    """The advertised voices of one model, and the lookups a request needs.

    ``custom`` lists (name, transcript language) of the usable custom voices. They come after
    the built-in voices, so a language's default voice stays a built-in one; a custom voice
    whose name is already taken (by a name that looks the same: :mod:`.names`) is left
    out and listed in ``skipped``.
    """

    def __init__(self, speakers: list[str], custom: Iterable[tuple[str, str]] = ()) -> None:
        voices: list[Voice] = []
        taken: set[str] = set()
        for speaker in sorted(speakers):
            name, languages, description = describe_speaker(speaker)
            unique, n = name, 2
            while unique in taken:  # two speakers mapping to one slug keep distinct names
                unique, n = f"{name}-{n}", n + 1
            taken.add(unique)
            voices.append(Voice(unique, speaker, tuple(languages), description))
        self.voices = sorted(voices, key=lambda v: v.name)
        self._by_key = {name_key(v.name): v for v in self.voices}
        self._by_key.update({name_key(v.speaker): v for v in self.voices})
        self.skipped: dict[str, str] = {}
        for name, language in sorted(custom):
            if (other := self._by_key.get(name_key(name))) is not None:
                self.skipped[name] = f"the name is already used by the voice {other.name!r}"
                continue
            voice = describe_custom_voice(name, language)
            self.voices.append(voice)
            self._by_key[name_key(name)] = voice

    def find(self, name: str) -> Voice | None:
        """A voice by its ASCII name or by the original speaker name, or by a name that looks
        the same (:func:`~wyoming_cosyvoice.voices.names.name_key`: any case, any Unicode form)."""
        return self._by_key.get(name_key(name))

    def for_language(self, language: str) -> Voice | None:
        """The first voice for a language tag: exact tag first, then the bare language."""
        tag = language.replace("-", "_").casefold()
        tag = _MAIN_REGION.get(tag, tag)
        base = tag.split("_")[0]
        # A custom voice first counts for its transcript's language only; it is the fallback
        # for other languages (it speaks them cross-lingually) when no voice is made for them.
        for primary in (True, False):
            for match in (tag, base):
                for voice in self.voices:
                    langs = voice.languages[:1] if primary and voice.custom else voice.languages
                    if any(_tag_matches(lang, match) for lang in langs):
                        return voice
        return None

    @property
    def names(self) -> list[str]:
        return [v.name for v in self.voices]

    def resolve(
        self, request: dict[str, str], *, default: str | None, text_language: str | None
    ) -> Voice:
        """The voice for a request's ``voice`` {name, language, speaker}; raises if unknown.

        Nothing asked for: the configured default, else a voice of ``text_language`` (the
        text's, as :mod:`~wyoming_cosyvoice.pipeline.sentences` detected it), else the first voice.
        """
        if not self.voices:
            raise VoiceNotFoundError("this model has no speakers to synthesize with")
        available = ", ".join(self.names)
        chosen: Voice | None = None
        if name := request.get("name"):
            chosen = self.find(name)
            if chosen is None and _LANGUAGE_TAG.fullmatch(name):
                # wyoming <= 1.9 parsed a language-only voice into name=<language>
                chosen = self.for_language(name)
            if chosen is None:
                raise VoiceNotFoundError(f"unknown voice {name!r}; available: {available}")
        elif language := request.get("language"):
            chosen = self.for_language(language)
            if chosen is None:
                raise VoiceNotFoundError(
                    f"no voice for language {language!r}; available: {available}"
                )
        if speaker := request.get("speaker"):
            chosen = self.find(speaker)
            if chosen is None:
                raise VoiceNotFoundError(f"unknown speaker {speaker!r}; available: {available}")
        if chosen is None and default:
            chosen = self.find(default)
        if chosen is None:
            by_text = self.for_language(text_language) if text_language else None
            chosen = by_text or self.voices[0]
        return chosen


def _tag_matches(language: str, wanted: str) -> bool:
    """``zh_CN`` matches ``zh_cn`` (exact) and ``zh`` (bare language)."""
    lang = language.casefold()
    return lang == wanted or ("_" not in wanted and lang.split("_")[0] == wanted)
