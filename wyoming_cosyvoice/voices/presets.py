"""The speakers every voice offers per call: speeds, and speaking styles where the model takes
instructions.

Home Assistant forwards two fields per call, ``voice.name`` and ``voice.speaker`` (``tts.speak``
options ``voice`` + ``speaker``), and ``describe`` lists each voice's ``speakers``. So a speaker
is how a call asks for a speed or a style:

* speeds, for every model: ``slow`` (0.8), ``normal`` (1.0), ``fast`` (1.25); 1.25 and its
  inverse 0.8 are as far as speech stays natural with the mel resampled in time (engine.core.speed);
* styles, for the models that take an instruction: ``calm``, ``cheerful``, ``sad``,
  ``serious``, each an instruction in the form that model was trained on (CosyVoice-300M-Instruct:
  an English description of the speaker; CosyVoice2-0.5B: a short Chinese request, as the
  official examples' ``用四川话说这句话``; Fun-CosyVoice3-0.5B: only the styles of the official
  list of instructions it was trained on, ``cheerful`` and ``sad``, in its words — a style it
  was not trained on is refused, saying which models speak it);
* a style and a speed joined by a dash: ``calm-slow``, ``cheerful-fast`` (accepted, not listed:
  the list stays short).

A speaker that names a preset is that preset, even where a voice has the same name; any other
speaker keeps its meaning (a voice's name, or a free-text instruction:
:func:`wyoming_cosyvoice.pipeline.speech.split_instruction`).

Home Assistant's voice pickers (an Assist pipeline's voice, the media browser) show voices
only, never their speakers, and it drops ``speaker`` from a call without ``voice``. So a voice
name may carry a preset too: ``en-female (slow)`` is ``en-female`` at the ``slow`` preset. The
server always understands such a name; ``server.preset_voices`` lists the presets it names also
as voices of their own in ``describe`` (:func:`listed_presets`), so that a pipeline can pick
one. A speaker that names a preset wins over the voice name's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engine.family import DESCRIBED_SPEAKER, INSTRUCT2, INSTRUCT3, instruct_models
from wyoming_cosyvoice.errors import VoiceNotFoundError
from wyoming_cosyvoice.voices.catalog import VoiceCatalog

SPEEDS = {"slow": 0.8, "normal": 1.0, "fast": 1.25}
# style -> instruction, in each form a model reads one (engine.api: its instruction_form); a
# form without the style: its models were not trained on such an instruction
STYLES: dict[str, dict[str, str]] = {
    "calm": {
        DESCRIBED_SPEAKER: "A calm speaker with a gentle, even tone.",
        INSTRUCT2: "用平静的语气说这句话",
    },
    "cheerful": {
        DESCRIBED_SPEAKER: "A cheerful speaker with a bright, happy tone.",
        INSTRUCT2: "用开心的语气说这句话",
        INSTRUCT3: "请非常开心地说一句话。",
    },
    "sad": {
        DESCRIBED_SPEAKER: "A sad speaker with a low, soft tone.",
        INSTRUCT2: "用悲伤的语气说这句话",
        INSTRUCT3: "请非常伤心地说一句话。",
    },
    "serious": {
        DESCRIBED_SPEAKER: "A serious speaker with a firm, steady tone.",
        INSTRUCT2: "用严肃的语气说这句话",
    },
}
INSTRUCT_MODELS = " or ".join(instruct_models())
# "<voice> (<preset>)": a voice name carrying a preset
_PRESET_VOICE = re.compile(r"(?P<voice>.*\S)\s*\(\s*(?P<preset>[^()]*?)\s*\)")


@dataclass(frozen=True)
class SpeakerPreset:
    """What a preset speaker asks for: a speed, an instruction, or both (None: not set)."""

    name: str
    speed: float | None = None
    style: str | None = None
    instruction: str | None = None


class StyleUnsupportedError(VoiceNotFoundError):
    """A speaking style asked of a model that takes no instructions."""


def styles_of(form: str | None) -> list[str]:
    """The styles a model reading instructions in ``form`` (None: it takes none) speaks."""
    return [style for style, phrases in STYLES.items() if form in phrases]


def takes_styles(form: str | None) -> bool:
    """Whether a model reading instructions in ``form`` (None: it takes none) has styles."""
    return bool(styles_of(form))


def speaker_names(form: str | None) -> list[str]:
    """The speakers ``describe`` lists for each voice of a model of this instruction form."""
    return [*SPEEDS, *styles_of(form)]


def style_instruction(style: str, form: str | None, asked_by: str) -> str:
    """The instruction of ``style`` (one of :data:`STYLES`) for a model reading instructions in
    ``form``; :class:`StyleUnsupportedError` saying ``asked_by`` (the field that asked) and
    which models speak it, if this one does not."""
    phrases = STYLES[style]
    if form in phrases:
        return phrases[form]
    models = " or ".join(instruct_models(phrases))
    mine = (
        f"its styles are {', '.join(styles_of(form))}"
        if takes_styles(form)
        else f"this model's speakers are {', '.join(SPEEDS)}"
    )
    raise StyleUnsupportedError(
        f"{asked_by} asks for the speaking style {style!r}, which needs the {models} model; {mine}"
    )


def is_preset_name(name: str) -> bool:
    """Whether ``name`` is a preset for some model (a speed, a style, or both)."""
    return _parts(name) is not None


def listed_presets(names: Iterable[str], form: str | None) -> list[str]:
    """The presets of ``server.preset_voices`` a model of this instruction form speaks: styles
    only where it takes instructions."""
    return [n for n in names if (parts := _parts(n)) and parts[0] in (None, *styles_of(form))]


def preset_voice_name(voice: str, preset: str) -> str:
    """The name of a voice at a preset, as ``describe`` lists it."""
    return f"{voice} ({preset})"


def with_presets(
    err: VoiceNotFoundError, request: Mapping[str, str], catalog: VoiceCatalog, form: str | None
) -> VoiceNotFoundError:
    """``err`` for a request whose speaker is unknown, with the preset speakers it could have
    named besides the voices (Wyoming and HTTP say the same); else ``err`` itself."""
    speaker = request.get("speaker")
    if not speaker or catalog.find(speaker) is not None:
        return err
    what = "a speed or style" if takes_styles(form) else "a speed"
    return VoiceNotFoundError(f"{err}; or a speaker for {what}: {', '.join(speaker_names(form))}")


def _parts(name: str) -> tuple[str | None, str | None] | None:
    """(style, speed) a preset name is made of; None if it is not one."""
    words = name.strip().casefold().split("-")
    if len(words) > 2 or len(set(words)) < len(words):
        return None
    styles = [w for w in words if w in STYLES]
    speeds = [w for w in words if w in SPEEDS]
    if len(styles) + len(speeds) != len(words) or len(styles) > 1 or len(speeds) > 1:
        return None
    return (styles[0] if styles else None), (speeds[0] if speeds else None)


def find_preset(name: str, form: str | None, asked_by: str = "") -> SpeakerPreset | None:
    """The preset ``name`` is for a model reading instructions in ``form``; None if it is
    none. A style with a model that takes no instructions raises :class:`StyleUnsupportedError`
    (saying ``asked_by``, the field that asked: the speaker unless given)."""
    parts = _parts(name)
    if parts is None:
        return None
    style, speed = parts
    instruction = None
    if style is not None:
        instruction = style_instruction(style, form, asked_by or f"speaker {name!r}")
    speed_value = SPEEDS[speed] if speed is not None else None
    return SpeakerPreset(name.strip().casefold(), speed_value, style, instruction)


def split_preset(
    request: Mapping[str, str] | None, catalog: VoiceCatalog, form: str | None
) -> tuple[dict[str, str], SpeakerPreset | None]:
    """(voice request, preset): ``speaker`` taken out of the request when it names a preset,
    else the preset of a voice name ``<voice> (<preset>)`` (the name then names the voice).

    With a model that takes no instructions a style name that is also a voice's name stays that
    voice (as before styles existed); otherwise it is refused with the reason.
    """
    wanted, named = _split_voice_name(request, catalog, form)
    speaker = wanted.get("speaker")
    if not speaker:
        return wanted, named
    try:
        preset = find_preset(speaker, form)
    except StyleUnsupportedError:
        if catalog.find(speaker) is not None:
            return wanted, None
        raise
    if preset is not None:
        del wanted["speaker"]
    return wanted, preset or named


def _split_voice_name(
    request: Mapping[str, str] | None, catalog: VoiceCatalog, form: str | None
) -> tuple[dict[str, str], SpeakerPreset | None]:
    """(voice request, preset) of a voice name ``<voice> (<preset>)``; a name the catalogue
    knows as it is, or whose parts are no voice and preset, is left as it is."""
    wanted = dict(request or {})
    name = wanted.get("name")
    if not name or catalog.find(name) is not None:
        return wanted, None
    match = _PRESET_VOICE.fullmatch(name.strip())
    if match is None or catalog.find(match["voice"]) is None:
        return wanted, None
    # (a style the model cannot speak raises, naming the voice)
    preset = find_preset(match["preset"], form, f"voice {name!r}")
    if preset is not None:
        wanted["name"] = match["voice"]
    return wanted, preset
