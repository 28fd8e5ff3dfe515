"""The voice maker's endpoints over HTTP, against the real server with the fake engine.

The server is the one the CLI runs (scheduler, Wyoming listener, Uvicorn, the voices folder's
scans), in a background thread (tests/server/http/test_http.py ``BackgroundServer``); the voices
folder is checked only every hour, so a voice that appears did so because saving asked for a scan.
The speech-to-text server is a Wyoming ASR server on the wyoming library's ``AsyncServer``, Home
Assistant's API a stand-in HTTP server (tests/voice_maker_helpers.py).
"""

from __future__ import annotations

import asyncio
import base64
import os
import shutil
import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import DATA, ROOT, free_port, terminate, wait_for_port, wait_until
from test_http import BackgroundServer
from voice_maker_helpers import (
    WYOMING_ENTRIES,
    FakeVoiceEngine,
    StandInHomeAssistant,
    StandInStt,
)
from voice_signals import speech_like, wav_bytes, white_noise
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from wyoming_cosyvoice.home_assistant import supervisor as home_assistant
from wyoming_cosyvoice.http import voice_maker

TRANSCRIPT = "Hello, this is my voice for the kitchen speaker."
GOOD = wav_bytes(speech_like(5.0, 24000), 24000)


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def voice_server(voices: Path | None, stt_uri: str | None = None, saving: bool = True
                 ) -> BackgroundServer:  # fmt: skip
    settings: dict[str, Any] = {"server.voices_rescan_s": 3600, "server.web_voice_maker": saving}
    if voices is not None:
        settings["server.voices_dir"] = str(voices)
    if stt_uri is not None:
        settings["server.stt_uri"] = stt_uri
    return BackgroundServer(settings, engine_factory=FakeVoiceEngine)


@pytest.fixture(scope="module")
def stt() -> Iterator[StandInStt]:
    with StandInStt(TRANSCRIPT) as running:
        yield running


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, stt: StandInStt
           ) -> Iterator[BackgroundServer]:  # fmt: skip
    voices = tmp_path_factory.mktemp("share") / "voices"  # created by the first save
    with voice_server(voices, stt.uri) as running:
        yield running


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with server.client() as http:
        yield http


def folder(server: BackgroundServer) -> Path:
    return Path(server.config.voices_dir)


def error(response: httpx.Response) -> dict[str, Any]:
    return dict(response.json()["error"])


async def describe(port: int) -> list[str]:
    async with AsyncTcpClient("127.0.0.1", port) as wyoming:
        await wyoming.write_event(Describe().event())
        while not Info.is_type((event := await asyncio.wait_for(wyoming.read_event(), 5)).type):
            pass
    return [voice.name for voice in Info.from_event(event).tts[0].voices]


def save(client: httpx.Client, name: str, audio: bytes = GOOD, transcript: str = TRANSCRIPT
         ) -> httpx.Response:  # fmt: skip
    return client.post("/voices/custom", json={"name": name, "transcript": transcript,
                                               "audio": b64(audio)})  # fmt: skip


# --- what the server offers, the check ------------------------------------------------------


def test_the_maker_says_what_this_server_offers(client: httpx.Client) -> None:
    info = client.get("/voices/maker").json()
    assert info == {"voices_folder": True, "saving": True, "speech_to_text": True,
                    "home_assistant": False,
                    "min_seconds": 3.0, "max_seconds": 30.0,
                    "max_audio_bytes": voice_maker.MAX_AUDIO_BYTES}  # fmt: skip
    script = client.get("/voice-maker.js")
    assert script.status_code == 200
    assert script.headers["content-type"].startswith("text/javascript")
    assert '<script src="voice-maker.js">' in client.get("/").text  # relative: works under ingress


def test_check_reports_a_good_recording(client: httpx.Client) -> None:
    r = client.post("/voices/check", json={"audio": b64(GOOD)})
    assert r.status_code == 200, r.text
    report = r.json()
    assert report["duration_s"] == 5.0 and report["sample_rate"] == 24000
    assert report["snr_db"] > 40 and report["clipped_percent"] == 0 and report["advice"] == []
    # a data: URL, as the page sends it, is the same upload
    url = "data:audio/wav;base64," + b64(GOOD)
    assert client.post("/voices/check", json={"audio": url}).json() == report


