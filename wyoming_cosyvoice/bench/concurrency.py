"""Server-level benchmark: K simultaneous requests through the real Wyoming server over TCP.

Starts the server (``python -m wyoming_cosyvoice.bench.server``, the server's start-up with the
benchmark's fixed token count) as a subprocess on a free port of 127.0.0.1 with the model
directory, waits until it answers and has finished one short warm-up request, then for each
concurrency level K sends K ``synthesize`` requests at the same moment, each on its own
connection (``wyoming.client.AsyncTcpClient``). Per request it records the time to the first
``audio-chunk`` and to ``audio-stop``; per level, the audio seconds produced per wall second.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from engine.bench.report import fmt

_LOGGER = logging.getLogger(__name__)
READY_TIMEOUT_S = 900.0  # full-size load + warm-up on a busy 2-core box
REQUEST_TIMEOUT_S = 3600.0
WARMUP_TEXT = "Hello."


@dataclass
class ServerProcess:
    """A running server subprocess and where its log goes."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def peak_rss_mb(self) -> float | None:
        try:
            status = Path(f"/proc/{self.process.pid}/status").read_text()
        except OSError:
            return None
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return None

    def cpu_s(self) -> float | None:
        """CPU seconds the server has used so far (all its threads; None without /proc)."""
        try:
            stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def server_command(
    model_dir: Path,
    port: int,
    *,
    profile: str,
    threads: int | None,
    tokens: int | None,
    config: Path | None = None,
    extra_args: list[str] | None = None,
) -> list[str]:
    """The command line of the benchmark's server; ``tokens`` per sentence, None = until EOS."""
    command = [sys.executable, "-m", "wyoming_cosyvoice.bench.server"]
    if tokens is not None:
        command += ["--force-tokens", str(tokens)]
    command += ["--uri", f"tcp://127.0.0.1:{port}", "--model-dir", str(model_dir)]
    command += ["--profile", profile]
    # Every request reaches the engine: its levels repeat one text, which the repeat cache
    # would otherwise answer from memory after the first.
    command += ["--set", "cache.max_mb=0"]
    if config is not None:
        command += ["--config", str(config)]
    if threads:
        command += ["--threads", str(threads)]
    return command + (extra_args or [])


def start_server(
    model_dir: Path,
    *,
    profile: str,
    threads: int | None,
    tokens: int | None,
    config: Path | None = None,
    extra_args: list[str] | None = None,
) -> ServerProcess:
    """Start the server on a free port of 127.0.0.1; its output goes to a log file."""
    port = free_port()
    command = server_command(
        model_dir,
        port,
        profile=profile,
        threads=threads,
        tokens=tokens,
        config=config,
        extra_args=extra_args,
    )
    log_path = Path(tempfile.mkstemp(prefix="bench-server-", suffix=".log")[1])
    _LOGGER.info("Starting %s (log: %s)", " ".join(command), log_path)
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(process, port, log_path)


@dataclass
class ReplyAudio:
    """What a client counts of a reply's audio as its events arrive."""

    first_at: float | None = None  # when the first audio came (time.perf_counter)
    n_bytes: int = 0
    bytes_per_s: int = 0  # the format comes with audio-start
    blocks: int = 0  # audio-start … audio-stop blocks

    def take(self, event: Any) -> None:
        """Count one event; a server's ``error`` raises RuntimeError with its text."""
        from wyoming.audio import AudioChunk, AudioStart
        from wyoming.error import Error

        if AudioStart.is_type(event.type):
            audio = AudioStart.from_event(event)
            self.bytes_per_s = audio.rate * audio.width * audio.channels
            self.blocks += 1
        elif AudioChunk.is_type(event.type):
            chunk = AudioChunk.from_event(event)
            if self.first_at is None and chunk.audio:
                self.first_at = time.perf_counter()
            self.n_bytes += len(chunk.audio)
        elif Error.is_type(event.type):
            raise RuntimeError(f"server error: {Error.from_event(event).text}")

    @property
    def audio_s(self) -> float:
        return self.n_bytes / self.bytes_per_s if self.bytes_per_s else 0.0


async def read_reply(client: Any, until: str, timeout: float) -> ReplyAudio:
    """A reply's events up to the first of type ``until``, counted."""
    reply = ReplyAudio()
    while True:
        event = await asyncio.wait_for(client.read_event(), timeout)
        if event is None:
            raise ConnectionError(f"the server closed the connection before {until}")
        reply.take(event)
        if event.type == until:
            return reply


async def request(port: int, text: str, *, timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """One ``synthesize`` on its own connection: first-audio and total times, audio seconds."""
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize

    start = time.perf_counter()
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text=text).event())
        reply = await read_reply(client, "audio-stop", timeout)
    end = time.perf_counter()
    first = reply.first_at
    return {
        "first_audio_ms": (first - start) * 1000 if first else None,
        "total_ms": (end - start) * 1000,
        "audio_s": reply.audio_s,
        "start": start,
        "end": end,
    }


