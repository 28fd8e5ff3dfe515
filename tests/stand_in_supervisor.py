"""A stand-in for the Home Assistant Supervisor's discovery API, on loopback.

It answers ``POST /discovery`` the way the Supervisor does (supervisor/api/discovery.py and
api/utils.py): 401 for a wrong token, 400 with ``{"result": "error", "message": …}`` for a body
that is not ``{"service": str, "config": dict}``, 403 for a service the add-on does not list,
else ``{"result": "ok", "data": {"uuid": …}}``. ``answer`` forces a failure instead. Every
request is recorded (and printed as a JSON line when run as a script, for script/image-test,
which runs it in the add-on container's network namespace).

    python3 stand_in_supervisor.py --port 80 --token T [--answer server-error]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

LISTED_SERVICES = ("wyoming",)  # the add-on manifest's `discovery:`
# Failures forced whatever the request: name → (status, body, content type)
FORCED_ANSWERS: dict[str, tuple[int, bytes, str]] = {
    "server-error": (500, b"500 Internal Server Error", "text/plain"),
    "refused": (
        400,
        b'{"result": "error", "message": "Discovery is not possible now"}',
        "application/json",
    ),  # fmt: skip
    "not-json": (200, b"<html>a proxy's page</html>", "text/html"),
}


class StandInSupervisor(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, token: str, answer: str = "normal", port: int = 0,
                 on_request: Callable[[dict[str, Any]], None] | None = None) -> None:  # fmt: skip
        if answer != "normal" and answer not in FORCED_ANSWERS:
            raise ValueError(f"unknown answer {answer!r}")
        self.token, self.answer = token, answer
        self.requests: list[dict[str, Any]] = []
        self.received = threading.Event()
        self.on_request = on_request
        super().__init__(("127.0.0.1", port), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def reply(self, headers: dict[str, str], body: bytes) -> tuple[int, bytes, str]:
        if self.answer in FORCED_ANSWERS:
            return FORCED_ANSWERS[self.answer]
        if headers.get("authorization") != f"Bearer {self.token}":
            return 401, b"401: Unauthorized", "text/plain"
        try:
            message = json.loads(body)
            valid = isinstance(message["service"], str) and isinstance(message["config"], dict)
        except (ValueError, TypeError, KeyError):
            valid = False
        if not valid:
            return _error(400, "expected {service: str, config: dict}")
        if message["service"] not in LISTED_SERVICES:
            return _error(403, "the add-on does not list this service under discovery")
        answer = {"result": "ok", "data": {"uuid": uuid.uuid4().hex}}
        return 200, json.dumps(answer).encode(), "application/json"


def _error(status: int, message: str) -> tuple[int, bytes, str]:
    return status, json.dumps({"result": "error", "message": message}).encode(), "application/json"


class _Handler(BaseHTTPRequestHandler):
    server: StandInSupervisor

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k.lower(): v for k, v in self.headers.items()}
        if self.path == "/discovery":
            status, answer, content_type = self.server.reply(headers, body)
        else:
            status, answer, content_type = _error(404, "no such API")
        record = {"method": "POST", "path": self.path, "headers": headers,
                  "body": body.decode("utf-8", "replace"), "status": status}  # fmt: skip
        self.server.requests.append(record)
        if self.server.on_request:
            self.server.on_request(record)
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)
        self.server.received.set()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
        pass  # requests are recorded instead


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=80)
    parser.add_argument("--token", required=True)
    parser.add_argument("--answer", default="normal", choices=["normal", *FORCED_ANSWERS])
    args = parser.parse_args(argv)

    def show(record: dict[str, Any]) -> None:
        print(json.dumps(record), flush=True)

    server = StandInSupervisor(args.token, args.answer, args.port, on_request=show)
    print(json.dumps({"listening": server.url}), flush=True)
    server.serve_forever()


if __name__ == "__main__":
    sys.exit(main())
