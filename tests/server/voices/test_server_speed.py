"""Speeds and styles as Wyoming speakers, end to end through the real server over TCP.

``describe`` lists each voice's speakers; a ``synthesize`` (or a stream) whose ``voice.speaker``
names a speed or style reaches the engine as its options. The engine is the conftest fake, made
to honour the speed as the real one does (audio ``1 / speed`` as long; the real engine's
stretch is tested in test_speed.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FakeEngine
from wyoming.event import Event
from wyoming.info import Describe, Info

from engine.core.types import AudioChunk
from engine.family import DESCRIBED_SPEAKER, INSTRUCT2
from wyoming_cosyvoice.voices.presets import SPEEDS, STYLES

STYLE_NAMES = list(STYLES)
# A fixed profile: what these tests check does not depend on the profile a request gets.
FIXED = {"server.profile": "realtime"}


class SpeedEngine(FakeEngine):
    """The fake engine, whose audio lasts ``1 / options.speed`` as long; keeps every options."""

    kind = "sft"

    def __init__(self, model_dir: Path, threads: int | None = None) -> None:
        super().__init__(model_dir, threads, delay=0.0)
        self.options: list[Any] = []

    def synthesize(
        self, text: str, options: Any, cancel: threading.Event | None = None
    ) -> Iterator[AudioChunk]:
        self.options.append(options)
        for chunk in super().synthesize(text, options, cancel):
            length = round(len(chunk.samples) / options.speed)
            positions = np.linspace(0, len(chunk.samples) - 1, length)
            stretched = np.interp(positions, np.arange(len(chunk.samples)), chunk.samples)
            yield AudioChunk(stretched.astype(np.float32))


class InstructEngine(SpeedEngine):
    kind, instruction_form = "instruct", DESCRIBED_SPEAKER


class CosyVoice2Engine(SpeedEngine):
    kind, instruction_form = "cosyvoice2", INSTRUCT2


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def describe(port: int, wy: Any) -> Info:
    async with wy.connect(port) as client:
        await client.write_event(Describe().event())
        while not Info.is_type((event := await asyncio.wait_for(client.read_event(), 5)).type):
            pass
    return Info.from_event(event)


async def samples_by_speaker(
    wy: Any, speakers: list[str | None], *, streamed: bool = False
) -> dict[str | None, int]:
    """Audio samples of one sentence per speaker, each its own request."""
    text = "The washing machine has finished."
    out: dict[str | None, int] = {}
    async with wy.fake_server(FIXED, engine=SpeedEngine) as server:
        for speaker in speakers:
            voice = {"name": "en-female", **({"speaker": speaker} if speaker else {})}
            send = wy.stream if streamed else wy.synthesize
            reply = await send(server.port, text, voice=voice)
            assert reply.error() is None, reply.error()
            out[speaker] = reply.samples
    return out


# --- describe ---------------------------------------------------------------------------------


def test_every_voice_lists_the_speeds(wy: Any) -> None:
    async def main() -> Info:
        async with wy.fake_server(FIXED, engine=SpeedEngine) as server:
            return await describe(server.port, wy)

    voices = run(main()).tts[0].voices
    assert voices
    for voice in voices:
        assert [s.name for s in voice.speakers or []] == ["slow", "normal", "fast"]


@pytest.mark.parametrize("engine", [InstructEngine, CosyVoice2Engine])
def test_models_that_take_instructions_list_the_styles_too(wy: Any, engine: type) -> None:
    async def main() -> Info:
        async with wy.fake_server(FIXED, engine=engine) as server:
            return await describe(server.port, wy)

    for voice in run(main()).tts[0].voices:
        names = [s.name for s in voice.speakers or []]
        assert names == [*SPEEDS, *STYLE_NAMES]


def test_the_speakers_are_listed_while_the_model_loads(wy: Any) -> None:
    """Before the load the model directory's name says which speakers it will offer."""

    class SlowLoad(InstructEngine):
        def __init__(self, model_dir: Path, threads: int | None = None) -> None:
            release.wait(10)
            super().__init__(model_dir, threads)

    release = threading.Event()

    async def main(model_dir: Path) -> Info:
        async with wy.fake_server(FIXED, engine=SlowLoad, model_dir=model_dir,
                                  wait_ready=False) as server:  # fmt: skip
            try:
                return await describe(server.port, wy)
            finally:
                release.set()

    instruct = wy.TINY_MODEL.parent / "CosyVoice-300M-Instruct"
    assert not instruct.exists()  # the engine factory is a fake: the path is only a name
    program = run(main(instruct)).tts[0]
    for voice in program.voices:
        assert [s.name for s in voice.speakers or []] == [*SPEEDS, *STYLE_NAMES]


