"""A voice made in headless Chromium, through a stand-in of Home Assistant's ingress.

The microphone is a generated WAV (Chromium's fake capture device). The page is opened under
``/api/hassio_ingress/<token>/`` of a small proxy that does what Home Assistant's ingress does
(strips the prefix, passes the browser's headers on, adds ``X-Ingress-Path`` and
``X-Forwarded-Host``), so every URL the page uses must be relative. The flow: record, the
check's verdict, the transcript filled in from a stand-in Wyoming speech-to-text server and
edited, the preview plays, save, and the voice is in ``/voices``, in Wyoming ``describe``, in the
page's voice list and speaks; then Home Assistant's Wyoming entry is reloaded through a stand-in
of its API. The server runs the fake engine: the page, not the model, is under test.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from test_http_browser import DevTools, open_browser
from test_voice_maker import describe, voice_server
from voice_maker_helpers import WYOMING_ENTRIES, StandInHomeAssistant, StandInStt
from voice_signals import speech_like, wav_bytes, white_noise

from wyoming_cosyvoice.home_assistant import supervisor as home_assistant

pytestmark = [pytest.mark.browser, pytest.mark.long]
PREFIX = "/api/hassio_ingress/3f6c2a9b7d"
SPOKEN = "Hello, this is my voice for the kitchen speaker"
_HOP_BY_HOP = {b"content-length", b"transfer-encoding", b"connection", b"accept-encoding"}


class IngressProxy:
    """Home Assistant's ingress in miniature: ``PREFIX/...`` → the server's ``/...``."""

    def __init__(self, target: str) -> None:
        self.http = httpx.AsyncClient(base_url=target, timeout=None)
        self.paths: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        if not path.startswith(PREFIX + "/"):
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b"outside the ingress prefix"})
            return
        self.paths.append(path[len(PREFIX) :])
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"] if k not in _HOP_BY_HOP]
        host = dict(scope["headers"])[b"host"].decode()
        headers += [("X-Ingress-Path", PREFIX), ("X-Forwarded-Host", host)]
        query = scope["query_string"].decode()
        url = path[len(PREFIX) :] + (f"?{query}" if query else "")
        request = self.http.build_request(scope["method"], url, headers=headers, content=body)
        response = await self.http.send(request, stream=True)
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()
                                    if k.encode() not in _HOP_BY_HOP]})  # fmt: skip
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
        finally:
            await response.aclose()


async def start_proxy(target: str) -> tuple[uvicorn.Server, asyncio.Task[None], IngressProxy]:
    proxy = IngressProxy(target)
    server = uvicorn.Server(uvicorn.Config(proxy, host="127.0.0.1", port=0, lifespan="off",
                                           log_config=None))  # fmt: skip
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the ingress proxy did not start"
        await asyncio.sleep(0.02)
    return server, task, proxy


async def stop_proxy(server: uvicorn.Server, task: asyncio.Task[None], proxy: IngressProxy) -> None:
    server.should_exit = True
    await asyncio.wait_for(task, 10)
    await proxy.http.aclose()


@pytest.fixture
def microphone(tmp_path: Path) -> Path:
    """What the fake microphone hears, over and over: 6 s of speech-like sound at 48 kHz."""
    path = tmp_path / "microphone.wav"
    path.write_bytes(wav_bytes(speech_like(6.0, 48000), 48000))
    return path


@pytest.fixture
def browser(tmp_path: Path, microphone: Path) -> Iterator[DevTools]:
    flags = ["--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
             f"--use-file-for-fake-audio-capture={microphone}"]  # fmt: skip
    with open_browser(tmp_path / "profile", flags) as devtools:
        yield devtools


def maker(browser: DevTools) -> dict[str, Any]:
    return dict(browser.js(
        "({...voiceMaker, wav: Boolean(voiceMaker.wav),"
        " status: document.getElementById('maker-status').textContent})"
    ))  # fmt: skip


def wait(browser: DevTools, expression: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := browser.js(expression):
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {expression}: {maker(browser)}")


def click(browser: DevTools, selector: str) -> None:
    """A real click (a user gesture) on an element scrolled into view first."""
    browser.js(f"document.querySelector({selector!r}).scrollIntoView({{block: 'center'}})")
    browser.click(selector)


def type_into(browser: DevTools, element: str, text: str) -> None:
    """Set a field's text as typing does (an input event follows)."""
    browser.js(f"(() => {{ const e = document.getElementById({element!r}); e.value = "
               f"{json.dumps(text)}; e.dispatchEvent(new Event('input')); }})()")  # fmt: skip


