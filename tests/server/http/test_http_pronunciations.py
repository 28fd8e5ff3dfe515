"""Pronunciations end to end: the real server of the tiny CosyVoice3 model, started with a
settings line it can apply and one it cannot. It logs a WARNING naming the bad line, keeps
serving, lists both at ``GET /pronunciations``, and speaks the listed word as its phone tokens:
the same audio, sample for sample, as the tokens typed in the text (seeded), and not the
respelling's."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from http_process import SYNTHETIC, ServerProcess  # noqa: E402

# A server started for these tests alone (about 15 s with its first load's preparation).
pytestmark = pytest.mark.long
LINES = ["Siobhan = SH IH0 V AO1 N | Shivawn", "Michael = M AX0 K"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir: Path = tmp_path_factory.mktemp("pronunciations")
    args = ("--profile", "realtime", "--set", f"server.pronunciations={json.dumps(LINES)}",
            "--set", "server.loudness=null", "--set", "cache.max_mb=0")  # fmt: skip
    srv = ServerProcess("v3", workdir, tokens=20, args=args)
    try:
        yield srv.wait_ready()
    finally:
        code = srv.stop()
    assert code == 0, srv.log[-3000:]
    assert "Traceback" not in srv.log and " ERROR " not in srv.log, srv.log[-3000:]


def _audio(server: ServerProcess, text: str) -> bytes:
    with server.client() as client:
        reply = client.post("/tts", json={"text": text, "voice": SYNTHETIC, "stream": False,
                                          "seed": 7})  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.content


def test_a_line_the_model_cannot_apply_is_logged_and_listed(server: ServerProcess) -> None:
    warnings = [line for line in server.log.splitlines() if " WARNING " in line]
    assert any("pronunciation 'Michael = M AX0 K' is not applied: AX0 is not a CMU phone"
               in line for line in warnings), warnings  # fmt: skip
    with server.client() as client:
        listed = client.get("/pronunciations").json()["pronunciations"]
    assert listed == [
        {"line": LINES[0], "word": "Siobhan", "said_as": "[SH][IH0][V][AO1][N]", "problem": None},
        {"line": LINES[1], "word": None, "said_as": None,
         "problem": listed[1]["problem"]},
    ]  # fmt: skip
    assert "AX0" in listed[1]["problem"]


def test_the_word_is_spoken_as_its_phone_tokens(server: ServerProcess) -> None:
    said = _audio(server, "Please tell Siobhan the kettle is on.")
    assert said == _audio(server, "Please tell [SH][IH0][V][AO1][N] the kettle is on.")
    assert said != _audio(server, "Please tell Shivawn the kettle is on.")
