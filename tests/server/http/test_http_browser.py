"""The web page at ``/`` in headless Chromium: it loads, fills the voice list, pressing Speak
streams audio into an AudioContext, Stop works until the audio has played, and the status line
follows the model's loading and explains errors in words for people.

Chromium is Debian's (``/usr/bin/chromium``, or ``$CHROMIUM``), driven over the DevTools
protocol with a small stdlib websocket client: no browser download, no extra test package.
The server runs the fake engine (conftest): the page, not the model, is under test here.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest
from conftest import FakeEngine
from test_http import BackgroundServer

pytestmark = [pytest.mark.browser, pytest.mark.long]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required",
    "--remote-debugging-port=0", "--remote-allow-origins=*", "--window-size=900,700",
]  # fmt: skip


class WebSocket:
    """Just enough RFC 6455 for the DevTools protocol: masked text frames out, text in."""

    def __init__(self, url: str, timeout: float = 30) -> None:
        parts = urlparse(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.split(b"\r\n")[0].split()[1] == b"101", head

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            part = self.sock.recv(n - len(data))
            if not part:
                raise ConnectionError("DevTools closed the websocket")
            data += part
        return data

    def send(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        n = len(payload)
        size = bytes([0x80 | n]) if n < 126 else (
            bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536
            else bytes([0x80 | 127]) + struct.pack(">Q", n))  # fmt: skip
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(b"\x81" + size + mask + masked)

    def recv(self) -> str:
        message = b""
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exact(8))[0]
            payload = self._exact(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the websocket")
            if opcode == 0x9:  # ping: answer with a masked pong
                mask = os.urandom(4)
                pong = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
                self.sock.sendall(bytes([0x8A, 0x80 | len(payload)]) + mask + pong)
                continue
            message += payload
            if b0 & 0x80:  # FIN
                return message.decode()

    def close(self) -> None:
        self.sock.close()


class DevTools:
    """Commands to one page target; events are ignored."""

    def __init__(self, ws_url: str) -> None:
        self.ws = WebSocket(ws_url)
        self.next_id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv())
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise AssertionError(f"{method}: {reply['error']}")
                return dict(reply["result"])

    def js(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True,
                           awaitPromise=True)  # fmt: skip
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if value := self.js(expression):
                return value
            time.sleep(0.1)
        raise AssertionError(
            f"timed out waiting for {expression}: {self.js('JSON.stringify(tts)')}"
        )

    def click(self, selector: str) -> None:
        """A real mouse click (a user gesture, as a person pressing the button)."""
        box = self.js(
            f"(() => {{ const r = document.querySelector({selector!r})"
            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2] })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left",
                      clickCount=1)  # fmt: skip


@contextlib.contextmanager
def open_browser(profile: Path, extra_flags: Sequence[str] = ()) -> Iterator[DevTools]:
    """Headless Chromium with its own profile folder, driven over the DevTools protocol."""
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        missing = f"Debian's chromium is not installed ({CHROMIUM})"
        if os.environ.get("CI"):  # CI runs script/setup --test as root, which installs it
            pytest.fail(f"{missing}: script/setup --test installs it when run as root")
        pytest.skip(f"{missing}; script/setup --test installs it when run as root")
    process = subprocess.Popen([CHROMIUM, *FLAGS, *extra_flags, f"--user-data-dir={profile}",
                                "about:blank"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not (port_file.is_file() and port_file.read_text().strip()):
            assert process.poll() is None, f"chromium exited with {process.returncode}"
            assert time.monotonic() < deadline, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json()
        page = next(t for t in targets if t["type"] == "page")
        devtools = DevTools(page["webSocketDebuggerUrl"])
        yield devtools
        devtools.ws.close()
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    with open_browser(tmp_path / "profile") as devtools:
        yield devtools


def test_page_lists_voices_and_speaks_as_it_streams(browser: DevTools, tmp_path: Path) -> None:
    hold = threading.Event()  # the first sentence holds after its first chunk until set

    def engine(path: Path, threads: int | None) -> FakeEngine:
        return FakeEngine(path, threads, hold=hold)

    with BackgroundServer(engine_factory=engine, wyoming=False) as srv:
        browser.call("Page.enable")
        browser.call("Page.navigate", url=srv.url + "/")
        browser.wait_for("window.tts && tts.voicesLoaded")
        options = browser.js("[...document.querySelectorAll('#voice option')].map(o => o.value)")
        assert "zh-female" in options and len(options) == len(srv.engines[0].speakers)
        assert browser.js("document.getElementById('speak').disabled") is False

        browser.js("document.getElementById('voice').value = 'zh-female'")
        text = "你好，世界。这是一个在浏览器里播放的测试，声音一边合成一边播放。"
        browser.js(f"document.getElementById('text').value = {json.dumps(text)}")
        browser.click("#speak")
        browser.wait_for("tts.firstAudioMs !== null || tts.error")
        # audio is being scheduled while the response is still arriving
        assert browser.js("tts.error") is None
        assert browser.js("tts.received") is False and browser.js("tts.scheduled") > 0
        hold.set()
        browser.wait_for("tts.error || (audio && audio.state === 'running')")
        assert browser.js("audio.sampleRate") == 22050
        browser.wait_for("tts.done || tts.error")  # played to the end
        stats = browser.js("({...tts})")
        assert stats["error"] is None and stats["bytes"] > 0 and stats["chunks"] >= 2
        calls = srv.engines[0].calls
        assert calls and {c.speaker for c in calls} == {"中文女"}
        expected = sum(FakeEngine.expected_samples(c.text) for c in calls)
        assert stats["bytes"] == expected * 2
        assert abs(stats["scheduled"] - expected / 22050) < 1e-3
        shot = browser.call("Page.captureScreenshot", format="png")
        (tmp_path / "page.png").write_bytes(base64.b64decode(shot["data"]))


def page_state(browser: DevTools) -> dict[str, Any]:
    return dict(browser.js(
        "({stop: document.getElementById('stop').disabled,"
        " speak: document.getElementById('speak').disabled,"
        " status: document.getElementById('status').textContent,"
        " statusClass: document.getElementById('status').className,"
        " left: audio ? tts.playEnd - audio.currentTime : null,"
        " received: Boolean(tts.received), done: tts.done, error: tts.error})"
    ))  # fmt: skip


def test_stop_stays_enabled_until_the_audio_has_played(browser: DevTools) -> None:
    # The fake engine makes 100 ms of audio in 5 ms: the whole stream (~5 s of audio) arrives
    # long before it has played, as on a machine faster than real time.
    # Four different sentences: each reaches the engine (a repeat would be replayed).
    text = " ".join(f"The page keeps its Stop button while part {n} plays." for n in range(4))
    with BackgroundServer(wyoming=False) as srv:
        browser.call("Page.navigate", url=srv.url + "/")
        browser.wait_for("window.tts && tts.voicesLoaded")
        browser.js(f"document.getElementById('text').value = {json.dumps(text)}")
        browser.click("#speak")
        # received (this page) or done (a page that stops at the end of the stream)
        browser.wait_for("tts.error || (tts.bytes > 0 && (tts.received || tts.done))")
        streamed = page_state(browser)
        assert streamed["error"] is None and streamed["left"] > 0.5, streamed
        assert streamed["stop"] is False and streamed["done"] is False, streamed
        assert streamed["status"].startswith("Playing"), streamed
        samples = sum(FakeEngine.expected_samples(c.text) for c in srv.engines[0].calls)
        assert browser.js("tts.bytes") == 2 * samples

        browser.wait_for("tts.done || tts.error", timeout=60)
        played = page_state(browser)
        assert played["stop"] is True and played["speak"] is False, played
        assert played["status"] == f"Done: {browser.js('tts.scheduled.toFixed(1)')} s of audio."

        # Stop after the stream has ended, while the audio still plays: silence, and it says so
        browser.click("#speak")
        browser.wait_for("tts.error || tts.received")
        assert page_state(browser)["stop"] is False
        browser.click("#stop")
        browser.wait_for("document.getElementById('stop').disabled")
        stopped = page_state(browser)
        assert stopped["status"] == "Stopped." and stopped["done"] is False, stopped
        assert browser.js("audio") is None


def test_loading_message_clears_once_the_model_is_ready(browser: DevTools) -> None:
    release = threading.Event()

    def slow(path: Path, threads: int | None) -> FakeEngine:
        release.wait(60)
        return FakeEngine(path, threads)

    with BackgroundServer(engine_factory=slow, wait_ready=False, wyoming=False) as srv:
        try:
            browser.call("Page.navigate", url=srv.url + "/")
            browser.wait_for("window.tts && tts.voicesLoaded")
            assert "still loading" in page_state(browser)["status"]
            assert browser.js("document.getElementById('status').getAttribute('aria-live')") == (
                "polite")  # fmt: skip
            # Speak while loading: the 503 is explained, and it too goes once the model is ready
            browser.click("#speak")
            browser.wait_for("tts.error")
            loading = page_state(browser)
            assert "still loading" in loading["status"] and loading["speak"] is False, loading
            release.set()
            browser.wait_for("tts.ready", timeout=60)
            browser.wait_for("!document.getElementById('status').textContent.includes('loading')")
            ready = page_state(browser)
            assert ready["status"] == "Ready: the model has loaded.", ready
            assert ready["statusClass"] == "", ready
        finally:
            release.set()


def test_errors_are_shown_in_words_for_people(browser: DevTools) -> None:
    with BackgroundServer(wyoming=False) as srv:
        browser.call("Page.navigate", url=srv.url + "/")
        browser.wait_for("window.tts && tts.voicesLoaded")
        for text, shown in (("   ", "Type some text to speak."),
                            ("?!…", "There is nothing to speak in this text. Type some words."),
                            ("x" * 20001, "The text is too long. Shorten it to at most 20000 "
                                          "characters.")):  # fmt: skip
            browser.js(f"document.getElementById('text').value = {json.dumps(text)}")
            browser.click("#speak")
            browser.wait_for("tts.error")
            state = page_state(browser)
            assert state["status"] == shown and state["statusClass"] == "error", state
            assert state["speak"] is False and state["stop"] is True, state
        # the page is labelled: a visible label names the text box
        assert browser.js("document.querySelector('label[for=text]').textContent") == (
            "Text to speak")  # fmt: skip
        assert browser.js("document.querySelector('link[rel=icon]').getAttribute('href')") == (
            "favicon.ico")  # fmt: skip


def test_stop_stays_beside_speak_with_long_voice_names(browser: DevTools, tmp_path: Path) -> None:
    # Custom-voice style names: CJK with Latin words, wide whatever CJK font is installed.
    long_names = ["粤语女 Cantonese storyteller, warm and slow (广州话)",
                  "四川话男 Sichuan news anchor with a deep, calm voice"]  # fmt: skip

    def engine(path: Path, threads: int | None) -> FakeEngine:
        return FakeEngine(path, threads, speakers=["中文女", "英文男", *long_names])

    with BackgroundServer(engine_factory=engine, wyoming=False) as srv:
        browser.call("Emulation.setDeviceMetricsOverride", width=1280, height=800,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        browser.call("Page.navigate", url=srv.url + "/")
        browser.wait_for("window.tts && tts.voicesLoaded")
        boxes = browser.js(
            "Object.fromEntries(['voice', 'profile', 'speak', 'stop'].map(id => {"
            " const r = document.getElementById(id).getBoundingClientRect();"
            " return [id, [r.top, r.bottom]] }))"
        )
        shot = browser.call("Page.captureScreenshot", format="png")
        (tmp_path / "wide.png").write_bytes(base64.b64decode(shot["data"]))
        # every control on the one line of the voice list: nothing wrapped below it
        top, bottom = boxes["voice"]
        for name, (t, b) in boxes.items():
            assert t < bottom and b > top, (name, boxes)
