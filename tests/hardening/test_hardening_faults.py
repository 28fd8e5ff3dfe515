"""Faults: clients hanging up at every stage, SIGTERM mid-synthesis, a corrupt model.

Already covered elsewhere: a client leaving mid-stream cancels within one chunk
(test_server_protocol.py), a client that stops reading is dropped and blocks nobody
(test_server_errors.py), an interrupted download resumes and never looks complete
(test_download.py), a truncated checkpoint is named by the loader (test_weights.py).

Added: every disconnect stage, each by FIN and by RST, must leave no connection task, no queued
request and no held engine behind, log nothing at ERROR, and the next client gets full audio;
SIGTERM while the engine synthesizes cancels it and exits 0, also when the engine is inside a
computation it cannot leave; a model directory with a
truncated ``llm.pt`` ends the real process at start with a message naming the file.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import ROOT, wait_for_port
from conftest import event_bytes as header
from wyoming.event import async_read_event

WAIT_S = 60  # bound on each wait for a subprocess: generous for a busy machine
LONG = "This sentence is long enough to take a good while to speak out loud, " * 3 + "really."


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _read_until(reader: asyncio.StreamReader, kind: str, timeout: float = 10) -> None:
    while (event := await asyncio.wait_for(async_read_event(reader), timeout)) is not None:
        if event.type == kind:
            return
    raise AssertionError(f"closed before {kind}")


# stage -> (bytes sent, event type to wait for before hanging up, or None)
STAGES: dict[str, tuple[bytes, str | None]] = {
    "mid header line": (b'{"type": "synthe', None),
    "mid data block": (b'{"type": "synthesize", "data_length": 100}\n{"text": "Hel', None),
    "mid payload": (b'{"type": "audio-chunk", "payload_length": 1000}\n' + b"\0" * 10, None),
    "after synthesize, before audio": (header("synthesize", {"text": LONG}), None),
    "mid audio": (header("synthesize", {"text": LONG}), "audio-chunk"),
    "during streaming input": (
        header("synthesize-start") + header("synthesize-chunk", {"text": "An open sentence"}),
        None,
    ),
    "streaming, mid audio": (
        header("synthesize-start") + header("synthesize-chunk", {"text": LONG + " And more"}),
        "audio-chunk",
    ),
    "after synthesize-stop, before synthesize-stopped": (
        header("synthesize-start")
        + header("synthesize-chunk", {"text": LONG})
        + header("synthesize-stop"),
        "audio-chunk",
    ),
}


@pytest.mark.parametrize("how", ["FIN", "RST"])
@pytest.mark.parametrize("stage", list(STAGES))
def test_disconnect_at_every_stage_leaves_nothing_behind(
    wy: SimpleNamespace, stage: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    payload, wait_for = STAGES[stage]
    caplog.set_level(logging.INFO)

    hold = threading.Event()  # the abandoned sentence cannot end before the client has left

    async def main() -> tuple[int, Any, list[Any]]:
        engine = lambda p, t: wy.FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server(engine=engine) as srv:
            reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
            writer.write(payload)
            await writer.drain()
            if wait_for:
                await _read_until(reader, wait_for)
            else:  # at least taken in: the bytes may or may not have been read
                await wy.until(lambda: srv.running.handlers, "the server serves the client")
            if how == "RST":
                sock = writer.get_extra_info("socket")
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            writer.close()
            # The server forgets the connection: no task, no queue, engine free.
            await wy.until(lambda: not srv.running.handlers, "the server forgets the client")
            waiting = srv.running.scheduler.waiting
            hold.set()
            after = await wy.synthesize(srv.port, "The next client.")
            return waiting, after, srv.engines[0].calls

    waiting, after, calls = run(main())
    assert waiting == 0
    assert after.samples == wy.FakeEngine.expected_samples("The next client.")
    # The abandoned synthesis was stopped, not spoken to the end.
    abandoned = [c for c in calls if c.text != "The next client."]
    assert all(c.cancelled or not c.finished for c in abandoned), abandoned
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not logged, logged


# --- real processes ---------------------------------------------------------------------------


SERVER = [sys.executable, "-m", "wyoming_cosyvoice"]
# The server's command line plus --force-tokens (the benchmark's launcher).
FIXED_TOKENS_SERVER = [sys.executable, "-m", "wyoming_cosyvoice.bench.server"]
STAND_IN_SERVER = [sys.executable, str(ROOT / "tests" / "stand_in_server.py")]


def _start(args: list[str], command: list[str] = SERVER) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*command, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


async def _first_audio(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(header("synthesize", {"text": "Hello there."}))
    await writer.drain()
    await _read_until(reader, "audio-chunk", timeout=WAIT_S)
    return reader, writer


def _sigterm_mid_sentence(
    process: subprocess.Popen[str], port: int, computing: Path | None = None
) -> tuple[bool, str]:
    """SIGTERM once the first audio has arrived (and ``computing`` exists, if given); (the
    client saw the close, the server log).

    Generous bounded waits, no durations asserted: a busy machine may be slow, but a stop
    that waits for an engine computation to end would take minutes and fail here.
    """
    try:
        wait_for_port(port, process, timeout=WAIT_S)

        async def main() -> bool:
            reader, writer = await _first_audio(port)
            deadline = time.monotonic() + WAIT_S
            while computing is not None and not computing.exists():
                assert time.monotonic() < deadline, "the engine never started its computation"
                await asyncio.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            await asyncio.get_running_loop().run_in_executor(None, process.wait, WAIT_S)
            closed = await asyncio.wait_for(reader.read(), WAIT_S) is not None
            writer.close()
            return closed

        closed = run(main())
    finally:
        if process.poll() is None:
            process.kill()
        _, log = process.communicate(timeout=WAIT_S)
    return closed, log


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
def test_sigterm_while_synthesizing_exits_cleanly(wy: SimpleNamespace) -> None:
    port = wy.free_port()
    # 3000 forced tokens = 60 s of speech: still synthesizing when the signal comes.
    process = _start(
        [
            "--uri",
            f"tcp://127.0.0.1:{port}",
            "--model-dir",
            str(wy.TINY_MODEL),
            "--threads",
            "1",
            "--no-warmup",
            "--force-tokens",
            "3000",
            "--seed",
            "0",
        ],  # fmt: skip
        FIXED_TOKENS_SERVER,
    )
    closed, log = _sigterm_mid_sentence(process, port)
    assert process.returncode == 0, log[-2000:]
    assert closed
    assert "Traceback" not in log and "Shutting down" in log, log[-2000:]
    assert "Cancelled 1 request(s) in progress" in log, log[-2000:]


@pytest.mark.skipif(sys.platform != "linux", reason="POSIX signals")
@pytest.mark.long
def test_sigterm_does_not_wait_for_an_engine_computation(
    wy: SimpleNamespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine checks its cancel event between LM tokens and chunks, not inside a flow
    pass. A stop must cancel at once and, if the engine is still computing after the grace
    period, exit without it (the Supervisor kills at 10 s). The stand-in's chunk lasts ten
    minutes."""
    from stand_in_server import CANCEL_SEEN, COMPUTING_FILE_ENV

    port = wy.free_port()
    args = ["--uri", f"tcp://127.0.0.1:{port}", "--model-dir", str(wy.TINY_MODEL), "--no-warmup"]
    computing = tmp_path / "computing"
    monkeypatch.setenv(COMPUTING_FILE_ENV, str(computing))
    process = _start(args, STAND_IN_SERVER)
    # Signalled inside the computation: before it, the server cancels without calling it.
    closed, log = _sigterm_mid_sentence(process, port, computing)
    assert process.returncode == 0, log[-2000:]
    assert closed
    assert "Cancelled 1 request(s) in progress" in log, log[-2000:]
    assert CANCEL_SEEN in log, log[-2000:]  # the engine was told at once
    assert "exiting without it" in log, log[-2000:]
    assert "Traceback" not in log, log[-2000:]


