"""Speed and styles over HTTP, end to end through the real server: ``speed`` and ``style`` on
``/tts`` and ``/v1/audio/speech`` (OpenAI's range clamped to the engine's), the preset speakers
on ``/tts``, and ``/voices`` listing them."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from test_http import BackgroundServer, httpx
from test_server_speed import InstructEngine, SpeedEngine

from engine.family import DESCRIBED_SPEAKER
from wyoming_cosyvoice.voices.presets import STYLES

FIXED = {"server.profile": "realtime"}
_NUMBERS = itertools.count()


def text() -> str:
    """A sentence no request spoke before (a repeat would come from the repeat cache, without
    the engine), always as long (the fake engine's audio follows the length)."""
    return f"Message {next(_NUMBERS):04d} says the washing has finished."


@pytest.fixture(scope="module")
def sft() -> Iterator[BackgroundServer]:
    with BackgroundServer(FIXED, engine_factory=SpeedEngine, wyoming=False) as server:
        yield server


@pytest.fixture(scope="module")
def instruct() -> Iterator[BackgroundServer]:
    with BackgroundServer(FIXED, engine_factory=InstructEngine, wyoming=False) as server:
        yield server


def _post(server: BackgroundServer, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.client() as client:
        return client.post(path, json=body)


def _last_options(server: BackgroundServer) -> Any:
    return server.engines[0].options[-1]


def _pcm_samples(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return len(response.content) // 2


@pytest.mark.parametrize("path,text_key", [("/tts", "text"), ("/v1/audio/speech", "input")])
def test_speed_makes_the_audio_one_over_speed_as_long(
    sft: BackgroundServer, path: str, text_key: str
) -> None:
    def samples(speed: float | None) -> int:
        body: dict[str, Any] = {text_key: text(), "voice": "en-female"}
        body["format" if path == "/tts" else "response_format"] = "pcm"
        if speed is not None:
            body["speed"] = speed
        return _pcm_samples(_post(sft, path, body))

    normal = samples(None)
    for speed in (0.5, 0.8, 1.25, 2.0):
        assert abs(samples(speed) - normal / speed) <= 0.01 * normal, speed
        assert _last_options(sft).speed == speed


def test_openai_speeds_outside_the_engines_range_are_clamped(sft: BackgroundServer) -> None:
    for asked, used in ((0.25, 0.5), (4.0, 2.0), (3, 2.0)):
        response = _post(sft, "/v1/audio/speech", {"input": text(), "speed": asked})
        assert response.status_code == 200, response.text
        assert _last_options(sft).speed == used


@pytest.mark.parametrize(
    "path,body,message",
    [
        ("/v1/audio/speech", {"input": text(), "speed": 0.2}, "from 0.25 to 4"),
        ("/v1/audio/speech", {"input": text(), "speed": 4.5}, "from 0.25 to 4"),
        ("/v1/audio/speech", {"input": text(), "speed": "fast"}, "must be a number"),
        ("/tts", {"text": text(), "speed": 0.4}, "from 0.5 to 2"),
        ("/tts", {"text": text(), "speed": 2.5}, "from 0.5 to 2"),
        ("/tts", {"text": text(), "speed": True}, "must be a number"),
    ],
)
def test_a_speed_out_of_range_is_a_400_naming_the_range(
    sft: BackgroundServer, path: str, body: dict[str, Any], message: str
) -> None:
    response = _post(sft, path, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "speed" and message in error["message"]


def test_tts_takes_the_preset_speakers(sft: BackgroundServer) -> None:
    for speaker, speed in (("slow", 0.8), ("fast", 1.25), ("normal", 1.0)):
        response = _post(sft, "/tts", {"text": text(), "voice": "en-female", "speaker": speaker})
        assert response.status_code == 200, response.text
        assert (_last_options(sft).speaker, _last_options(sft).speed) == ("英文女", speed)
    # the speed field wins over the speaker's; a speaker naming a voice still picks it
    _post(sft, "/tts", {"text": text(), "speaker": "slow", "speed": 1.5})
    assert _last_options(sft).speed == 1.5
    _post(sft, "/tts", {"text": text(), "voice": "en-female", "speaker": "zh-male"})
    assert (_last_options(sft).speaker, _last_options(sft).speed) == ("中文男", 1.0)


@pytest.mark.parametrize("path,text_key", [("/tts", "text"), ("/v1/audio/speech", "input")])
def test_styles_by_name_are_the_models_instructions(
    instruct: BackgroundServer, path: str, text_key: str
) -> None:
    response = _post(instruct, path, {text_key: text(), "style": "cheerful", "speed": 1.25})
    assert response.status_code == 200, response.text
    options = _last_options(instruct)
    assert (options.instruct, options.speed) == (STYLES["cheerful"][DESCRIBED_SPEAKER], 1.25)


def test_tts_takes_a_style_speaker(instruct: BackgroundServer) -> None:
    response = _post(instruct, "/tts", {"text": text(), "voice": "en-male", "speaker": "sad-slow"})
    assert response.status_code == 200, response.text
    options = _last_options(instruct)
    assert (options.speaker, options.instruct, options.speed) == (
        "英文男",
        STYLES["sad"][DESCRIBED_SPEAKER],
        0.8,
    )


@pytest.mark.parametrize(
    "body,code",
    [
        ({"input": text(), "style": "grumpy"}, "unknown_style"),
        ({"input": text(), "style": 3}, None),
        ({"input": text(), "style": "calm", "instructions": "Speak softly."}, None),
    ],
)
def test_a_bad_style_is_a_400(instruct: BackgroundServer, body: dict[str, Any], code: str) -> None:
    response = _post(instruct, "/v1/audio/speech", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "style" and error["code"] == code


def test_a_style_needs_a_model_that_takes_instructions(sft: BackgroundServer) -> None:
    for path, body, param in (
        ("/tts", {"text": text(), "style": "calm"}, "style"),
        ("/v1/audio/speech", {"input": text(), "style": "calm"}, "style"),
        ("/tts", {"text": text(), "speaker": "calm-slow"}, "speaker"),
    ):
        response = _post(sft, path, body)
        assert response.status_code == 400, (path, body)
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("style_unsupported", param)
        assert "CosyVoice-300M-Instruct or CosyVoice2-0.5B" in error["message"]


def test_voices_lists_the_speakers_and_the_servers_speed(
    sft: BackgroundServer, instruct: BackgroundServer
) -> None:
    with sft.client() as client:
        plain = client.get("/voices").json()
    with instruct.client() as client:
        styled = client.get("/voices").json()
    assert plain["speakers"] == ["slow", "normal", "fast"] and plain["speed"] == 1.0
    assert styled["speakers"] == ["slow", "normal", "fast", *STYLES]
