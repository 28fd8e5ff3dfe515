"""A bounded soak of the real server process on the tiny model.

Run with ``.venv/bin/python -m pytest -m soak -o log_cli=true --log-cli-level=INFO``
(deselected by default). 200 requests from 8 concurrent clients, whole and streamed, about a
quarter of them hung up on before or in the middle of their audio, while a prober times
``describe`` every 200 ms. It passes when: every completed request has the right length
(identical to every other completion of the same text and mode, and a whole number of the
forced tokens' frames per sentence), the server logged no error or traceback, ``describe`` p99
stays under 1 s, open file descriptors and threads return to the warm-up baseline, and RSS grows
less than 5 % after warm-up. Traffic goes only to 127.0.0.1; counts and time are bounded.

Environment: ``SOAK_REQUESTS`` / ``SOAK_CLIENTS`` to scale, ``SOAK_REPORT=path.json`` to keep
the figures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import ROOT, terminate
from wyoming.event import Event

pytestmark = pytest.mark.soak

_LOGGER = logging.getLogger(__name__)
FORCE_TOKENS = 10
REQUESTS = int(os.environ.get("SOAK_REQUESTS", "200"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "8"))
WARMUP_REQUESTS = 24
TIME_CAP_S = 900.0  # the whole soak stops by itself
TEXTS = [
    "Hello there.",
    "The kitchen light is on. The door is locked!",
    "你好，今天天气很好。",
    "Turn off the music in the living room, please.",
]


def proc_stats(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
    return {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "rss_kb": rss_kb,
    }


@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0
    errors: list[str] = field(default_factory=list)
    lengths: dict[tuple[str, str], set[int]] = field(default_factory=dict)
    block_lengths: set[int] = field(default_factory=set)
    describe_s: list[float] = field(default_factory=list)
    peak: dict[str, int] = field(default_factory=dict)


async def one_request(wy: SimpleNamespace, port: int, index: int, tally: Tally) -> None:
    rng = random.Random(index)
    text = rng.choice(TEXTS)
    mode = rng.choice(["whole", "stream"])
    hang_up = rng.choices(["no", "before audio", "mid audio"], weights=[75, 12, 13])[0]
    async with wy.connect(port) as client:
        if mode == "whole":
            await client.write_event(Event("synthesize", {"text": text}))
            stop = ("audio-stop", "error")
        else:
            await client.write_event(Event("synthesize-start"))
            for i in range(0, len(text), 5):
                await client.write_event(Event("synthesize-chunk", {"text": text[i : i + 5]}))
            await client.write_event(Event("synthesize", {"text": text}))
            await client.write_event(Event("synthesize-stop"))
            stop = ("synthesize-stopped", "error")
        if hang_up == "before audio":
            tally.disconnected += 1
            return
        if hang_up == "mid audio":
            await wy.read_until(client, ("audio-chunk", "error"), timeout=120)
            tally.disconnected += 1
            return
        reply = await wy.read_until(client, stop, timeout=120)
    if reply.error() is not None or reply.types[-1] not in stop:
        tally.errors.append(f"{index} {mode} {text!r}: {reply.types[-3:]} {reply.error()}")
        return
    tally.completed += 1
    tally.lengths.setdefault((text, mode), set()).add(reply.samples)
    tally.block_lengths.update(len(b) // 2 for b in reply.blocks())


async def run_requests(
    wy: SimpleNamespace, port: int, indices: range, tally: Tally, pid: int
) -> None:
    queue = list(indices)

    async def client() -> None:
        while queue:
            await one_request(wy, port, queue.pop(0), tally)

    async def prober(done: asyncio.Event) -> None:
        while not done.is_set():
            start = time.monotonic()
            async with wy.connect(port) as conn:
                await conn.write_event(Event("describe"))
                await wy.read_until(conn, ("info",), timeout=10)
            tally.describe_s.append(time.monotonic() - start)
            for key, value in proc_stats(pid).items():  # peaks under load, for the report
                tally.peak[key] = max(tally.peak.get(key, 0), value)
            await asyncio.sleep(0.2)

    done = asyncio.Event()
    probe = asyncio.create_task(prober(done))
    try:
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
    finally:
        done.set()
        await probe


def settle(pid: int, baseline: dict[str, int], timeout: float = 15.0) -> dict[str, int]:
    """Resources once the last connections have been torn down (linger, engine cleanup)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = proc_stats(pid)
        back = stats["fds"] <= baseline["fds"] and stats["threads"] <= baseline["threads"]
        if back or time.monotonic() > deadline:
            return stats
        time.sleep(0.25)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def test_soak(wy: SimpleNamespace, tmp_path: Path) -> None:
    from engine.core.constants import HOP, tokens_to_frames

    port = wy.free_port()
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "wyoming_cosyvoice.bench.server", "--uri", f"tcp://127.0.0.1:{port}",
             "--model-dir", str(wy.TINY_MODEL), "--threads", "1", "--seed", "0",
             "--force-tokens", str(FORCE_TOKENS),
             # cache off: its few texts would be replayed from memory, not synthesized
             "--set", "cache.max_mb=0"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.DEVNULL, stderr=log_file,
        )  # fmt: skip
    started = time.monotonic()
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log_path.read_text()[-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not listen"
                time.sleep(0.1)

        warm = Tally()
        asyncio.run(
            run_requests(wy, port, range(10_000, 10_000 + WARMUP_REQUESTS), warm, process.pid)
        )
        assert warm.completed > 0 and not warm.errors, warm.errors
        baseline = settle(process.pid, {"fds": 1 << 30, "threads": 1 << 30}, timeout=2.0)

        tally = Tally()
        soak_start = time.monotonic()
        asyncio.run(
            asyncio.wait_for(
                run_requests(wy, port, range(REQUESTS), tally, process.pid), TIME_CAP_S
            )
        )
        soak_s = time.monotonic() - soak_start
        final = settle(process.pid, baseline)
    finally:
        terminate(process)
    log = log_path.read_text()
    error_lines = [ln for ln in log.splitlines() if " ERROR " in ln or " CRITICAL " in ln]
    rss_growth = (final["rss_kb"] - baseline["rss_kb"]) / baseline["rss_kb"]
    per_sentence = tokens_to_frames(FORCE_TOKENS) * HOP
    report: dict[str, Any] = {
        "requests": REQUESTS,
        "clients": CLIENTS,
        "completed": tally.completed,
        "hung_up_on_purpose": tally.disconnected,
        "errors": len(tally.errors),
        "server_error_log_lines": len(error_lines),
        "tracebacks": log.count("Traceback"),
        "soak_seconds": round(soak_s, 1),
        "total_seconds": round(time.monotonic() - started, 1),
        "describe_probes": len(tally.describe_s),
        "describe_p50_ms": round(1000 * statistics.median(tally.describe_s), 1),
        "describe_p99_ms": round(1000 * percentile(tally.describe_s, 99), 1),
        "describe_max_ms": round(1000 * max(tally.describe_s), 1),
        "baseline": baseline,
        "peak_under_load": tally.peak,
        "final": final,
        "rss_growth_pct": round(100 * rss_growth, 2),
        "samples_per_sentence": per_sentence,
        "lengths": {f"{m}:{t}": sorted(v) for (t, m), v in tally.lengths.items()},
        "exit_code": process.returncode,
    }
    _LOGGER.info("Soak figures: %s", json.dumps(report, ensure_ascii=False, indent=1))
    if path := os.environ.get("SOAK_REPORT"):
        Path(path).write_text(json.dumps(report, ensure_ascii=False, indent=1))

    assert not tally.errors, tally.errors[:5]
    assert tally.completed + tally.disconnected == REQUESTS
    assert not error_lines and "Traceback" not in log, (error_lines[:5], log[-3000:])
    # Same text, same mode, same seed: the same length every time it completes.
    assert all(len(v) == 1 for v in tally.lengths.values()), tally.lengths
    # Every audio block is whole sentences of exactly the forced token count.
    assert all(n > 0 and n % per_sentence == 0 for n in tally.block_lengths), tally.block_lengths
    assert percentile(tally.describe_s, 99) < 1.0
    assert final["fds"] <= baseline["fds"], (baseline, final)
    assert final["threads"] <= baseline["threads"], (baseline, final)
    assert rss_growth < 0.05, (baseline, final)
    assert process.returncode == 0
