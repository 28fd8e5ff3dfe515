"""What a client sends over HTTP, against the real server of each family (tiny models):
JSON the parser cannot take, a voice named in any script, forwarding headers from this host,
instructions and speakers under the same rules as over Wyoming.

Every refusal is a 4xx with a message in the JSON error shape, logged at WARNING; nothing a
client sends makes a 500 or a traceback.
"""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from conftest import synthesize  # noqa: E402
from http_process import CHINESE_NAME, SYNTHETIC, ServerProcess  # noqa: E402

from wyoming_cosyvoice.http.origin import INGRESS_PROXY  # noqa: E402
from wyoming_cosyvoice.pipeline.speech import MAX_INSTRUCTION_CHARS  # noqa: E402

NAME = CHINESE_NAME
JSON = {"content-type": "application/json"}
# The routes that read a JSON body, and bodies Python's parser gives up on.
ROUTES = ("/tts", "/v1/audio/speech", "/voices/check", "/voices/custom")
TOO_DEEP = b"[" * 50000
HUGE_NUMBER = b'{"text": ' + b"9" * 5000 + b"}"


@pytest.fixture
def server(family_server: ServerProcess) -> ServerProcess:
    return family_server


def error(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["error"])


def kind(srv: ServerProcess) -> str:
    return "cosyvoice2" if srv.family == "v2" else "sft"


def sse_events(body: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")
    ]


# --- bodies the JSON parser refuses -----------------------------------------------------------


@pytest.mark.parametrize(("body", "words"), [(TOO_DEEP, "nested too deeply"),
                                             (HUGE_NUMBER, "more digits")])  # fmt: skip
def test_json_nested_too_deeply_or_with_a_huge_number_is_a_400(
    server: ServerProcess, body: bytes, words: str
) -> None:
    with server.client() as http:
        for route in ROUTES:
            r = http.post(route, content=body, headers=JSON)
            assert r.status_code == 400, (route, r.text)
            assert error(r)["code"] == "invalid_json" and words in error(r)["message"], route
            # logged when answered: a WARNING naming the route
            assert f"WARNING wyoming_cosyvoice.http.errors: POST {route} -> 400: " in server.log
        assert http.get("/health").json()["status"] == "ready"  # and the server serves on
        assert http.get("/nowhere").status_code == 404
    assert "WARNING wyoming_cosyvoice.http.errors: GET /nowhere -> 404: no route" in server.log


# --- a voice named in any script --------------------------------------------------------------


def test_a_voice_named_in_chinese_is_spoken_and_named_in_the_header(server: ServerProcess) -> None:
    bodies = [
        ("/tts", {"text": "你好。", "voice": NAME}),
        ("/tts", {"text": "你好。", "voice": NAME, "stream": True, "format": "pcm"}),
        ("/v1/audio/speech", {"model": "tts-1", "input": "你好。", "voice": NAME}),
        ("/v1/audio/speech", {"model": "tts-1", "input": "你好。", "voice": NAME,
                              "stream_format": "sse"}),
    ]  # fmt: skip
    with server.client() as http:
        for route, body in bodies:
            r = http.post(route, json=body)
            assert r.status_code == 200, (body, r.text)
            # UTF-8, percent-encoded: what decodeURIComponent and urllib.parse.unquote read
            assert r.headers["x-voice"] == "%E5%A5%B6%E5%A5%B6"
            assert unquote(r.headers["x-voice"]) == NAME
            if body.get("stream_format") == "sse":
                events = sse_events(r.content)
                assert events[-1]["type"] == "speech.audio.done"
                assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) > 0
            else:
                assert len(r.content) > 44
        # an ASCII name reads as it is
        plain = {"text": "Hi.", "voice": SYNTHETIC if server.family == "v2" else "en-male"}
        assert http.post("/tts", json=plain).headers["x-voice"] == plain["voice"]
    assert f"({NAME})" in server.log  # "Spoke … (奶奶) for 127.0.0.1 over HTTP"


# --- forwarding headers -----------------------------------------------------------------------