@pytest.mark.parametrize(("samples", "reason", "words"), [
    (speech_like(2.0), "too_short", "record at least 3 s"),
    (np.clip(4 * speech_like(), -1, 1), "clipped", "distorted"),
    (0.003 * speech_like(), "too_quiet", "too quiet"),
    (speech_like() + white_noise(5.0, 24000, rms=0.1), "noisy", "background noise"),
])  # fmt: skip
def test_check_refuses_a_poor_recording_with_the_reason(
    client: httpx.Client, samples: np.ndarray, reason: str, words: str
) -> None:
    r = client.post("/voices/check", json={"audio": b64(wav_bytes(samples, 24000))})
    assert r.status_code == 422
    assert error(r)["code"] == reason and error(r)["param"] == "audio"
    assert words in error(r)["message"]


def test_check_refuses_what_it_cannot_read(client: httpx.Client) -> None:
    not_wav = client.post("/voices/check", json={"audio": b64(b"ID3\x03" + bytes(100))})
    assert not_wav.status_code == 415 and error(not_wav)["code"] == "unsupported_audio"
    assert "Upload a WAV file" in error(not_wav)["message"]
    not_base64 = client.post("/voices/check", json={"audio": "this is not base64!"})
    assert not_base64.status_code == 400 and error(not_base64)["code"] == "invalid_audio"
    empty = client.post("/voices/check", json={"audio": ""})
    assert empty.status_code == 400 and error(empty)["param"] == "audio"
    typo = client.post("/voices/check", json={"audio": b64(GOOD), "langauge": "en"})
    assert typo.status_code == 400 and error(typo)["param"] == "langauge"
    form = client.post("/voices/check", content=GOOD, headers={"content-type": "audio/wav"})
    assert form.status_code == 415  # JSON only: a foreign page cannot post without asking


