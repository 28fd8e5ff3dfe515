"""Which callers may run synthesis over HTTP: content type, Origin, CORS preflight.

A web page on another site can make its visitors' browsers POST to the server; a ``text/plain``
or form POST needs no preflight (a CORS "simple request"). The server therefore takes only JSON
bodies and refuses foreign ``Origin`` headers unless ``--http-allow-origin`` allows them, while
callers without an Origin (curl, Home Assistant, scripts) and the server's own page work.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from test_http import BackgroundServer

from wyoming_cosyvoice.http.origin import (
    is_same_origin,
    parse_allowed_origins,
)

EVIL = "http://evil.example"
ROUTES = [("/tts", {"text": "Hi."}), ("/v1/audio/speech", {"input": "Hi.", "voice": "en-male"})]


@pytest.fixture(scope="module")
def server() -> Iterator[BackgroundServer]:
    with BackgroundServer(wyoming=False) as running:
        yield running


@pytest.fixture
def client(server: BackgroundServer) -> Iterator[httpx.Client]:
    with server.client() as http:
        yield http


def calls(server: BackgroundServer) -> int:
    return len(server.engines[0].calls)


# --- content type ---------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize(
    "content_type",
    ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None],
)
def test_synthesis_needs_a_json_content_type(
    server: BackgroundServer, client: httpx.Client, path: str, body: dict[str, str],
    content_type: str | None,
) -> None:  # fmt: skip
    before = calls(server)
    headers = {"content-type": content_type} if content_type else {}
    r = client.post(path, content=httpx.Request("POST", "/", json=body).content,
                    headers=headers)  # fmt: skip
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert "Content-Type: application/json" in error["message"]
    assert error["code"] == "unsupported_media_type"
    assert calls(server) == before  # nothing was synthesized


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_json_with_a_charset_is_json(client: httpx.Client, path: str, body: dict) -> None:
    r = client.post(path, content=httpx.Request("POST", "/", json=body).content,
                    headers={"content-type": "Application/JSON; charset=utf-8"})  # fmt: skip
    assert r.status_code == 200, r.text


# --- Origin ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), ROUTES)
@pytest.mark.parametrize("origin", [EVIL, "null", "http://127.0.0.1:1", "http://localhost"])
def test_a_foreign_origin_is_refused(
    server: BackgroundServer, client: httpx.Client, path: str, body: dict, origin: str
) -> None:
    before = calls(server)
    r = client.post(path, json=body, headers={"origin": origin})
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert f"--http-allow-origin {origin}" in error["message"]
    assert error["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert calls(server) == before


def test_the_servers_own_page_and_callers_without_origin_work(
    server: BackgroundServer, client: httpx.Client
) -> None:
    own = f"http://127.0.0.1:{server.http.port}"
    assert client.post("/tts", json={"text": "Hi."}, headers={"origin": own}).status_code == 200
    # the scheme is not compared: a TLS proxy serves the page over https to the same host:port
    https = own.replace("http:", "https:")
    assert client.post("/tts", json={"text": "Hi."}, headers={"origin": https}).status_code == 200
    assert client.post("/tts", json={"text": "Hi."}).status_code == 200  # curl, HA, scripts


def test_a_foreign_preflight_is_refused(client: httpx.Client) -> None:
    preflight = {"origin": EVIL, "access-control-request-method": "POST",
                 "access-control-request-headers": "content-type"}  # fmt: skip
    r = client.options("/tts", headers=preflight)
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_reading_pages_from_a_foreign_origin_is_refused_too(client: httpx.Client) -> None:
    assert client.get("/voices", headers={"origin": EVIL}).status_code == 403
    assert client.get("/voices").status_code == 200


# --- --http-allow-origin --------------------------------------------------------------------


def test_an_allowed_origin_gets_cors_answers_and_others_stay_refused() -> None:
    allowed = "http://dashboard.lan:8123"
    with BackgroundServer(wyoming=False, allow_origins=(allowed,)) as srv, srv.client() as http:
        preflight = http.options("/tts", headers={
            "origin": allowed, "access-control-request-method": "POST",
            "access-control-request-headers": "content-type"})  # fmt: skip
        assert preflight.status_code == 200, preflight.text
        assert preflight.headers["access-control-allow-origin"] == allowed
        assert "POST" in preflight.headers["access-control-allow-methods"]
        assert "content-type" in preflight.headers["access-control-allow-headers"].lower()

        r = http.post("/tts", json={"text": "Hi.", "voice": "en-male"},
                      headers={"origin": allowed})  # fmt: skip
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == allowed
        assert "X-Voice" in r.headers["access-control-expose-headers"]
        # still JSON only: a simple request from an allowed site is no exception
        plain = http.post("/tts", content=b'{"text": "Hi."}',
                          headers={"origin": allowed, "content-type": "text/plain"})  # fmt: skip
        assert plain.status_code == 415
        assert http.post("/tts", json={"text": "Hi."}, headers={"origin": EVIL}).status_code == 403


def test_a_star_allows_every_origin() -> None:
    with BackgroundServer(wyoming=False, allow_origins=("*",)) as srv, srv.client() as http:
        r = http.post("/tts", json={"text": "Hi."}, headers={"origin": EVIL})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


# --- the rules, unit by unit ----------------------------------------------------------------


def test_allowed_origins_are_parsed_from_repeats_and_comma_lists() -> None:
    parsed = parse_allowed_origins(["http://A.example:8123/, https://b.example", "null"])
    assert parsed == ("http://a.example:8123", "https://b.example", "null")
    assert parse_allowed_origins(["*"]) == ("*",)
    assert parse_allowed_origins([]) == ()


@pytest.mark.parametrize(
    "bad", ["evil.example", "ftp://x.example", "http://x.example/path", "http://x:port", "http://"]
)
def test_a_value_that_is_not_an_origin_is_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="is not an origin"):
        parse_allowed_origins([bad])


@pytest.mark.parametrize(
    ("origin", "host", "same"),
    [
        ("http://tts.lan:5000", "tts.lan:5000", True),
        ("http://TTS.lan:5000", "tts.LAN:5000", True),
        ("https://tts.lan", "tts.lan", True),
        ("https://tts.lan", "tts.lan:443", True),
        ("http://tts.lan", "tts.lan:80", True),
        ("http://[::1]:5000", "[::1]:5000", True),
        ("http://tts.lan:5001", "tts.lan:5000", False),
        ("http://tts.lan.evil.example:5000", "tts.lan:5000", False),
        ("null", "tts.lan:5000", False),
        ("http://tts.lan:5000", None, False),
        ("http://tts.lan:5000", "tts.lan:x", False),
    ],
)
def test_same_origin_compares_host_and_port(origin: str, host: str | None, same: bool) -> None:
    assert is_same_origin(origin, host) is same
