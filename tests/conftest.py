"""Shared fixtures for the server tests: free ports, a fake engine, an in-process server, a client.

The fake engine has the real engine's surface (``engine.api.Engine``, its defaults from
``fake_surface.FakeSurface``): speakers, ``synthesize(text, options, cancel)`` as a plain
blocking generator of ``AudioChunk``s that raises ``SynthesisCancelled`` soon after ``cancel``
is set. Its audio is deterministic (a sine per speaker, ``SAMPLES_PER_CHAR`` samples per
character) so tests can check exact lengths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
from fake_surface import FakeSurface

if TYPE_CHECKING:
    from engine.api import Engine
    from engine.core.types import AudioChunk, SynthesisOptions

ROOT = Path(__file__).resolve().parent.parent
# the tests' root (the helpers beside this file) and its data, for a test in any folder below
TESTS = ROOT / "tests"
DATA = TESTS / "data"
TINY_MODEL = DATA / "tiny_model"
SAMPLE_RATE = 22050


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# --- fake engine ----------------------------------------------------------------------------


class FakeEngine(FakeSurface):
    """Deterministic stand-in for CosyVoiceEngine; records every call."""

    SAMPLES_PER_CHAR = 441  # 20 ms of audio per input character
    # About -18 LUFS, the server's loudness target: its voices keep unity gain, so tests can
    # compare the audio of one request with another's byte for byte.
    AMPLITUDE = 0.195
    CHUNK = 2205  # 100 ms per yielded chunk

    def __init__(self, model_dir: Path, threads: int | None = None, *, delay: float = 0.005,
                 speakers: list[str] | None = None,
                 hold: threading.Event | None = None) -> None:  # fmt: skip
        self.model_dir, self.threads, self.delay = model_dir, threads, delay
        # Given: each sentence yields its first chunk, then waits until ``hold`` is set (or it is
        # cancelled), so a test decides when a sentence can be over instead of guessing a time.
        self.hold = hold
        self.speakers = speakers or [
            "中文女",
            "中文男",
            "英文女",
            "英文男",
            "日语男",
            "粤语女",
            "韩语女",
        ]
        self.calls: list[Call] = []
        self.lock = threading.Lock()
        self.warmed = False

    def warmup(self) -> None:
        self.warmed = True

    @classmethod
    def expected_samples(cls, sentence: str) -> int:
        return len(sentence) * cls.SAMPLES_PER_CHAR

    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        from engine.core.types import (
            AudioChunk,
            EngineError,
            SynthesisCancelled,
            SynthesisOptions,
            UnknownSpeakerError,
        )

        options = options or SynthesisOptions()
        if options.speaker not in self.speakers:
            raise UnknownSpeakerError(f"unknown speaker {options.speaker!r}")
        call = Call(text, options.speaker, threading.current_thread().name)
        with self.lock:
            self.calls.append(call)
        total = self.expected_samples(text)
        freq = 200.0 + 40.0 * self.speakers.index(options.speaker)
        done = 0
        try:
            while done < total:
                if done > 0 and self.hold is not None:
                    self._wait_for_hold(cancel)
                if cancel is not None and cancel.is_set():
                    call.cancelled = True
                    raise SynthesisCancelled("cancelled")
                if "FAIL" in text and done > 0:
                    raise EngineError("the fake engine failed on purpose")
                if "CRASH" in text:
                    raise RuntimeError("unexpected crash")
                time.sleep(self.delay)
                n = min(self.CHUNK, total - done)
                t = (np.arange(done, done + n) / SAMPLE_RATE).astype(np.float32)
                done += n
                call.chunks += 1
                yield AudioChunk(self.AMPLITUDE * np.sin(2 * np.pi * freq * t))
            call.finished = True
        finally:
            call.ended.set()  # finished, failed, cancelled or closed

    HOLD_LIMIT_S = 120  # a test that fails before letting go must not leave a thread behind

    def _wait_for_hold(self, cancel: threading.Event | None) -> None:
        """Until ``hold`` is set or the call is cancelled (bounded against a hang)."""
        from engine.core.types import EngineError

        assert self.hold is not None
        deadline = time.monotonic() + self.HOLD_LIMIT_S
        while not self.hold.wait(0.01):
            if cancel is not None and cancel.is_set():
                return
            if time.monotonic() > deadline:
                raise EngineError("the test never let the held sentence go on")


if TYPE_CHECKING:  # mypy holds the fake to the whole surface
    _SURFACE: type[Engine] = FakeEngine


@dataclass
class Call:
    text: str
    speaker: str
    thread: str
    chunks: int = 0
    cancelled: bool = False
    finished: bool = False
    ended: threading.Event = field(default_factory=threading.Event)


class Outcomes:
    """Subscribed to a server's metrics (``scheduler.metrics.subscribe``): how each request
    ended ("ok", "cancelled", "stalled", "error"), in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def speech_done(self, report: Any) -> None:
        self.seen.append(report.outcome)

    def error_sent(self, front_end: str, code: str) -> None:
        pass


