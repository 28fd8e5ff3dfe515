"""The web page's chart of the last requests in headless Chromium: it draws what GET stats
says (one bar per request for first audio and for real-time factor), marks requests slower
than real time, and follows new requests without a reload.

The server runs the fake engine (conftest); the browser helpers are test_http_browser's.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeEngine, synthesize
from test_http import BackgroundServer
from test_http_browser import DevTools, browser  # noqa: F401

pytestmark = [pytest.mark.browser, pytest.mark.long]


class SlowWhenAsked(FakeEngine):
    """Slower than real time (200 ms per 100 ms chunk) for a text that says "slowly"."""

    def synthesize(self, text: str, options: Any, cancel: threading.Event | None = None) -> Any:
        self.delay = 0.2 if "slowly" in text else 0.005
        return super().synthesize(text, options, cancel)


def chart(page: DevTools) -> dict[str, Any]:
    return dict(page.js(
        "({first: document.querySelectorAll('#metrics-chart rect.first-audio').length,"
        " rtf: document.querySelectorAll('#metrics-chart rect.rtf').length,"
        " slow: document.querySelectorAll('#metrics-chart rect.rtf.slow').length,"
        " realTime: document.querySelectorAll('#metrics-chart line.real-time').length,"
        " tips: [...document.querySelectorAll('#metrics-chart rect.rtf title')]"
        "   .map(t => t.textContent),"
        " summary: document.getElementById('metrics-summary').textContent,"
        " height: document.getElementById('metrics-chart').getBoundingClientRect().height})"
    ))  # fmt: skip


def test_the_page_charts_the_last_requests(browser: DevTools, tmp_path: Path) -> None:  # noqa: F811
    with BackgroundServer(engine_factory=SlowWhenAsked) as srv:
        browser.call("Emulation.setDeviceMetricsOverride", width=900, height=1000,
                     deviceScaleFactor=1, mobile=False)  # fmt: skip
        browser.call("Page.navigate", url=srv.url + "/")
        browser.wait_for("window.metricsChart && metricsChart.updated > 0")
        empty = chart(browser)
        assert empty["first"] == empty["rtf"] == 0 and empty["realTime"] == 1
        assert empty["summary"] == "No finished requests yet."

        asyncio.run(synthesize(srv.wyoming_port, "Hello from Home Assistant."))
        with srv.client() as client:
            for text in ("Hello from the web.", "This one is spoken slowly."):
                assert client.post("/tts", json={"text": text}).status_code == 200
        # the page reads stats again by itself: no reload
        browser.wait_for("metricsChart.points === 3", timeout=30)
        drawn = chart(browser)
        assert drawn["first"] == drawn["rtf"] == 3 and drawn["slow"] == 1, drawn
        assert drawn["height"] > 100, drawn
        assert [tip.split(" · ")[1] for tip in drawn["tips"]] == ["wyoming", "http", "http"]
        stats = browser.js("metricsChart.stats")
        assert drawn["summary"].startswith(
            f"Last 3 requests: first audio {stats['first_audio_s']['p50']:.2f} s (median)"
        ), drawn
        assert "Since the start: 3 requests, 0 errors" in drawn["summary"], drawn
        # the slow request's bar is the tallest of the real-time factors, above the dashed line
        heights = browser.js(
            "[...document.querySelectorAll('#metrics-chart rect.rtf')]"
            ".map(r => Number(r.getAttribute('height')))"
        )
        assert heights.index(max(heights)) == 2
        line_y = browser.js(
            "Number(document.querySelector('#metrics-chart line.real-time').getAttribute('y1'))"
        )
        slow_top = browser.js(
            "Number(document.querySelector('#metrics-chart rect.rtf.slow').getAttribute('y'))"
        )
        assert slow_top < line_y
        shot = browser.call("Page.captureScreenshot", format="png")
        (tmp_path / "chart.png").write_bytes(base64.b64decode(shot["data"]))
