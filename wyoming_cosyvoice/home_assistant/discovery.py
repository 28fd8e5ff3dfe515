"""Tell Home Assistant where the add-on's Wyoming server is: the Supervisor's discovery API.

An add-on that lists ``wyoming`` under ``discovery:`` in its manifest may POST
``{"service": "wyoming", "config": {"uri": "tcp://<its host name>:10200"}}`` to
``http://supervisor/discovery`` with the token the Supervisor gives it (``SUPERVISOR_TOKEN``).
Home Assistant's Wyoming integration then offers the server under Settings → Devices & services;
it connects to the ``uri`` as soon as the user confirms, so the announcement waits until the
server accepts connections.

The Supervisor answers ``{"result": "ok", "data": {"uuid": …}}``; anything else (an HTTP error,
``"result": "error"`` with a message, no answer at all) is a failure, and the log says so. A
failure never stops the server: the user can still add it by hand.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from typing import Any

_LOGGER = logging.getLogger(__name__)

SUPERVISOR_URL = "http://supervisor"
TOKEN_VARIABLE = "SUPERVISOR_TOKEN"
SERVICE = "wyoming"
TIMEOUT_S = 30.0
PORT_POLL_S = 0.5  # how often to try the server's port while it starts


class DiscoveryError(Exception):
    """The Supervisor could not be reached or did not accept the discovery message."""


def discovery_message(hostname: str, port: int) -> dict[str, Any]:
    """The message for Home Assistant's Wyoming integration (it reads ``config["uri"]``)."""
    return {"service": SERVICE, "config": {"uri": f"tcp://{hostname}:{port}"}}


def _answer_detail(body: bytes) -> str:
    """The Supervisor's own words from an answer: its JSON ``message``, else the text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        message = json.loads(text).get("message")
    except (ValueError, AttributeError):
        message = None
    return str(message) if message else text[:200]


def send_discovery(
    message: Mapping[str, Any], token: str, supervisor_url: str = SUPERVISOR_URL
) -> str:
    """POST the message to the Supervisor; the discovery's uuid. Raises DiscoveryError."""
    request = urllib.request.Request(
        f"{supervisor_url}/discovery",
        method="POST",
        data=json.dumps(message).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            body = response.read()
    except urllib.error.HTTPError as err:
        detail = _answer_detail(err.read()) or err.reason
        raise DiscoveryError(f"the Supervisor answered {err.code}: {detail}") from err
    except OSError as err:
        reason = getattr(err, "reason", err)
        raise DiscoveryError(f"cannot reach the Supervisor at {supervisor_url}: {reason}") from err
    try:
        answer = json.loads(body)
        uuid = answer["data"]["uuid"] if answer.get("result") == "ok" else None
    except (ValueError, TypeError, KeyError, AttributeError):
        uuid = None
    if not isinstance(uuid, str) or not uuid:
        raise DiscoveryError(f"the Supervisor did not accept it: {_answer_detail(body)}")
    return uuid


def wait_for_port(port: int, host: str = "127.0.0.1") -> None:
    """Return once something accepts connections on the port (the server, once it listens)."""
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return
        except OSError:
            time.sleep(PORT_POLL_S)


def announce(
    port: int, token: str, supervisor_url: str = SUPERVISOR_URL, hostname: str | None = None
) -> bool:
    """Wait for the server's port, send the discovery, log what happened. True if accepted."""
    wait_for_port(port)
    message = discovery_message(hostname or socket.gethostname(), port)
    uri = message["config"]["uri"]
    try:
        uuid = send_discovery(message, token, supervisor_url)
    except DiscoveryError as err:
        _LOGGER.error(
            "Home Assistant was not told about this server (%s): %s. The server keeps running; "
            "add it by hand: Wyoming Protocol integration, host and port of %s",
            SERVICE, err, uri,
        )  # fmt: skip
        return False
    _LOGGER.info("Sent discovery information to Home Assistant: %s (discovery %s)", uri, uuid)
    return True


def start_announcing(
    port: int, env: Mapping[str, str] = os.environ, supervisor_url: str = SUPERVISOR_URL
) -> threading.Thread | None:
    """Announce the server in a background thread once it listens; None without a token
    (not started by the Supervisor, e.g. the image run by hand: nothing to tell)."""
    token = env.get(TOKEN_VARIABLE, "").strip()
    if not token:
        _LOGGER.warning(
            "%s is not set (not started by the Home Assistant Supervisor): Home Assistant is "
            "not told about this server",
            TOKEN_VARIABLE,
        )
        return None
    thread = threading.Thread(
        target=announce, args=(port, token, supervisor_url), name="discovery", daemon=True
    )
    thread.start()
    return thread