def test_a_voice_recorded_in_the_browser_is_saved_and_offered(
    browser: DevTools, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    voices = tmp_path / "voices"
    with StandInStt(SPOKEN) as stt, StandInHomeAssistant(WYOMING_ENTRIES) as ha:
        monkeypatch.setenv(home_assistant.TOKEN_VARIABLE, ha.TOKEN)
        monkeypatch.setattr(home_assistant, "SUPERVISOR_CORE_API", ha.url)
        with voice_server(voices, stt.uri) as srv:
            proxy = srv.call(start_proxy(srv.url))
            try:
                run_the_flow(browser, srv, stt, ha, proxy, tmp_path)
            finally:
                srv.call(stop_proxy(*proxy))


def run_the_flow(browser: DevTools, srv: Any, stt: StandInStt, ha: StandInHomeAssistant,
                 running_proxy: tuple[Any, Any, IngressProxy], tmp_path: Path) -> None:  # fmt: skip
    server, _, proxy = running_proxy
    port = server.servers[0].sockets[0].getsockname()[1]
    browser.call("Page.navigate", url=f"http://127.0.0.1:{port}{PREFIX}/")
    wait(browser, "window.voiceMaker && voiceMaker.info && window.tts && tts.voicesLoaded")
    assert browser.js("document.getElementById('maker').hidden") is False
    assert browser.js("document.getElementById('record').disabled") is False

    # record about 4 s from the fake microphone
    click(browser, "#record")
    wait(browser, "voiceMaker.recording")
    wait(browser, "voiceMaker.seconds >= 4", timeout=20)
    assert browser.js("voiceMaker.peak") > 0.3  # the microphone's level, shown by the meter
    click(browser, "#record")
    wait(browser, "voiceMaker.checked || voiceMaker.error")
    state = maker(browser)
    assert state["error"] is None and state["status"].startswith("Good recording"), state
    assert 4 <= state["checked"]["duration_s"] < 6 and state["checked"]["snr_db"] > 30

    # the transcript comes from the speech-to-text server, and the user can edit it
    wait(browser, "voiceMaker.transcript")
    assert browser.js("document.getElementById('transcript').value") == SPOKEN
    sent = stt.requests[-1]
    assert sent["format"] == (16000, 2, 1)
    # the whole recording, at 16 kHz 16-bit (the reported duration is rounded to 10 ms)
    assert len(sent["audio"]) == pytest.approx(state["checked"]["duration_s"] * 32000, abs=400)
    edited = SPOKEN + "!"
    type_into(browser, "transcript", edited)

    # the preview plays the recording
    assert browser.js("document.getElementById('preview').hidden") is False
    browser.js("document.getElementById('preview').play().then(() => true)")
    wait(browser, "document.getElementById('preview').currentTime > 0.3")
    browser.js("document.getElementById('preview').pause()")

    type_into(browser, "voice-name", "grandma")
    wait(browser, "!document.getElementById('save').disabled")
    click(browser, "#save")
    wait(browser, "voiceMaker.state === 'offered' || voiceMaker.error")
    assert maker(browser)["error"] is None and maker(browser)["status"] == (
        "The voice grandma is ready.")  # fmt: skip

    # the voices folder holds what the page recorded and the edited transcript
    voices = Path(srv.config.voices_dir)
    assert (voices / "grandma.txt").read_text() == edited + "\n"
    with wave.open(str(voices / "grandma.wav")) as wav:
        assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
        seconds = wav.getnframes() / wav.getframerate()
        assert seconds == pytest.approx(state["checked"]["duration_s"], abs=0.01)
        recorded = np.frombuffer(wav.readframes(wav.getnframes()), "<i2")
    assert np.abs(recorded).max() > 0.3 * 32767  # the microphone's sound, not silence

    # offered over HTTP and Wyoming, in the page's list, and it speaks
    with srv.client() as http:
        assert "grandma" in [v["name"] for v in http.get("/voices").json()["voices"]]
    assert "grandma" in asyncio.run(describe(srv.wyoming_port))
    options = browser.js("[...document.querySelectorAll('#voice option')].map(o => o.value)")
    assert "grandma" in options
    click(browser, "#speak-with-it")
    wait(browser, "tts.received || tts.error")
    assert browser.js("tts.error") is None and srv.engines[0].custom_calls[-1] == "grandma"

    # Home Assistant's Wyoming entry is reloaded on request
    assert browser.js("document.getElementById('ha-reload').hidden") is False
    click(browser, "#reload-ha")
    wait(browser, "voiceMaker.reloaded || voiceMaker.error")
    assert maker(browser)["reloaded"] == ["CosyVoice"]
    assert ha.reloads == ["/api/config/config_entries/entry/01COSYVOICE/reload"]

    # every request went through the ingress prefix: the page used relative URLs only
    assert {"/", "/voice-maker.js", "/voices/maker", "/voices/check", "/voices/transcribe",
            "/voices/custom", "/voices/home-assistant/reload"} <= set(proxy.paths)  # fmt: skip
    shot = browser.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
    (tmp_path / "voice-maker.png").write_bytes(base64.b64decode(shot["data"]))


def choose_file(browser: DevTools, path: Path) -> None:
    """Pick a file in the page's file input, as the file dialog does."""
    root = browser.call("DOM.getDocument")["root"]["nodeId"]
    node = browser.call("DOM.querySelector", nodeId=root, selector="#file")["nodeId"]
    browser.call("DOM.setFileInputFiles", files=[str(path)], nodeId=node)


def test_an_uploaded_file_is_checked_and_saved_with_a_typed_transcript(
    browser: DevTools, tmp_path: Path
) -> None:
    noisy = tmp_path / "noisy.wav"
    noisy.write_bytes(wav_bytes(speech_like(5.0, 44100) + white_noise(5.0, 44100, 0.1), 44100))
    not_audio = tmp_path / "notes.wav"
    not_audio.write_text("These are not sounds.")
    good = tmp_path / "stereo.wav"
    good.write_bytes(wav_bytes(np.stack([speech_like(4.0, 44100)] * 2, axis=1), 44100))

    with voice_server(tmp_path / "voices") as srv:  # no speech-to-text, no Home Assistant
        browser.call("Page.navigate", url=srv.url + "/")
        wait(browser, "window.voiceMaker && voiceMaker.info")
        for path, shown in ((noisy, "There is too much background noise"),
                            (not_audio, "The browser cannot read this file")):  # fmt: skip
            browser.js("voiceMaker.error = null")
            choose_file(browser, path)
            wait(browser, "voiceMaker.error")
            state = maker(browser)
            assert state["status"].startswith(shown) and state["checked"] is None, state
            assert browser.js("document.getElementById('maker-status').className") == "error"

        browser.js("voiceMaker.error = null")
        choose_file(browser, good)
        wait(browser, "voiceMaker.checked || voiceMaker.error")
        state = maker(browser)
        assert state["error"] is None and state["checked"]["duration_s"] == pytest.approx(4.0)
        assert state["transcript"] is None  # no speech-to-text server: the user types it
        assert browser.js("document.getElementById('save').disabled") is True
        type_into(browser, "voice-name", "zh-female")
        assert browser.js("document.getElementById('save').disabled") is True  # no transcript
        type_into(browser, "transcript", "Good morning, this is the hall speaker.")
        click(browser, "#save")
        wait(browser, "voiceMaker.error")
        assert "taken by the voice 'zh-female'" in maker(browser)["status"]

        browser.js("voiceMaker.error = null")
        type_into(browser, "voice-name", "hall")
        click(browser, "#save")
        wait(browser, "voiceMaker.state === 'offered' || voiceMaker.error")
        assert maker(browser)["state"] == "offered", maker(browser)
        assert browser.js("document.getElementById('ha-manual').hidden") is False
        assert browser.js("document.getElementById('ha-reload').hidden") is True
        with wave.open(str(tmp_path / "voices" / "hall.wav")) as wav:  # mixed to mono
            assert (wav.getnchannels(), wav.getsampwidth()) == (1, 2)
            assert wav.getnframes() / wav.getframerate() == pytest.approx(4.0, abs=0.01)
        assert (tmp_path / "voices" / "hall.txt").read_text() == (
            "Good morning, this is the hall speaker.\n")  # fmt: skip