async def wait_ready(server: ServerProcess, timeout: float = READY_TIMEOUT_S) -> float:
    """Seconds until the server completes a short request (model loaded and warm)."""
    start = time.perf_counter()
    while True:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {server.process.returncode}:\n{server.log_tail()}"
            )
        if time.perf_counter() - start > timeout:
            raise TimeoutError(f"the server was not ready after {timeout:.0f} s")
        try:
            await request(server.port, WARMUP_TEXT, timeout=timeout)
            return time.perf_counter() - start
        except OSError:  # not listening yet
            await asyncio.sleep(0.5)


async def run_level(server: ServerProcess, text: str, k: int) -> dict[str, Any]:
    """K simultaneous requests; per-request times, aggregate audio seconds per wall second and
    the server's CPU seconds per audio second."""
    cpu_before = server.cpu_s()
    results = await asyncio.gather(*(request(server.port, text) for _ in range(k)))
    cpu_after = server.cpu_s()
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    audio = sum(r["audio_s"] for r in results)
    firsts = [r["first_audio_ms"] for r in results if r["first_audio_ms"] is not None]
    return {
        "concurrency": k,
        "requests": [
            {key: r[key] for key in ("first_audio_ms", "total_ms", "audio_s")} for r in results
        ],
        "first_audio_ms_median": statistics.median(firsts) if firsts else None,
        "total_ms_median": statistics.median(r["total_ms"] for r in results),
        "audio_s": audio,
        "wall_s": wall,
        "aggregate_audio_s_per_s": audio / wall if wall > 0 else None,
        "server_cpu_s_per_audio_s": (cpu_after - cpu_before) / audio
        if cpu_before is not None and cpu_after is not None and audio > 0
        else None,
    }


async def _run(server: ServerProcess, text: str, levels: list[int]) -> dict[str, Any]:
    ready_s = await wait_ready(server)
    _LOGGER.info("Server ready after %.1f s", ready_s)
    results = []
    for k in levels:
        _LOGGER.info("Sending %d simultaneous request(s)", k)
        results.append(await run_level(server, text, k))
    single = next((r["aggregate_audio_s_per_s"] for r in results if r["concurrency"] == 1), None)
    for r in results:
        r["throughput_vs_single"] = (
            r["aggregate_audio_s_per_s"] / single
            if single and r["aggregate_audio_s_per_s"]
            else None
        )
    return {"server_ready_s": ready_s, "levels": results}


def run(
    model_dir: Path,
    *,
    text: str,
    levels: list[int],
    profile: str,
    threads: int | None,
    tokens: int | None,
    config: Path | None = None,
    extra_args: list[str] | None = None,
) -> dict[str, Any]:
    """Start the server, measure every concurrency level, stop the server."""
    server = start_server(
        model_dir,
        profile=profile,
        threads=threads,
        tokens=tokens,
        config=config,
        extra_args=extra_args,
    )
    try:
        result = asyncio.run(_run(server, text, levels))
        result["server_peak_rss_mb"] = server.peak_rss_mb()
    except BaseException:
        _LOGGER.error("server log tail:\n%s", server.log_tail())
        raise
    finally:
        server.stop()
    result.update(
        {
            "mode": "concurrency",
            "model_dir": str(model_dir),
            "profile": profile,
            "threads": threads,
            "text": text,
            "tokens": tokens,
            "server_log": str(server.log_path),
        }
    )
    return result


def write_neighbours(result: dict[str, Any], out: TextIO) -> None:
    """The table's line saying that busy neighbour processes ran (none: nothing)."""
    neighbours = result.get("neighbours") or {}
    if neighbours.get("count"):
        out.write(
            f"busy      {neighbours['count']} {neighbours['kind']} neighbour process(es) ran "
            "throughout\n"
        )


def print_table(result: dict[str, Any], out: TextIO) -> None:
    w = out.write
    w(
        f"server    {result['model_dir']} profile {result['profile']}, threads "
        f"{result['threads'] or 'default'}; ready after {result['server_ready_s']:.1f} s, "
        f"peak RSS {result['server_peak_rss_mb'] or 0:,.0f} MB\n"
    )
    w(f"text      {result['text']}\n")
    write_neighbours(result, out)
    w("\n")
    w(
        f"{'K':>3}{'first audio ms (each)':>34}{'total ms (each)':>34}"
        f"{'audio s':>9}{'wall s':>9}{'audio-s/s':>11}{'×single':>9}{'CPU-s/audio-s':>15}\n"
    )
    for level in result["levels"]:
        firsts = " ".join(
            f"{r['first_audio_ms']:.0f}" if r["first_audio_ms"] else "–" for r in level["requests"]
        )
        totals = " ".join(f"{r['total_ms']:.0f}" for r in level["requests"])
        ratio = level["throughput_vs_single"]
        w(
            f"{level['concurrency']:>3}{firsts:>34}{totals:>34}{level['audio_s']:>9.2f}"
            f"{level['wall_s']:>9.2f}{level['aggregate_audio_s_per_s'] or 0:>11.3f}"
            f"{(f'{ratio:.2f}' if ratio else '–'):>9}"
            f"{fmt(level.get('server_cpu_s_per_audio_s'), 2):>15}\n"
        )