# --- speeds ------------------------------------------------------------------------------------


@pytest.mark.parametrize("streamed", [False, True])
def test_slow_speaks_longer_and_fast_shorter_than_normal(wy: Any, streamed: bool) -> None:
    samples = run(samples_by_speaker(wy, ["normal", "slow", "fast", None], streamed=streamed))
    normal = samples["normal"]
    assert samples[None] == normal  # no speaker: the server's speed, 1.0 by default
    assert samples["slow"] > normal > samples["fast"]
    assert abs(samples["slow"] - normal / 0.8) <= 0.01 * normal
    assert abs(samples["fast"] - normal / 1.25) <= 0.01 * normal


def test_the_servers_speed_is_the_speed_of_a_request_that_names_none(wy: Any) -> None:
    async def main() -> list[float]:
        async with wy.fake_server({**FIXED, "server.speed": 0.9}, engine=SpeedEngine) as server:
            for speaker in (None, "fast", "normal"):
                voice = {"name": "en-female", **({"speaker": speaker} if speaker else {})}
                reply = await wy.synthesize(server.port, "Hello there.", voice=voice)
                assert reply.error() is None
            return [o.speed for o in server.engines[0].options]

    assert run(main()) == [0.9, 1.25, 1.0]


def test_a_speaker_that_names_a_voice_still_picks_the_voice(wy: Any) -> None:
    async def main() -> list[tuple[str, float]]:
        async with wy.fake_server(FIXED, engine=SpeedEngine) as server:
            voice = {"name": "en-female", "speaker": "zh-female"}
            reply = await wy.synthesize(server.port, "Hello there.", voice=voice)
            assert reply.error() is None
            return [(o.speaker, o.speed) for o in server.engines[0].options]

    assert run(main()) == [("中文女", 1.0)]


# --- styles ------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", [InstructEngine, CosyVoice2Engine])
def test_a_style_speaker_is_the_models_instruction(wy: Any, engine: type) -> None:
    form = engine.instruction_form

    async def main() -> list[tuple[str | None, float]]:
        async with wy.fake_server(FIXED, engine=engine) as server:
            for speaker in ("calm", "Cheerful-Slow", "fast-sad", "Speak like a pirate."):
                voice = {"name": "en-female", "speaker": speaker}
                reply = await wy.synthesize(server.port, "Hello there.", voice=voice)
                assert reply.error() is None, reply.error()
            return [(o.instruct, o.speed) for o in server.engines[0].options]

    assert run(main()) == [
        (STYLES["calm"][form], 1.0),
        (STYLES["cheerful"][form], 0.8),
        (STYLES["sad"][form], 1.25),
        ("Speak like a pirate.", 1.0),  # no preset: a free-text instruction, as before
    ]


def test_a_style_streams_too(wy: Any) -> None:
    async def main() -> list[tuple[str | None, float]]:
        async with wy.fake_server(FIXED, engine=InstructEngine) as server:
            voice = {"name": "en-female", "speaker": "calm-fast"}
            reply = await wy.stream(server.port, "One. Two.", voice=voice)
            assert reply.error() is None and reply.types[-1] == "synthesize-stopped"
            return [(o.instruct, o.speed) for o in server.engines[0].options]

    assert run(main()) == [(STYLES["calm"][DESCRIBED_SPEAKER], 1.25)] * 2


