"""Voice names: what a new voice may be called and when two names are one voice, through the
real server of each family (the page's voice maker, the voices folder, Wyoming and HTTP), and
the comparison rule itself (wyoming_cosyvoice.voices.names).

Home Assistant lists voices by name: two that look the same cannot be told apart there, so a
look-alike of a voice's name is that voice's name.
"""

from __future__ import annotations

import asyncio
import base64
import unicodedata
from typing import Any
from urllib.parse import unquote

import httpx
import pytest
from conftest import synthesize  # noqa: E402
from http_process import FULL_WIDTH, LOOK_ALIKE, ServerProcess  # noqa: E402
from voice_signals import speech_like, wav_bytes  # noqa: E402

from wyoming_cosyvoice.voices.names import BadVoiceName, check_name, name_key  # noqa: E402

GOOD = base64.b64encode(wav_bytes(speech_like(5.0, 24000), 24000)).decode()
TRANSCRIPT = "Hello, this is my voice for the kitchen speaker."
CYRILLIC_A = LOOK_ALIKE
DECOMPOSED = unicodedata.normalize("NFD", "José")


@pytest.fixture
def server(family_server: ServerProcess) -> ServerProcess:
    """Voices "grandma" and CYRILLIC_A beside it in its folder, its default voice FULL_WIDTH."""
    return family_server


def save(http: httpx.Client, name: str) -> httpx.Response:
    return http.post("/voices/custom", json={"name": name, "transcript": TRANSCRIPT,
                                             "audio": GOOD})  # fmt: skip


def error(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["error"])


def files(srv: ServerProcess) -> list[str]:
    return sorted(p.name for p in (srv.log_path.parent / "voices").iterdir())


def test_a_name_with_a_space_at_either_end_is_refused_not_trimmed(server: ServerProcess) -> None:
    before = files(server)
    with server.client() as http:
        for name in (" grandpa", "grandpa ", "\tgrandpa"):
            r = save(http, name)
            assert r.status_code == 400 and error(r)["code"] == "bad_name", r.text
            assert "starts or ends with a space" in error(r)["message"]
    assert files(server) == before
    assert f"WARNING wyoming_cosyvoice.http.errors: POST /voices/custom -> 400: {' grandpa'!r}" \
        in server.log  # fmt: skip


def test_look_alikes_of_a_voice_are_that_voice(server: ServerProcess) -> None:
    before = files(server)
    with server.client() as http:
        for name in (FULL_WIDTH, CYRILLIC_A, "GRANDMA", "GRАNDMA"):
            r = save(http, name)
            assert r.status_code == 409 and error(r)["code"] == "voice_exists", (name, r.text)
        assert "looks the same as the voice 'grandma'" in error(save(http, FULL_WIDTH))["message"]
        listed = [v["name"] for v in http.get("/voices").json()["voices"]]
        # the one dropped in by hand is skipped, and says why
        state = http.get(f"/voices/custom/{CYRILLIC_A}").json()
        # a look-alike finds the voice over HTTP
        spoken = http.post("/tts", json={"text": "Hello.", "voice": FULL_WIDTH})
    assert files(server) == before
    assert "grandma" in listed and CYRILLIC_A not in listed
    assert state["state"] == "rejected" and "already used by the voice 'grandma'" in state["reason"]
    assert spoken.status_code == 200 and spoken.headers["x-voice"] == "grandma"
    # … and over Wyoming
    reply = asyncio.run(synthesize(server.port, "Hello.", {"name": CYRILLIC_A}))
    assert reply.error() is None and reply.samples > 0
    assert f"Custom voice {CYRILLIC_A!r} skipped: the name is already used by the voice " \
        "'grandma'" in server.log  # fmt: skip


def test_the_default_voice_may_be_named_as_it_looks(server: ServerProcess) -> None:
    with server.client() as http:
        r = http.post("/tts", json={"text": "Hello."})
    assert r.status_code == 200 and r.headers["x-voice"] == "grandma"


def test_a_decomposed_name_is_saved_composed_and_found_either_way(server: ServerProcess) -> None:
    with server.client() as http:
        r = save(http, DECOMPOSED)
        assert r.status_code == 201 and r.json()["state"] == "offered", r.text
        assert r.json()["name"] == "José" != DECOMPOSED
        spoken = http.post("/tts", json={"text": "Hola.", "voice": DECOMPOSED})
    assert "José.wav" in files(server) and "José.txt" in files(server)
    assert spoken.status_code == 200 and unquote(spoken.headers["x-voice"]) == "José"


def test_names_in_scripts_with_combining_marks_are_names(server: ServerProcess) -> None:
    with server.client() as http:
        r = save(http, "दादी")  # Devanagari: its vowel signs are combining marks
        assert r.status_code == 201 and r.json()["state"] == "offered", r.text


# --- the rule ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("a", "b"), [
    ("grandma", "Grandma"), ("grandma", FULL_WIDTH), ("grandma", CYRILLIC_A),
    ("GRANDMA", "GRАNDMA"), ("ВОВ", "BOB"), ("Ivy", "Ιvy"), ("José", DECOMPOSED),
    ("oma", "οmα"), ("grand ma", "grand  ma"), ("grandma", "grand\u200dma"),
])  # fmt: skip
def test_names_that_look_the_same_have_one_key(a: str, b: str) -> None:
    assert name_key(a) == name_key(b)


@pytest.mark.parametrize(("a", "b"), [
    ("José", "Jose"), ("奶奶", "妈妈"), ("anna", "anne"), ("grandma", "grandma2"),
    ("grand-ma", "grand_ma"), ("бабушка", "babushka"),
])  # fmt: skip
def test_names_that_look_different_have_different_keys(a: str, b: str) -> None:
    assert name_key(a) != name_key(b)


def test_check_name_keeps_the_name_or_says_why_not() -> None:
    assert check_name("Grandma Rose") == "Grandma Rose"
    assert check_name(DECOMPOSED) == "José"
    for bad, words in ((" x", "starts or ends with a space"), ("a.b", "cannot be a voice name"),
                       ("-x", "cannot be a voice name"), ("x" * 49, "1 to 48")):  # fmt: skip
        with pytest.raises(BadVoiceName, match=words):
            check_name(bad)
