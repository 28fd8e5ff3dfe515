"""The add-on telling Home Assistant about its server
(wyoming_cosyvoice.home_assistant.discovery), against a stand-in Supervisor on loopback that
answers as the real one does, or fails."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator

import pytest
from stand_in_supervisor import FORCED_ANSWERS, StandInSupervisor

from wyoming_cosyvoice.home_assistant import discovery as addon_discovery
from wyoming_cosyvoice.home_assistant.discovery import (
    DiscoveryError,
    announce,
    discovery_message,
    send_discovery,
    start_announcing,
)

TOKEN = "token-of-this-addon"


@pytest.fixture
def supervisor(request: pytest.FixtureRequest) -> Iterator[StandInSupervisor]:
    server = StandInSupervisor(TOKEN, getattr(request, "param", "normal"))
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def listening_port() -> Iterator[int]:
    """A port something listens on, as the server's does once it has started."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_message_is_what_home_assistants_wyoming_integration_reads() -> None:
    # homeassistant/components/wyoming/config_flow.py: urlparse(discovery_info.config["uri"])
    assert discovery_message("abc-cosyvoice", 10200) == {
        "service": "wyoming",
        "config": {"uri": "tcp://abc-cosyvoice:10200"},
    }


def test_an_accepted_discovery_returns_its_uuid(supervisor: StandInSupervisor) -> None:
    uuid = send_discovery(discovery_message("host", 10200), TOKEN, supervisor.url)
    assert len(uuid) == 32
    (request,) = supervisor.requests
    assert request["path"] == "/discovery" and request["status"] == 200
    assert request["headers"]["authorization"] == f"Bearer {TOKEN}"
    assert json.loads(request["body"]) == discovery_message("host", 10200)


def test_a_wrong_token_is_a_failure(supervisor: StandInSupervisor) -> None:
    with pytest.raises(DiscoveryError, match="answered 401: 401: Unauthorized"):
        send_discovery(discovery_message("host", 10200), "not-the-token", supervisor.url)


def test_a_service_the_manifest_does_not_list_is_refused(supervisor: StandInSupervisor) -> None:
    message = {**discovery_message("host", 10200), "service": "mqtt"}
    with pytest.raises(DiscoveryError, match="answered 403: the add-on does not list"):
        send_discovery(message, TOKEN, supervisor.url)


@pytest.mark.parametrize(
    ("supervisor", "words"),
    [
        ("server-error", "answered 500: 500 Internal Server Error"),
        ("refused", "answered 400: Discovery is not possible now"),
        ("not-json", "did not accept it: <html>"),
    ],
    indirect=["supervisor"],
)
def test_failure_answers_are_failures(supervisor: StandInSupervisor, words: str) -> None:
    with pytest.raises(DiscoveryError, match=words):
        send_discovery(discovery_message("host", 10200), TOKEN, supervisor.url)


def test_no_supervisor_is_a_failure() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(DiscoveryError, match=f"cannot reach the Supervisor at {url}"):
        send_discovery(discovery_message("host", 10200), TOKEN, url)


def test_the_log_says_sent_only_when_the_supervisor_accepted(
    supervisor: StandInSupervisor, listening_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=addon_discovery.__name__)
    assert announce(listening_port, TOKEN, supervisor.url, hostname="abc-cosyvoice") is True
    (record,) = caplog.records
    assert record.levelno == logging.INFO
    assert record.getMessage().startswith("Sent discovery information to Home Assistant")
    assert f"tcp://abc-cosyvoice:{listening_port}" in record.getMessage()


@pytest.mark.parametrize("supervisor", [*FORCED_ANSWERS], indirect=True)
def test_the_log_says_not_told_when_the_supervisor_failed(
    supervisor: StandInSupervisor, listening_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=addon_discovery.__name__)
    assert announce(listening_port, TOKEN, supervisor.url, hostname="h") is False
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    message = record.getMessage()
    assert "Home Assistant was not told about this server" in message
    assert "keeps running" in message and "Sent discovery" not in message
    assert supervisor.requests  # it was asked, and its answer was read


def test_the_discovery_waits_until_the_server_listens(
    supervisor: StandInSupervisor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Home Assistant connects as soon as the user confirms: announce only a listening server."""
    # The thread's tries to connect are observed through its calls, not a sleep.
    tries = threading.Semaphore(0)
    connect = socket.create_connection

    def counting_connect(*args, **kwargs):  # type: ignore[no-untyped-def]
        tries.release()
        return connect(*args, **kwargs)

    monkeypatch.setattr(addon_discovery.socket, "create_connection", counting_connect)
    with socket.socket() as server_socket:
        server_socket.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        port = server_socket.getsockname()[1]
        thread = start_announcing(port, {"SUPERVISOR_TOKEN": TOKEN}, supervisor.url)
        assert thread is not None
        for _ in range(3):
            assert tries.acquire(timeout=30)
        assert supervisor.requests == []
        server_socket.listen()
        thread.join(timeout=60)
        assert not thread.is_alive()
    assert [r["status"] for r in supervisor.requests] == [200]


def test_without_a_token_nothing_is_sent_and_the_log_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=addon_discovery.__name__)
    assert start_announcing(10200, {"SUPERVISOR_TOKEN": " "}) is None
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert "SUPERVISOR_TOKEN is not set" in record.getMessage()
    assert "not told" in record.getMessage()
