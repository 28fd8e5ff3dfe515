"""Home Assistant's ingress, end to end on the real server: the Supervisor's address is the
connection's own, never a header's.

The test runs itself again (``python tests/server/http/test_http_ingress_address.py``) inside a
network namespace of its own (``unshare -n``) whose loopback also has the Supervisor's address,
172.30.32.2: there a client can connect *from* that address, as the Supervisor does, and the
server process started inside sees it as the peer. Nothing leaves the namespace.

* from 172.30.32.2, a page whose ``Host`` a proxy rewrote passes on ``X-Forwarded-Host``;
* from any other address the same headers are refused, with or without an
  ``X-Forwarded-For`` that names the Supervisor.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

SUPERVISOR = "172.30.32.2"  # wyoming_cosyvoice.http.origin.INGRESS_PROXY
PAGE = {  # a browser's request as Home Assistant forwards it behind a proxy that rewrote Host
    "origin": "https://ha.example.com",
    "host": "homeassistant:8123",
    "x-forwarded-host": "ha.example.com",
    "x-forwarded-for": "192.168.1.50, 172.30.32.1",
    "x-ingress-path": "/api/hassio_ingress/token",
}


def _inside(workdir: Path) -> dict[str, Any]:
    """In the namespace: start the server, ask from both addresses, stop it."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: the helpers
    from http_process import ServerProcess

    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    subprocess.run(["ip", "addr", "add", f"{SUPERVISOR}/32", "dev", "lo"], check=True)
    srv = ServerProcess("v1", workdir)
    try:
        srv.wait_ready()

        def status(source: str, headers: dict[str, str]) -> int:
            transport = httpx.HTTPTransport(local_address=source)
            with httpx.Client(transport=transport, base_url=srv.url, timeout=120) as http:
                return http.post("/tts", json={"text": "Hi."}, headers=headers).status_code

        answers = {
            "supervisor": status(SUPERVISOR, PAGE),
            "this_host": status("127.0.0.1", PAGE),
            "this_host_claiming": status("127.0.0.1", {**PAGE, "x-forwarded-for": SUPERVISOR}),
        }
    finally:
        code = srv.stop()
    return {**answers, "exit": code, "log": srv.log[-3000:]}


@pytest.mark.long
def test_only_the_supervisors_own_connections_count_as_the_ingress() -> None:
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "-n", "true"]).returncode != 0:
        pytest.fail(
            "no network namespace can be made here: unshare -n needs root (or a user "
            "namespace); this test must see a connection from the Supervisor's address"
        )
    with tempfile.TemporaryDirectory() as workdir:
        done = subprocess.run([unshare, "-n", sys.executable, __file__, workdir],
                              capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answers = json.loads(done.stdout.strip().splitlines()[-1])
    assert answers["supervisor"] == 200, answers["log"]
    assert answers["this_host"] == 403 and answers["this_host_claiming"] == 403, answers["log"]
    assert answers["exit"] == 0 and "Traceback" not in answers["log"], answers["log"]


if __name__ == "__main__":
    print(json.dumps(_inside(Path(sys.argv[1]))))