# --- a fixed sentence splitter -------------------------------------------------------------

# A Latin ender only counts once whitespace follows (so "3.5" and "e.g." mid-token stay whole);
# CJK enders split at once. Closing quotes/brackets stay with their sentence.
_BOUNDARY = re.compile(
    r"""(?:[.!?…]+["'”’)\]]*\s+)|(?:[。！？；]+[”’」』）》】"']*\s*)|(?:\n\s*\n)"""
)


class SimpleSplitter:
    """A small regex splitter with the frontend splitter's feed/flush interface, for server
    tests with the fake engine: its cuts are plain to read off a test's text (the real one is
    driven by the tests with the real engine). Releases each sentence as soon as its end is
    certain; a sentence longer than ``max_chars`` is cut at its last comma or space."""

    def __init__(self, max_chars: int = 120) -> None:
        self._buffer = ""
        self.max_chars = max_chars

    def _cut_long(self) -> list[str]:
        out = []
        while len(self._buffer) > self.max_chars:
            head = self._buffer[: self.max_chars]
            comma = max(head.rfind(c) for c in ",，、;；")
            cut = (comma if comma > 0 else head.rfind(" ")) + 1 or self.max_chars
            piece, self._buffer = self._buffer[:cut].strip(), self._buffer[cut:]
            if piece:
                out.append(piece)
        return out

    def feed(self, fragment: str) -> list[str]:
        self._buffer += fragment
        sentences: list[str] = []
        start = 0
        for match in _BOUNDARY.finditer(self._buffer):
            sentence = self._buffer[start : match.end()].strip()
            if sentence:
                sentences.extend(SimpleSplitter(self.max_chars).feed_whole(sentence))
            start = match.end()
        self._buffer = self._buffer[start:]
        return sentences + self._cut_long()

    def feed_whole(self, sentence: str) -> list[str]:
        """A complete sentence, cut to ``max_chars`` pieces."""
        self._buffer = sentence
        pieces = self._cut_long()
        rest, self._buffer = self._buffer.strip(), ""
        return [*pieces, rest] if rest else pieces

    def flush(self) -> list[str]:
        pieces = self._cut_long()
        rest, self._buffer = self._buffer.strip(), ""
        return [*pieces, rest] if rest else pieces

    @property
    def pending(self) -> str:
        """The sentence in progress (fed, not yet released)."""
        return self._buffer


# --- in-process server and client ----------------------------------------------------------


@dataclass
class Reply:
    """Everything a client received for one request."""

    events: list[Any] = field(default_factory=list)

    @property
    def types(self) -> list[str]:
        return [e.type for e in self.events]

    @property
    def audio(self) -> bytes:
        return b"".join(e.payload or b"" for e in self.events if e.type == "audio-chunk")

    @property
    def samples(self) -> int:
        return len(self.audio) // 2

    def blocks(self) -> list[bytes]:
        """Audio of each audio-start … audio-stop block."""
        out: list[bytes] = []
        for event in self.events:
            if event.type == "audio-start":
                out.append(b"")
            elif event.type == "audio-chunk":
                out[-1] += event.payload or b""
        return out

    def error(self) -> Any:
        from wyoming.error import Error

        errors = [Error.from_event(e) for e in self.events if e.type == "error"]
        return errors[0] if errors else None


async def read_until(client: Any, stop: tuple[str, ...], timeout: float = 20.0) -> Reply:
    """Read events until one of ``stop`` (included) or the server closes (None)."""
    reply = Reply()
    while True:
        event = await asyncio.wait_for(client.read_event(), timeout)
        if event is None:
            return reply
        reply.events.append(event)
        if event.type in stop:
            return reply


