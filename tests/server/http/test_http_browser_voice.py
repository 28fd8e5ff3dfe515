"""The web page plays a voice named in Chinese, on the real server of each family, in headless
Chromium (tests/server/http/test_http_browser.py's driver): the page reads the voice from the
response's percent-encoded ``X-Voice`` header and names it while it plays."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from http_process import FAMILIES, ServerProcess, record_voice  # noqa: E402
from test_http_browser import DevTools, open_browser  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.long]
NAME = "奶奶"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[DevTools]:
    with open_browser(tmp_path / "profile") as devtools:
        yield devtools


@pytest.mark.parametrize("family", FAMILIES)
def test_the_page_plays_a_voice_named_in_chinese(family: str, browser: DevTools,
                                                 tmp_path: Path) -> None:  # fmt: skip
    voices = tmp_path / "voices"
    record_voice(voices, NAME)
    srv = ServerProcess(family, tmp_path / "server", voices=voices, args=("--profile", "realtime"))
    try:
        srv.wait_ready().wait_for_voice(NAME)
        browser.call("Page.enable")
        browser.call("Page.navigate", url=srv.url + "/")
        browser.wait_for("window.tts && tts.voicesLoaded")
        options = browser.js("[...document.querySelectorAll('#voice option')].map(o => o.value)")
        assert NAME in options
        browser.js(f"document.getElementById('voice').value = '{NAME}'")
        browser.js("document.getElementById('text').value = '你好，奶奶。'")
        browser.click("#speak")
        browser.wait_for("tts.done || tts.error")
        played = browser.js("({...tts})")
        assert played["error"] is None and played["bytes"] > 0, played
        assert played["voice"] == NAME
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.log, srv.log[-3000:]
    assert f"({NAME}) for 127.0.0.1 over HTTP" in srv.log
