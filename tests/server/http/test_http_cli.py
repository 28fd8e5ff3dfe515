"""``python -m wyoming_cosyvoice --http-port`` as a user starts it, on the tiny model."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import httpx
import pytest
from conftest import ROOT, free_port, terminate
from test_http import parse_wav

TINY = ROOT / "tests" / "data" / "tiny_model"


def start(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "wyoming_cosyvoice", "--model-dir", str(TINY), "--threads", "1",
         "--seed", "0", "--no-warmup", *args],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def wait_healthy(url: str, process: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.communicate()[1][-3000:]
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the HTTP API never became healthy")


def stop(process: subprocess.Popen[str]) -> str:
    log = terminate(process)
    assert process.returncode == 0, log[-3000:]
    return log


@pytest.mark.parametrize("only", [False, True], ids=["with-wyoming", "http-only"])
@pytest.mark.long
def test_cli_serves_http(only: bool) -> None:
    port, wyoming = free_port(), free_port()
    args = ["--http-port", str(port), "--http-host", "127.0.0.1"]
    args += ["--http-allow-origin", "http://a.example, http://b.example"]
    args += ["--http-only"] if only else ["--uri", f"tcp://127.0.0.1:{wyoming}"]
    process = start(*args)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, process)
        assert [v["name"] for v in httpx.get(url + "/voices").json()["voices"]] == [
            "en-male", "zh-female"]  # fmt: skip
        r = httpx.post(url + "/tts", json={"text": "Hi.", "voice": "en-male"}, timeout=60)
        assert r.status_code == 200
        _, pcm = parse_wav(r.content)
        assert len(pcm) > 0
        for origin, status in (("http://b.example", 200), ("http://evil.example", 403)):
            r = httpx.post(url + "/tts", json={"text": "Hi."}, headers={"origin": origin},
                           timeout=60)  # fmt: skip
            assert r.status_code == status, r.text
    finally:
        log = stop(process)
    assert ("Listening on" in log) is not only and "HTTP API on" in log


def test_cli_refuses_an_allowed_origin_that_is_not_one(caplog: pytest.LogCaptureFixture) -> None:
    from wyoming_cosyvoice.__main__ import main

    code = main(["--model-dir", str(TINY), "--http-port", "0", "--http-only",
                 "--http-allow-origin", "dashboard.lan"])  # fmt: skip
    assert code == 2 and "--http-allow-origin: 'dashboard.lan' is not an origin" in caplog.text
