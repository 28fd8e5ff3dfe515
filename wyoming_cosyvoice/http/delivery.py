"""How fast and in which style an HTTP request is spoken: ``speed``, ``style`` and the preset
speakers Wyoming offers (:mod:`wyoming_cosyvoice.voices.presets`), checked into one speed and
one instruction.

``speed`` on ``/tts`` is the engine's range, 0.5 to 2.0; anything else is a 400. On
``/v1/audio/speech`` it is OpenAI's parameter, whose range is 0.25 to 4.0: a value in OpenAI's
range is accepted and clamped to the engine's (a client written for OpenAI keeps working, a
little less fast or slow than asked); outside OpenAI's range it is a 400, as OpenAI answers.
"""

from __future__ import annotations

from typing import Any

from engine.core.types import MAX_SPEED, MIN_SPEED
from wyoming_cosyvoice.http.errors import HttpError
from wyoming_cosyvoice.voices.catalog import VoiceCatalog
from wyoming_cosyvoice.voices.presets import (
    INSTRUCT_MODELS,
    STYLES,
    SpeakerPreset,
    StyleUnsupportedError,
    split_preset,
    style_instruction,
)

OPENAI_SPEEDS = (0.25, 4.0)


def speaker_preset(
    speaker: str | None, catalog: VoiceCatalog, form: str | None
) -> tuple[str | None, SpeakerPreset | None]:
    """(speaker left to name a voice, preset): ``speaker`` is a preset when it names one."""
    try:
        rest, preset = split_preset({"speaker": speaker} if speaker else {}, catalog, form)
    except StyleUnsupportedError as err:
        raise HttpError(400, str(err), code="style_unsupported", param="speaker") from err
    return rest.get("speaker"), preset


def _speed(data: dict[str, Any], openai: bool) -> float | None:
    value = data.get("speed")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HttpError(400, f"'speed' must be a number, not {value!r}", param="speed")
    low, high = OPENAI_SPEEDS if openai else (MIN_SPEED, MAX_SPEED)
    if not low <= value <= high:  # NaN cannot come from JSON
        raise HttpError(400, f"'speed' must be from {low:g} to {high:g} (1 = normal), not "
                        f"{value!r}", param="speed")  # fmt: skip
    return min(max(float(value), MIN_SPEED), MAX_SPEED)


def _style(data: dict[str, Any], form: str | None) -> str | None:
    """The instruction of the request's ``style``, for a model reading instructions in
    ``form`` (engine.api)."""
    style = data.get("style")
    if style is None or style == "":
        return None
    if not isinstance(style, str):
        raise HttpError(400, f"'style' must be a style name, not {style!r}", param="style")
    name = style.strip().casefold()
    if name not in STYLES:
        raise HttpError(400, f"unknown style {style!r}; styles: {', '.join(STYLES)}",
                        code="unknown_style", param="style")  # fmt: skip
    if form is None:
        raise HttpError(400, f"'style' needs the {INSTRUCT_MODELS} model; the model this server "
                        "runs takes no instructions", code="style_unsupported",
                        param="style")  # fmt: skip
    try:
        return style_instruction(name, form, f"'style' {style!r}")
    except StyleUnsupportedError as err:
        raise HttpError(400, str(err), code="style_unsupported", param="style") from err


def delivery(
    data: dict[str, Any],
    *,
    form: str | None,
    default_speed: float,
    preset: SpeakerPreset | None = None,
    instructions: str | None = None,
    instructions_field: str = "instructions",
    openai: bool = False,
) -> tuple[float, str | None]:
    """(speed, instruction) of a request: its ``speed`` and ``style`` fields, else its preset
    speaker's, else the server's speed and no instruction. ``instructions`` (free text, from
    the field ``instructions_field``: OpenAI's ``instructions``, or a ``speaker`` that names no
    voice) and ``style`` are two ways to say the same thing: one request gives one."""
    speed = _speed(data, openai)
    style = _style(data, form)
    if style is not None and instructions:
        raise HttpError(400, f"give either 'style' or an instruction in '{instructions_field}',"
                        " not both", param="style")  # fmt: skip
    if speed is None:
        speed = preset.speed if preset is not None and preset.speed is not None else default_speed
    if style is None and preset is not None:
        style = preset.instruction
    return speed, style or instructions