def test_uploads_over_the_limits_are_refused(client: httpx.Client,
                                             monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(voice_maker, "MAX_AUDIO_BYTES", len(GOOD) - 1)
    audio = client.post("/voices/check", json={"audio": b64(GOOD)})
    assert audio.status_code == 413 and error(audio)["code"] == "audio_too_large"
    monkeypatch.setattr(voice_maker, "MAX_BODY_BYTES", 10_000)
    body = client.post("/voices/custom", json={"name": "big", "transcript": "x",
                                               "audio": b64(GOOD)})  # fmt: skip
    assert body.status_code == 413 and error(body)["code"] == "body_too_large"


# --- speech-to-text ---------------------------------------------------------------------------


def test_transcribe_asks_the_wyoming_speech_to_text_server(client: httpx.Client,
                                                           stt: StandInStt) -> None:  # fmt: skip
    before = len(stt.requests)
    r = client.post("/voices/transcribe", json={"audio": b64(GOOD), "language": "en"})
    assert r.status_code == 200 and r.json() == {"transcript": TRANSCRIPT}
    sent = stt.requests[before]
    assert sent["language"] == "en" and sent["format"] == (16000, 2, 1)
    assert len(sent["audio"]) == 5 * 16000 * 2  # the whole clip at 16 kHz, 16-bit mono
    # no language: the speech-to-text server's own setting
    client.post("/voices/transcribe", json={"audio": b64(GOOD), "language": ""})
    assert stt.requests[-1]["language"] is None


def test_transcribe_failures_are_explained(client: httpx.Client, stt: StandInStt,
                                           tmp_path: Path) -> None:  # fmt: skip
    stt.error = "the model is still loading"
    try:
        r = client.post("/voices/transcribe", json={"audio": b64(GOOD)})
    finally:
        stt.error = None
    assert r.status_code == 502 and error(r)["code"] == "speech_to_text_failed"
    assert "answered: the model is still loading" in error(r)["message"]
    bad = client.post("/voices/transcribe", json={"audio": b64(GOOD), "language": "English"})
    assert bad.status_code == 400 and error(bad)["param"] == "language"
    nobody = f"tcp://127.0.0.1:{free_port()}"
    with voice_server(tmp_path / "voices", nobody) as srv, srv.client() as other:
        down = other.post("/voices/transcribe", json={"audio": b64(GOOD)})
    assert down.status_code == 502 and f"cannot use the speech-to-text server at {nobody}" in (
        error(down)["message"])  # fmt: skip


# --- saving -----------------------------------------------------------------------------------


def test_a_saved_voice_is_offered_at_once_over_http_and_wyoming(
    server: BackgroundServer, client: httpx.Client
) -> None:
    r = save(client, "grandma", transcript=f"  {TRANSCRIPT}\n")
    assert r.status_code == 201, r.text
    assert r.json() == {"name": "grandma", "state": "offered", "reason": None}
    assert (folder(server) / "grandma.txt").read_text() == TRANSCRIPT + "\n"
    assert (folder(server) / "grandma.wav").read_bytes() == GOOD
    assert not [p for p in folder(server).iterdir() if p.name.startswith(".")]  # no leftovers
    listed = {v["name"]: v for v in client.get("/voices").json()["voices"]}
    assert listed["grandma"]["description"] == "grandma (custom voice, recorded in English)"
    assert "grandma" in asyncio.run(describe(server.wyoming_port))
    assert client.get("/voices/custom/grandma").json()["state"] == "offered"
    assert client.get("/voices/custom/GRANDMA").json()["name"] == "grandma"
    spoken = client.post("/tts", json={"text": "Dinner is ready.", "voice": "grandma"})
    assert spoken.status_code == 200 and server.engines[0].custom_calls[-1] == "grandma"
    # names in any script: Home Assistant keeps voice ids as plain strings
    assert save(client, "奶奶", transcript="你好，这是我的声音。").json()["state"] == "offered"
    assert "奶奶" in asyncio.run(describe(server.wyoming_port))


@pytest.mark.parametrize("name", ["", "   ", ".hidden", "a/b", "..", "x" * 49,
                                  "grandma.instruct", "-dash"])  # fmt: skip
def test_bad_names_are_refused(server: BackgroundServer, client: httpx.Client, name: str) -> None:
    r = save(client, name)
    assert r.status_code == 400 and error(r)["code"] == "bad_name" and error(r)["param"] == "name"
    assert "cannot be a voice name" in error(r)["message"]


def test_taken_names_bad_transcripts_and_poor_recordings_write_nothing(
    server: BackgroundServer, client: httpx.Client
) -> None:
    assert save(client, "grandpa").status_code == 201
    before = sorted(p.name for p in folder(server).iterdir())
    for name in ("zh-female", "中文女", "ZH-Female", "Grandpa"):  # built-in voices, any case
        r = save(client, name)
        assert r.status_code == 409 and error(r)["code"] == "voice_exists", name
    assert "taken by the voice 'zh-female'" in error(save(client, "中文女"))["message"]
    for transcript, words in (("  ", "empty"), ("?!", "empty"), ("x" * 1001, "limit is 1000")):
        r = save(client, "newname", transcript=transcript)
        assert r.status_code == 400 and error(r)["code"] == "bad_transcript"
        assert words in error(r)["message"]
    quiet = save(client, "newname", audio=wav_bytes(0.003 * speech_like(), 24000))
    assert quiet.status_code == 422 and error(quiet)["code"] == "too_quiet"
    unread = save(client, "newname", audio=b"RIFF....WAVE")
    assert unread.status_code == 415
    assert sorted(p.name for p in folder(server).iterdir()) == before


def test_a_file_of_the_same_name_in_the_folder_is_not_overwritten(
    server: BackgroundServer, client: httpx.Client
) -> None:
    (folder(server) / "Aunt.TXT").write_text("Typed by hand.")
    r = save(client, "aunt")
    assert r.status_code == 409 and "already has Aunt.TXT" in error(r)["message"]
    assert not (folder(server) / "aunt.wav").exists()


def test_a_slow_scan_answers_202_and_the_state_follows_it(
    server: BackgroundServer, client: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = server.engines[0]
    monkeypatch.setattr(voice_maker, "SCAN_WAIT_S", 0.3)
    engine.scan_gate.clear()  # the scan waits, as a first analysis with the real models does
    try:
        r = save(client, "slowpoke")
        assert r.status_code == 202 and r.json()["state"] == "waiting", r.text
        assert "not scanned it yet" in r.json()["reason"]
        assert client.get("/voices/custom/slowpoke").json()["state"] == "waiting"
    finally:
        engine.scan_gate.set()
    state = lambda: client.get("/voices/custom/slowpoke").json()  # noqa: E731
    wait_until(lambda: state()["state"] != "waiting", "the scan has seen the voice")
    assert state() == {"name": "slowpoke", "state": "offered", "reason": None}
    missing = client.get("/voices/custom/nobody")
    assert missing.status_code == 404 and error(missing)["code"] == "voice_not_found"


def test_a_voice_the_server_skips_is_reported_with_the_reason(
    server: BackgroundServer, client: httpx.Client
) -> None:
    (folder(server) / "broken.wav").write_bytes(b"not a recording")
    (folder(server) / "broken.txt").write_text("Some words.")
    assert save(client, "afterwards").json()["state"] == "offered"  # its save rescans
    state = client.get("/voices/custom/broken").json()
    assert state["state"] == "rejected" and "not a WAV file" in state["reason"]


def test_without_a_voices_folder_or_speech_to_text(tmp_path: Path) -> None:
    with voice_server(None) as srv, srv.client() as http:
        info = http.get("/voices/maker").json()
        assert (info["voices_folder"], info["saving"], info["speech_to_text"],
                info["home_assistant"]) == (False, False, False, False)  # fmt: skip
        assert http.post("/voices/check", json={"audio": b64(GOOD)}).status_code == 200
        for path, body, code in (
            ("/voices/custom", {"name": "x", "transcript": "Hi.", "audio": b64(GOOD)},
             "no_voices_folder"),
            ("/voices/transcribe", {"audio": b64(GOOD)}, "no_speech_to_text"),
            ("/voices/home-assistant/reload", {}, "no_home_assistant"),
        ):  # fmt: skip
            r = http.post(path, json=body)
            assert r.status_code == 409 and error(r)["code"] == code, path
        assert http.get("/voices/custom/x").status_code == 409


def test_saving_is_off_unless_the_server_allows_it(tmp_path: Path) -> None:
    # anyone who can reach the HTTP port could otherwise add files to the voices folder
    with voice_server(tmp_path / "voices", saving=False) as srv, srv.client() as http:
        info = http.get("/voices/maker").json()
        assert (info["voices_folder"], info["saving"]) == (True, False)
        assert http.post("/voices/check", json={"audio": b64(GOOD)}).status_code == 200
        r = save(http, "grandma")
        assert r.status_code == 403 and error(r)["code"] == "saving_off"
        assert "--web-voice-maker" in error(r)["message"]
    assert not (tmp_path / "voices").exists()


def test_a_model_that_failed_to_load_makes_no_voice(tmp_path: Path) -> None:
    def broken(path: Path, threads: int | None) -> FakeVoiceEngine:
        raise RuntimeError("no weights")

    settings = {"server.voices_dir": str(tmp_path / "voices"), "server.web_voice_maker": True}
    with BackgroundServer(settings, engine_factory=broken, wait_ready=False) as srv:
        with srv.client() as http:
            wait_until(lambda: http.get("/health").json()["status"] != "loading", "it failed")
            r = save(http, "grandma")  # no scan would ever offer it
    assert r.status_code == 503 and error(r)["code"] == "load_failed"
    assert not (tmp_path / "voices").exists()


# --- Home Assistant ---------------------------------------------------------------------------


def test_home_assistant_reloads_this_servers_wyoming_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with StandInHomeAssistant([dict(e) for e in WYOMING_ENTRIES]) as ha:
        monkeypatch.setenv(home_assistant.TOKEN_VARIABLE, ha.TOKEN)
        monkeypatch.setattr(home_assistant, "SUPERVISOR_CORE_API", ha.url)
        with voice_server(tmp_path / "voices") as srv, srv.client() as http:
            assert http.get("/voices/maker").json()["home_assistant"] is True
            r = http.post("/voices/home-assistant/reload")
            assert r.status_code == 200 and r.json() == {"reloaded": ["CosyVoice"]}
            # the CosyVoice entry only, with the Supervisor's token
            assert ha.reloads == ["/api/config/config_entries/entry/01COSYVOICE/reload"]
            assert {auth for _, _, auth in ha.calls} == {f"Bearer {ha.TOKEN}"}

            ha.entries = WYOMING_ENTRIES[:1]  # the user's entry was renamed
            none = http.post("/voices/home-assistant/reload")
            assert none.status_code == 404 and error(none)["code"] == "no_wyoming_entry"
            assert "Devices & services" in error(none)["message"]
            ha.status = 500
            failed = http.post("/voices/home-assistant/reload")
            assert failed.status_code == 502 and error(failed)["code"] == "home_assistant_failed"
            assert "answered GET" in error(failed)["message"]

        monkeypatch.setenv(home_assistant.TOKEN_VARIABLE, "a-stale-token")
        ha.status, ha.entries = 200, [dict(e) for e in WYOMING_ENTRIES]
        with voice_server(tmp_path / "voices") as srv, srv.client() as http:
            refused = http.post("/voices/home-assistant/reload")
        assert refused.status_code == 502 and "401" in error(refused)["message"]


def test_outside_the_addon_there_is_no_home_assistant_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(home_assistant.TOKEN_VARIABLE, raising=False)
    assert home_assistant.HomeAssistantApi.from_environment() is None
    api = home_assistant.HomeAssistantApi.from_environment({"SUPERVISOR_TOKEN": "t"})
    assert api == home_assistant.HomeAssistantApi("http://supervisor/core/api", "t")


# --- the saved recording ----------------------------------------------------------------------


def test_the_saved_recording_is_the_upload_byte_for_byte(
    server: BackgroundServer, client: httpx.Client
) -> None:
    stereo = wav_bytes(np.stack([speech_like(4.0, 48000)] * 2, axis=1), 48000)
    assert save(client, "stereo-48k", audio=stereo).json()["state"] == "offered"
    saved = folder(server) / "stereo-48k.wav"
    assert saved.read_bytes() == stereo
    with wave.open(str(saved)) as wav:
        assert (wav.getnchannels(), wav.getframerate()) == (2, 48000)


# --- the command line, the real engine --------------------------------------------------------


def test_the_command_line_saves_a_voice_the_real_engine_analyses(tmp_path: Path) -> None:
    """``--voices-dir --http-port --web-voice-maker``: the CLI hands the folder's watcher to the
    page, and the tiny model's engine extracts the saved voice's prompt (tiny ONNX models)."""
    data = DATA
    model = tmp_path / "tiny_model"
    shutil.copytree(data / "tiny_model", model)
    shutil.copy(data / "zero_shot/onnx/tiny_campplus.onnx", model / "campplus.onnx")
    shutil.copy(data / "zero_shot/onnx/tiny_speech_tokenizer_v1.onnx",
                model / "speech_tokenizer_v1.onnx")  # fmt: skip
    voices, port, http_port = tmp_path / "voices", free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "wyoming_cosyvoice", "--model-dir", str(model),
         "--voices-dir", str(voices), "--uri", f"tcp://127.0.0.1:{port}",
         "--http-port", str(http_port), "--http-host", "127.0.0.1", "--web-voice-maker",
         "--offline", "--no-warmup", "--threads", "1", "--profile", "realtime"],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for_port(http_port, process)
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=60) as http:
            health = lambda: http.get("/health").json()["status"]  # noqa: E731
            wait_until(lambda: health() != "loading", "the tiny model has loaded")
            r = save(http, "anna")
            assert r.status_code == 201 and r.json()["state"] == "offered", r.text
        assert "anna" in asyncio.run(describe(port))
        assert (voices / "anna.prompt.pt").is_file()  # the engine analysed the saved recording
    finally:
        log = terminate(process)
    assert "Custom voice 'anna' saved from the web page" in log
    assert "Traceback" not in log, log[-3000:]
