"""Which web pages may call the API: the server's own page, and origins the operator allows.

A browser sends ``Origin`` with every cross-origin request and with same-origin POSTs; curl,
Home Assistant and other programs send none. A request whose ``Origin`` is neither the server's
own (the ``Host`` the request was sent to) nor allowed by ``--http-allow-origin`` is refused
with 403 before any route runs, so a page on another site cannot make its visitors' browsers
load the CPU. Allowed foreign origins get CORS headers, preflight included, from Starlette's
CORSMiddleware.

Home Assistant's ingress (the add-on's page in the sidebar) reaches the server through two
proxies, Home Assistant and the Supervisor, which pass the browser's ``Host`` and ``Origin`` on,
so the page is the server's own there too. A reverse proxy in front of Home Assistant may rewrite
``Host``; Home Assistant then forwards the host the browser used in ``X-Forwarded-Host``, which is
trusted only on requests that come from the Supervisor's address: the connection's own, as
Uvicorn's proxy headers are off (serve.py), so no ``X-Forwarded-For`` can claim it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from wyoming_cosyvoice.http.errors import error_response

_LOGGER = logging.getLogger(__name__)
ANY = "*"
_DEFAULT_PORTS = {"http": 80, "https": 443}
# What a cross-origin caller may read besides the body: the audio's format and the voice used.
# The Supervisor's address on the add-ons' network: every ingress request comes from it.
INGRESS_PROXY = "172.30.32.2"
EXPOSED_HEADERS = ["X-Sample-Rate", "X-Sample-Width", "X-Channels", "X-Voice", "X-Profile"]


def parse_allowed_origins(values: Iterable[str]) -> tuple[str, ...]:
    """``--http-allow-origin`` values (repeated or comma-separated) → normalised origins.

    Raises ValueError naming a value that is not ``*``, ``null`` or ``scheme://host[:port]``.
    """
    origins: list[str] = []
    for value in values:
        for item in (part.strip() for part in value.split(",")):
            if item:
                origins.append(_normalise(item))
    return tuple(dict.fromkeys(origins))


def _normalise(origin: str) -> str:
    if origin in (ANY, "null"):
        return origin
    parts = urlsplit(origin.rstrip("/"))
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (parts.scheme not in _DEFAULT_PORTS or not parts.hostname or port == -1
            or parts.path or parts.query or parts.fragment or parts.username):  # fmt: skip
        raise ValueError(f"{origin!r} is not an origin; use scheme://host[:port] (for "
                         "example http://192.168.1.20:8080), 'null' or '*'")  # fmt: skip
    return f"{parts.scheme}://{parts.netloc.lower()}"


def _host_port(netloc: str, scheme: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(f"//{netloc}")
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    return parts.hostname, port if port is not None else _DEFAULT_PORTS.get(scheme, 80)


def is_same_origin(origin: str, host: str | None) -> bool:
    """Whether ``origin`` names the host and port the request was sent to.

    The scheme is not compared: behind a TLS-terminating proxy the page is https while the
    server sees plain http; the default port follows the page's scheme for both sides.
    """
    parts = urlsplit(origin)
    if not host or parts.scheme not in _DEFAULT_PORTS:
        return False
    page = _host_port(parts.netloc, parts.scheme)
    return page is not None and page == _host_port(host, parts.scheme)


class OriginGuard:
    """ASGI middleware: 403 for a request from a web page of a foreign, unallowed origin."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] = ()) -> None:
        self.app = app
        self.allowed = frozenset(allowed)

    def permits(self, origin: str | None, host: str | None, forwarded_host: str | None = None
                ) -> bool:  # fmt: skip
        if origin is None or ANY in self.allowed:
            return True
        return (
            _normalise_or_none(origin) in self.allowed
            or is_same_origin(origin, host)
            or (forwarded_host is not None and is_same_origin(origin, forwarded_host))
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        if self.permits(origin, headers.get("host"), ingress_forwarded_host(scope, headers)):
            await self.app(scope, receive, send)
            return
        _LOGGER.warning("%s %s from origin %s -> 403", scope["method"], scope["path"], origin)
        response = error_response(
            403,
            f"requests from the web page at {origin} are refused (only this server's own page "
            f"may call it); start the server with --http-allow-origin {origin} to allow it",
            code="origin_not_allowed",
        )
        await response(scope, receive, send)


def ingress_forwarded_host(scope: Scope, headers: Headers) -> str | None:
    """The host the browser used, as Home Assistant's ingress forwards it; None unless the
    request comes from the Supervisor (anyone else could send the header)."""
    client = scope.get("client")
    if not client or client[0] != INGRESS_PROXY:
        return None
    value = headers.get("x-forwarded-host")
    return value.split(",")[0].strip() or None if value else None


def _normalise_or_none(origin: str) -> str | None:
    try:
        return _normalise(origin)
    except ValueError:
        return None


def origin_middleware(allowed: tuple[str, ...]) -> list[Middleware]:
    """The guard, and CORS headers for the allowed foreign origins (none: no CORS at all)."""
    stack = [Middleware(OriginGuard, allowed=allowed)]
    if allowed:
        stack.append(Middleware(
            CORSMiddleware,
            allow_origins=[ANY] if ANY in allowed else list(allowed),
            allow_methods=["GET", "POST"],
            allow_headers=["Content-Type"],
            expose_headers=EXPOSED_HEADERS,
            max_age=600,
        ))  # fmt: skip
    return stack
