"""The web page under Home Assistant's ingress: who may call the API through the proxy.

Home Assistant and the Supervisor pass the browser's ``Host`` and ``Origin`` on, and Home
Assistant adds the host the browser used as ``X-Forwarded-Host``. A reverse proxy in front of
Home Assistant may rewrite ``Host``; the page must still work there, and ``X-Forwarded-Host``
must count only on requests that come from the Supervisor (172.30.32.2), never from anyone
else who sends the header. (The page's own URLs under the ingress prefix are exercised in
tests/server/custom_voices/test_voice_maker_browser.py.)
"""

from __future__ import annotations

import asyncio

import httpx
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send

from wyoming_cosyvoice.http.origin import INGRESS_PROXY, OriginGuard

PAGE = "https://ha.example.com"
OTHER_ADDON = "172.30.33.5"


async def ok(scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse("ok")(scope, receive, send)


def status(peer: str, headers: dict[str, str]) -> int:
    async def call() -> int:
        transport = httpx.ASGITransport(app=OriginGuard(ok), client=(peer, 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://addon:8099") as http:
            return (await http.post("/voices/custom", headers=headers, json={})).status_code

    return asyncio.run(call())


def test_the_page_through_ingress_may_call_the_api() -> None:
    # Home Assistant passes the browser's Host on: the page is the server's own
    assert status(INGRESS_PROXY, {"host": "ha.example.com", "origin": PAGE}) == 200
    # a reverse proxy rewrote Host; Home Assistant forwards the host the browser used
    rewritten = {
        "host": "homeassistant:8123",
        "origin": PAGE,
        "x-forwarded-host": "ha.example.com",
        "x-ingress-path": "/api/hassio_ingress/t",
    }
    assert status(INGRESS_PROXY, rewritten) == 200
    chain = {**rewritten, "x-forwarded-host": "ha.example.com, homeassistant:8123"}
    assert status(INGRESS_PROXY, chain) == 200


def test_the_forwarded_host_counts_only_from_the_supervisor() -> None:
    rewritten = {"host": "homeassistant:8123", "origin": PAGE, "x-forwarded-host": "ha.example.com"}
    assert status(OTHER_ADDON, rewritten) == 403
    assert status("192.168.1.50", rewritten) == 403


def test_a_foreign_page_is_refused_through_ingress_too() -> None:
    evil = {
        "host": "ha.example.com",
        "origin": "https://evil.example",
        "x-forwarded-host": "ha.example.com",
    }
    assert status(INGRESS_PROXY, evil) == 403
    assert status(INGRESS_PROXY, {**evil, "x-forwarded-host": ""}) == 403