def test_a_style_with_a_model_without_instructions_is_refused_with_the_reason(wy: Any) -> None:
    async def main() -> Any:
        async with wy.fake_server(FIXED, engine=SpeedEngine) as server:
            voice = {"name": "en-female", "speaker": "calm"}
            reply = await wy.synthesize(server.port, "Hello there.", voice=voice)
            assert server.engines[0].options == []
            return reply.error()

    error = run(main())
    assert error is not None and error.code == "StyleUnsupportedError"
    assert "CosyVoice-300M-Instruct or CosyVoice2-0.5B" in error.text
    assert "slow, normal, fast" in error.text


def test_a_stream_with_an_unknown_speaker_still_ends_with_an_error(wy: Any) -> None:
    """With a model without instructions a speaker that is neither a preset nor a voice is
    refused, as before presets existed."""

    async def main() -> Any:
        async with wy.fake_server(FIXED, engine=SpeedEngine) as server:
            voice = {"name": "en-female", "speaker": "very-slow"}
            reply = await wy.stream(server.port, "Hello there.", voice=voice)
            return reply.error()

    error = run(main())
    assert error is not None and error.code == "VoiceNotFoundError"


def test_describe_then_speak_with_every_listed_speaker(wy: Any) -> None:
    """What describe lists is what a request may ask: each listed speaker speaks."""

    async def main() -> list[str]:
        async with wy.fake_server(FIXED, engine=InstructEngine) as server:
            info = await describe(server.port, wy)
            voice = info.tts[0].voices[0]
            spoken = []
            for speaker in voice.speakers or []:
                request = {"name": voice.name, "speaker": speaker.name}
                async with wy.connect(server.port) as client:
                    await client.write_event(Event("synthesize", {"text": "Hi.", "voice": request}))
                    reply = await wy.read_until(client, ("audio-stop", "error"))
                assert reply.error() is None, (speaker.name, reply.error())
                spoken.append(speaker.name)
            return spoken

    assert run(main()) == [*SPEEDS, *STYLE_NAMES]


# --- the preset names, the server's speed, the add-on option -------------------------------------


@pytest.mark.parametrize(
    "name,expected",
    [
        ("slow", (0.8, None)),
        (" Fast ", (1.25, None)),
        ("calm", (None, "calm")),
        ("calm-slow", (0.8, "calm")),
        ("slow-calm", (0.8, "calm")),
        ("calm-calm", None),
        ("slow-fast", None),
        ("calm-sad", None),
        ("calm-slow-fast", None),
        ("slower", None),
        ("zh-female", None),
    ],
)
def test_preset_names(name: str, expected: tuple[float | None, str | None] | None) -> None:
    from wyoming_cosyvoice.voices.presets import find_preset

    preset = find_preset(name, DESCRIBED_SPEAKER)
    assert (None if preset is None else (preset.speed, preset.style)) == expected


def test_the_servers_speed_is_checked() -> None:
    from wyoming_cosyvoice.config import ConfigError, load_config

    assert load_config(None, [("server.speed", 1.25)]).speed == 1.25
    for bad in (0.4, 2.5, "fast", True):
        with pytest.raises(ConfigError, match="server.speed"):
            load_config(None, [("server.speed", bad)])


def test_the_addon_speed_option_sets_the_servers_speed() -> None:
    from wyoming_cosyvoice.home_assistant import addon

    assert "server.speed=0.8" in addon.options_to_args({"speed": 0.8})
    assert not any("server.speed" in arg for arg in addon.options_to_args({"speed": 1.0}))
    for bad in (0.3, 2.5, "fast"):
        with pytest.raises(ValueError, match="option 'speed'"):
            addon.options_to_args({"speed": bad})