def test_forwarding_headers_sent_from_this_host_do_not_pass_for_the_ingress(
    server: ServerProcess,
) -> None:
    """Uvicorn trusts X-Forwarded-For from 127.0.0.1 unless told not to: any process on the
    host could then pass for the Supervisor, whose X-Forwarded-Host the origin guard trusts."""
    foreign = {"origin": "https://evil.example", "x-forwarded-for": INGRESS_PROXY,
               "x-forwarded-host": "evil.example", "x-forwarded-proto": "https"}  # fmt: skip
    with server.client() as http:
        r = http.post("/tts", json={"text": "Hi."}, headers=foreign)
        assert r.status_code == 403 and error(r)["code"] == "origin_not_allowed", r.text
        # the access log names the peer, not what it claims to forward for
        r = http.get("/health", headers={"x-forwarded-for": "10.9.8.7"})
        assert r.status_code == 200
    assert "10.9.8.7" not in server.log and f"{INGRESS_PROXY}:" not in server.log
    refused = "WARNING wyoming_cosyvoice.http.origin: POST /tts from origin https://evil.example"
    assert refused in server.log


# --- instructions and speakers: the rules of Wyoming -----------------------------------------


def test_one_limit_for_an_instruction_over_either_protocol(server: ServerProcess) -> None:
    long = "用很慢的语速说" * (MAX_INSTRUCTION_CHARS // 7 + 1)
    voice = SYNTHETIC if server.family == "v2" else "zh-female"
    with server.client() as http:
        openai = http.post(
            "/v1/audio/speech",
            json={"model": "tts-1", "input": "你好。", "voice": voice, "instructions": long},
        )
        spoken = http.post("/tts", json={"text": "你好。", "voice": voice, "speaker": long})
    reply = asyncio.run(synthesize(server.port, "你好。", {"name": voice, "speaker": long}))
    if server.family == "v1":  # SFT: no instruct mode, so no instruction at all
        assert openai.status_code == 400 and error(openai)["code"] == "instructions_unsupported"
        assert spoken.status_code == 404 and reply.error().code == "VoiceNotFoundError"
        return
    limit = f"has {len(long)} characters; the limit is {MAX_INSTRUCTION_CHARS}"
    assert openai.status_code == 413, openai.text
    assert error(openai)["code"] == "instruction_too_long" and limit in error(openai)["message"]
    assert error(openai)["param"] == "instructions"
    assert spoken.status_code == 413 and error(spoken)["param"] == "speaker"
    assert limit in error(spoken)["message"]
    assert reply.error().code == "LimitExceededError" and limit in reply.error().text


def test_a_speaker_that_names_no_voice_means_the_same_over_http_and_wyoming(
    server: ServerProcess,
) -> None:
    """CosyVoice2: a free-text instruction (the same audio as over Wyoming, other audio than
    without it); v1-SFT: an unknown speaker, refused with the voices and preset speakers."""
    voice = SYNTHETIC if server.family == "v2" else "zh-female"
    speaker = "用四川话说这句话"
    with server.client() as http:
        http_reply = http.post("/tts", json={"text": "你好。", "voice": voice, "speaker": speaker})
        plain = http.post("/tts", json={"text": "你好。", "voice": voice})
    wyoming = asyncio.run(synthesize(server.port, "你好。", {"name": voice, "speaker": speaker}))
    if server.family == "v2":
        assert http_reply.status_code == 200, http_reply.text
        assert wyoming.error() is None
        assert http_reply.content[44:] == wyoming.audio  # one rule, one meaning
        assert http_reply.content != plain.content  # and it is an instruction
        return
    assert http_reply.status_code == 404 and error(http_reply)["param"] == "speaker"
    for told in (error(http_reply)["message"], wyoming.error().text):
        assert f"unknown speaker {speaker!r}" in told and "en-male" in told
        assert "or a speaker for a speed: slow, normal, fast" in told, told


def test_presets_are_still_presets_and_voices_still_voices(server: ServerProcess) -> None:
    voice = SYNTHETIC if server.family == "v2" else "zh-female"
    with server.client() as http:
        slow = http.post("/tts", json={"text": "你好。", "voice": voice, "speaker": "slow"})
        named = http.post("/tts", json={"text": "你好。", "speaker": NAME})
    assert slow.status_code == 200 and named.status_code == 200, (slow.text, named.text)
    assert unquote(named.headers["x-voice"]) == NAME


def test_style_and_a_speakers_instruction_are_one_too_many(server: ServerProcess) -> None:
    voice = SYNTHETIC if server.family == "v2" else "zh-female"
    with server.client() as http:
        r = http.post("/tts", json={"text": "你好。", "voice": voice, "speaker": "大声说",
                                    "style": "calm"})  # fmt: skip
    if server.family == "v1":  # v1-SFT takes no instruction: the speaker names no voice
        assert r.status_code == 404 and error(r)["param"] == "speaker", r.text
        return
    assert r.status_code == 400 and "'style' or an instruction in 'speaker'" in error(r)["message"]