@contextlib.asynccontextmanager
async def fake_server(
    overrides: dict[str, Any] | None = None,
    *,
    engine: Callable[..., Any] | None = None,
    model_dir: Path = TINY_MODEL,
    wait_ready: bool = True,
) -> AsyncIterator[SimpleNamespace]:
    """The real server (handler, scheduler, limits) on a free port, with a fake engine."""
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.wyoming.server import create_server

    port = free_port()
    # A data dir of its own: what the server keeps there (the voices' levels) stays in the test.
    data = tempfile.TemporaryDirectory(prefix="fake-server-data-")
    settings = {"server.uri": f"tcp://127.0.0.1:{port}", "server.warmup": False,
                "server.data_dirs": [data.name]}  # fmt: skip
    settings.update(overrides or {})
    config = load_config(None, settings.items())
    engines: list[Any] = []

    def factory(path: Path, threads: int | None) -> Any:
        made = (engine or FakeEngine)(path, threads)
        engines.append(made)
        return made

    running = await create_server(
        config, model_dir, engine_factory=factory, splitter_factory=SimpleSplitter
    )
    try:
        if wait_ready:
            await asyncio.wait_for(asyncio.shield(running.load_task), 10)
        yield SimpleNamespace(port=port, running=running, config=config, engines=engines)
    finally:
        await running.stop()
        data.cleanup()


def connect(port: int) -> Any:
    from wyoming.client import AsyncTcpClient

    return AsyncTcpClient("127.0.0.1", port)


async def synthesize(port: int, text: str, voice: dict[str, Any] | None = None) -> Reply:
    """One non-streaming request on its own connection, as Home Assistant sends it."""
    from wyoming.event import Event

    data: dict[str, Any] = {"text": text}
    if voice is not None:
        data["voice"] = voice
    async with connect(port) as client:
        await client.write_event(Event("synthesize", data))
        return await read_until(client, ("audio-stop", "error"))


async def stream(
    port: int, text: str, *, fragment: int = 3, voice: dict[str, Any] | None = None
) -> Reply:
    """Home Assistant's exact streaming order: start, fragments, compat synthesize, stop."""
    from wyoming.event import Event

    async with connect(port) as client:
        await client.write_event(Event("synthesize-start", {"voice": voice} if voice else {}))
        for i in range(0, len(text), fragment):
            await client.write_event(Event("synthesize-chunk", {"text": text[i : i + fragment]}))
        await client.write_event(
            Event("synthesize", {"text": text, **({"voice": voice} if voice else {})})
        )
        await client.write_event(Event("synthesize-stop"))
        return await read_until(client, ("synthesize-stopped", "error"))


@pytest.fixture
def wy() -> SimpleNamespace:
    """Helpers for server tests (one fixture, so test files need no shared module)."""
    return SimpleNamespace(
        FakeEngine=FakeEngine,
        fake_server=fake_server,
        connect=connect,
        read_until=read_until,
        synthesize=synthesize,
        stream=stream,
        until=until,
        Outcomes=Outcomes,
        Reply=Reply,
        free_port=free_port,
        ROOT=ROOT,
        TINY_MODEL=TINY_MODEL,
    )


# The model families the server processes of tests/http_process.py run (v1: the SFT kind).
FAMILIES = ("v1", "v2")


@pytest.fixture(scope="session", params=FAMILIES)
def family_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Any]:  # fmt: skip
    """The real server of each family in a process of its own (``http_process.shared_server``),
    shared by the test modules that only ask it things: each start costs seconds of CPU."""
    from http_process import shared_server

    with shared_server(request.param, tmp_path_factory.mktemp(f"server-{request.param}")) as srv:
        yield srv


def terminate(process: subprocess.Popen, timeout: float = 30) -> str:
    """SIGTERM a server subprocess (killed after ``timeout`` s); its piped stderr, else ''."""
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
    return err or ""


def wait_until(condition: Callable[[], object], what: str, timeout: float = 60) -> None:
    """Poll ``condition`` until it holds: a deadline against hangs, not a timing check."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.02)


async def until(condition: Callable[[], object], what: str, timeout: float = 60) -> None:
    """:func:`wait_until` on an event loop (which keeps running meanwhile)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        await asyncio.sleep(0.02)


