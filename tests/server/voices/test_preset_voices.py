"""Presets as voices, for Home Assistant's voice pickers: ``en-female (slow)`` names a voice at
a preset, end to end through the real server over TCP (the fake engine of test_server_speed,
which keeps every request's options).

Home Assistant shows a Wyoming voice by its description and stores its name; an Assist
pipeline's default voice is the first of its language by description. Its speakers are never
shown, and ``speaker`` is dropped from a call without ``voice``.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from typing import Any

import pytest
import yaml
from test_server_speed import FIXED, CosyVoice2Engine, SpeedEngine, describe

from engine.family import INSTRUCT2
from wyoming_cosyvoice.config import ConfigError, load_config, packaged_settings
from wyoming_cosyvoice.home_assistant import addon
from wyoming_cosyvoice.voices.presets import SPEEDS, STYLES, is_preset_name

TEXT = "The washing machine has finished."


def voices_by_language(info: Any) -> dict[str, list[tuple[str, str]]]:
    """(description, name) of the voices Home Assistant offers per language, in its order."""
    offered: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for voice in info.tts[0].voices:
        for language in voice.languages:
            offered[language].append((voice.description or voice.name, voice.name))
    return {language: sorted(voices) for language, voices in offered.items()}


async def served(wy: Any, engine: type, settings: dict[str, Any], *requests: dict[str, Any],
                 streamed: bool = False) -> tuple[Any, list[Any], list[Any]]:  # fmt: skip
    """(describe's info, each request's reply, the options the engine got)."""
    # no repeat cache: every request reaches the engine
    async with wy.fake_server({**FIXED, "cache.max_mb": 0, **settings}, engine=engine) as server:
        info = await describe(server.port, wy)
        send = wy.stream if streamed else wy.synthesize
        replies = [await send(server.port, TEXT, voice=voice) for voice in requests]
        return info, replies, server.engines[0].options


def test_the_listed_presets_are_voices_after_their_voice(wy: Any) -> None:
    listed = {"server.preset_voices": ["slow", "fast", "calm"]}
    info, _, _ = asyncio.run(served(wy, SpeedEngine, listed))
    names = {v.name: v for v in info.tts[0].voices}
    assert {"en-female", "en-female (slow)", "en-female (fast)"} <= names.keys()
    assert not [n for n in names if "calm" in n]  # a style this model cannot speak: not listed
    slow, plain = names["en-female (slow)"], names["en-female"]
    assert slow.description.startswith(plain.description) and "slow" in slow.description
    assert slow.languages == plain.languages
    # Each language's first voice, a pipeline's default, is still a plain voice.
    for language, offered in voices_by_language(info).items():
        assert "(" not in offered[0][1], (language, offered[:3])


def test_styles_are_listed_with_a_model_that_speaks_them(wy: Any) -> None:
    info, _, _ = asyncio.run(served(wy, CosyVoice2Engine, {"server.preset_voices": ["calm-slow"]}))
    assert "en-female (calm-slow)" in {v.name for v in info.tts[0].voices}


def test_by_default_only_the_plain_voices_are_listed(wy: Any) -> None:
    info, _, _ = asyncio.run(served(wy, SpeedEngine, {}))
    assert not [v.name for v in info.tts[0].voices if "(" in v.name]


@pytest.mark.parametrize("streamed", [False, True])
def test_a_preset_voice_speaks_its_voice_at_the_preset(wy: Any, streamed: bool) -> None:
    # Understood whether listed or not (a name kept in an automation keeps working).
    _, replies, options = asyncio.run(served(
        wy, SpeedEngine, {"server.speed": 1.1}, {"name": "en-female (slow)"},
        {"name": " EN-Female(Fast) "}, {"name": "en-female (slow)", "speaker": "fast"},
        {"name": "en-female"}, streamed=streamed))  # fmt: skip
    assert [r.error() for r in replies] == [None] * 4
    assert {o.speaker for o in options} == {"英文女"}
    # the preset's speed; a speaker that names a preset wins; no preset: the server's speed
    assert [o.speed for o in options] == [SPEEDS["slow"], SPEEDS["fast"], SPEEDS["fast"], 1.1]


def test_a_style_voice_is_the_models_instruction_and_a_free_text_speaker_wins(wy: Any) -> None:
    _, replies, options = asyncio.run(served(
        wy, CosyVoice2Engine, {}, {"name": "en-female (calm-slow)"},
        {"name": "en-female (calm-slow)", "speaker": "用四川话说这句话"}))  # fmt: skip
    assert [r.error() for r in replies] == [None, None]
    assert (options[0].instruct, options[0].speed) == (STYLES["calm"][INSTRUCT2], 0.8)
    assert (options[1].instruct, options[1].speed) == ("用四川话说这句话", 0.8)


@pytest.mark.parametrize(("name", "says", "code"), [
    ("en-female (calm)", "voice 'en-female (calm)' asks for the speaking style 'calm', which "
     "needs the CosyVoice-300M-Instruct or CosyVoice2-0.5B model",
     "StyleUnsupportedError"),
    ("en-female (loud)", "unknown voice 'en-female (loud)'", "VoiceNotFoundError"),
    ("nobody (slow)", "unknown voice 'nobody (slow)'", "VoiceNotFoundError"),
])  # fmt: skip
def test_a_preset_voice_that_cannot_be_spoken_is_a_clear_error(
    wy: Any, name: str, says: str, code: str
) -> None:
    _, replies, options = asyncio.run(served(wy, SpeedEngine, {}, {"name": name}))
    error = replies[0].error()
    assert error is not None and says in error.text and error.code == code
    assert options == []


def test_the_setting_takes_presets_only() -> None:
    assert load_config(None, [("server.preset_voices", ["Slow", "slow", "sad-fast"])]
                       ).preset_voices == ("slow", "sad-fast")  # fmt: skip
    with pytest.raises(ConfigError, match=r"server.preset_voices\[1\].*'loud' is not a preset"):
        load_config(None, [("server.preset_voices", ["slow", "loud"])])
    with pytest.raises(ConfigError, match="server.preset_voices"):
        load_config(None, [("server.preset_voices", 3)])


def test_the_add_on_option_offers_every_preset_and_reaches_the_server(wy: Any) -> None:
    from wyoming_cosyvoice.__main__ import build_parser, config_from_args

    manifest = yaml.safe_load((wy.ROOT / "addon/config.yaml").read_text())
    default = packaged_settings()["server"]["preset_voices"]
    assert manifest["options"]["preset_voices"] == default
    (item,) = manifest["schema"]["preset_voices"]
    offered = item.removeprefix("list(").removesuffix(")").split("|")
    every = [*SPEEDS, *STYLES, *(f"{s}-{v}" for s, v in itertools.product(STYLES, SPEEDS)
                                 if v != "normal")]  # fmt: skip
    assert sorted(offered) == sorted(every) and all(is_preset_name(p) for p in offered)
    args = addon.options_to_args({"preset_voices": ["slow", "calm-fast"]})
    config = config_from_args(build_parser().parse_args(args))
    assert config.preset_voices == ("slow", "calm-fast")