def test_corrupt_model_file_fails_at_start_with_a_clear_message(
    wy: SimpleNamespace, tmp_path: Path
) -> None:
    model = tmp_path / "CosyVoice-300M-SFT"
    shutil.copytree(wy.TINY_MODEL, model)
    llm = model / "llm.pt"
    llm.chmod(0o644)
    llm.write_bytes(llm.read_bytes()[: llm.stat().st_size // 2])
    port = wy.free_port()
    process = _start(["--uri", f"tcp://127.0.0.1:{port}", "--model-dir", str(model)])
    try:
        _, log = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    assert "Model failed to load" in log and "llm.pt: truncated or corrupt" in log, log[-2000:]
    assert "Traceback" not in log


def test_a_describe_flood_without_reading_is_bounded(wy: SimpleNamespace) -> None:
    """Each unread ``info`` is kilobytes of objects: the server stops reading at a handful
    instead of queueing thousands (a client that catches up is served on), and refuses a
    client that reads nothing for ``stall_timeout_s``; others are served meanwhile."""
    from wyoming_cosyvoice.wyoming.handler import _MAX_UNSENT_INFO, EventHandler

    async def main() -> tuple[int, Any, list[Any]]:
        limits = {"limits.stall_timeout_s": 0.5}
        async with wy.fake_server(limits) as srv:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", srv.port))
            reader, writer = await asyncio.open_connection(sock=sock)
            writer.write(header("describe") * 5000)
            await writer.drain()
            import gc

            await wy.until(lambda: srv.running.handlers, "the server serves the flooder")
            # type(), not isinstance(): the latter reads __class__ of every object in the process,
            # and torch's deprecated aliases warn when touched.
            peer = str(sock.getsockname())  # other tests' handlers may not be collected yet
            (flooded,) = [
                h for h in gc.get_objects() if issubclass(type(h), EventHandler) and h._peer == peer
            ]
            # It stops reading once the answers pile up; stall_timeout_s later it refuses.
            paused = lambda: flooded._unsent_info >= _MAX_UNSENT_INFO or flooded._closing  # noqa: E731
            await wy.until(paused, "the server stops reading")
            queued = flooded._out.qsize()
            other = await wy.synthesize(srv.port, "Someone else.")
            await wy.until(lambda: flooded._closing, "the flooder is refused")
            # Now read: a bounded number of answers, then the refusal, then the close.
            events = []
            try:
                while (event := await asyncio.wait_for(async_read_event(reader), 10)) is not None:
                    events.append(event)
            except asyncio.TimeoutError:
                raise AssertionError([e.type for e in events][-5:], len(events)) from None
            writer.close()
            return queued, other, events

    queued, other, events = run(main())
    assert queued <= 20, queued
    assert other.samples == wy.FakeEngine.expected_samples("Someone else.")
    # What reached the kernel's socket buffers before the stall is delivered (~1-2k small
    # answers on loopback); the rest of the 5000 were never read, let alone answered.
    assert len(events) < 4000 and events[-1].type == "error", len(events)
    assert "reads no answers" in events[-1].data["text"]