def wait_for_port(port: int, process: subprocess.Popen, timeout: float = 60) -> None:
    """Wait until a server subprocess accepts TCP connections on 127.0.0.1:``port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"server exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"server did not listen on {port} within {timeout} s")


# --- what a skipped test needs of the CPU or the torch build (named in its reason) ----------

ONEDNN_OPS_NEEDED = (
    "needs torch's oneDNN (mkldnn) ops on reordered weights (torch.ops.mkldnn."
    "_reorder_linear_weight, _linear_pointwise, _reorder_convolution_weight, "
    "_convolution_pointwise); this torch build lacks them"
)
INT8_KERNELS_NEEDED = (
    "needs a torch quantized engine that packs and computes int8 Linear layers here (x86, "
    "fbgemm or qnnpack: engine.core.cpu.choose_int8_engine); this CPU and torch build have none of "
    "them working"
)


# --- a network namespace of the test's own ------------------------------------------------

# TEST-NET-1: the address exists only inside the namespace the test makes.
NAMESPACE_LAN_ADDRESS = "192.0.2.2"
# A LAN as a machine has one: loopback up, an interface with the address (a veth pair: it comes
# up with a carrier, unlike a lone interface) and a default route through it.
_NAMESPACE_SETUP = f"""set -e
ip link set lo up
ip link add lan0 type veth peer name lan1
ip addr add {NAMESPACE_LAN_ADDRESS}/24 dev lan0
ip link set lan1 up
ip link set lan0 up
ip route add default dev lan0
"""


def run_python_in_network_namespace(*args: str, timeout: float = 120) -> str:
    """Run ``sys.executable *args`` in a new user and network namespace holding only loopback
    and a LAN interface (NAMESPACE_LAN_ADDRESS); returns its stdout. Tests that multicast use
    it so that nothing leaves the machine. A machine that cannot make the namespace fails the
    test with the reason (a skip would hide a broken test)."""
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"a network namespace needs {' and '.join(missing)} (util-linux, iproute2)")
    unshare = ["unshare", "--user", "--map-root-user", "--net"]
    made = subprocess.run(
        [*unshare, "sh", "-c", _NAMESPACE_SETUP], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        pytest.fail(
            "cannot make a network namespace for this test (it needs unprivileged user "
            "namespaces, or root): " + made.stderr.strip()
        )
    script = _NAMESPACE_SETUP + 'exec "$@"\n'
    done = subprocess.run(
        [*unshare, "sh", "-c", script, "sh", sys.executable, *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"exit status {done.returncode} in the namespace:\n{done.stderr}"
    return done.stdout


def event_bytes(kind: str, data: dict[str, Any] | None = None, **extra: Any) -> bytes:
    """One event with its data block, framed as the wyoming writer frames it."""
    block = json.dumps(data).encode() if data is not None else b""
    head = {"type": kind, **({"data_length": len(block)} if block else {}), **extra}
    return json.dumps(head).encode() + b"\n" + block


def synthesize_all(engine: Any, text: str, options: Any) -> torch.Tensor:
    """Every sample a real engine's ``synthesize(text, options)`` yields, in one tensor."""
    return torch.cat([torch.from_numpy(c.samples) for c in engine.synthesize(text, options)])


@pytest.fixture(scope="module")
def single_torch_thread() -> Iterator[None]:
    """Tiny tensors: a second thread only contends (100x slower on a loaded 2-core box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PARITY_THREADS_ENV = "COSYVOICE_TEST_THREADS"


@pytest.fixture(autouse=True)
def _parity_thread_count(request: pytest.FixtureRequest) -> Iterator[None]:
    """A parity test runs at the torch thread count the environment names, if it names one,
    whatever its module set up: tests/engine_tests/core/test_kernel_paths.py re-runs the parity
    tests at other counts, since a reduction split over more threads adds in another order."""
    wanted = os.environ.get(PARITY_THREADS_ENV)
    if not wanted or request.node.get_closest_marker("parity") is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(int(wanted))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session", autouse=True)
def _user_cache_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The engine writes the prepared weights of a model directory it cannot write under
    $XDG_CACHE_HOME by default: keep that out of the real ~/.cache. Session-wide, so that
    servers started by module-scoped fixtures inherit it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
        yield


@pytest.fixture(scope="session", autouse=True)
def _torch_within_the_thread_ceiling() -> None:
    """Tests that run torch without the engine's load stay within the CPU's thread ceiling, as
    the load does (engine.core.cpu: one thread where the torch build dies on more)."""
    from engine.core.cpu import capped_threads, thread_ceiling

    threads = capped_threads(None, thread_ceiling())
    if threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _threads_ignore_the_machines_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Thread counts in tests must not depend on what else the machine runs: the engine's
    shrinking to the cores other processes leave free is tested with a scripted monitor."""
    from engine.core import thread_budget

    monkeypatch.setattr(thread_budget, "_follow_free_cores", False)
    monkeypatch.setattr(thread_budget, "_configured", None)
