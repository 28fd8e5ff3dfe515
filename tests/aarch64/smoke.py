"""Smoke test of the installed product on an Arm CPU (run by script/test-aarch64, one board each).

Checks, in order: what the engine picks for this CPU; that torch on many threads survives here
exactly when there is no thread ceiling, and that a multi-threaded matrix product after a load
runs within the ceiling; synthesis with the tiny model in every profile of config.yaml; the int8
deviations on this CPU's kernels; synthesis with the tiny Fun-CosyVoice3 model in every profile
(its LM int4 where this CPU's int4 kernel is fast, else int8, as the engine falls back); the real
server (warm-up, /health, describe, a streaming request); then the tests of PYTEST_RUNS with
pytest. Exits non-zero at the first failure.

Not collected by pytest (no ``test_`` prefix): it needs an Arm CPU and runs for minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from parity import parity_files  # noqa: E402  (tests/parity.py, beside this folder)

if TYPE_CHECKING:
    from engine.prompt.voices import CustomVoice

SRC = Path(__file__).resolve().parents[2]
TINY = SRC / "tests" / "data" / "tiny_model"
V3_DATA = SRC / "tests" / "data" / "cosyvoice3"
TINY_V3 = V3_DATA / "tiny"
V3_MODEL = "Fun-CosyVoice3-0.5B"  # the official directory's name, which the copy is given
V3_VOICE = "prompt37"  # the official prompt features stored with the v3 engine cases
CONFIG = SRC / "config.yaml"
# What pytest runs on the board: one run per entry, each entry pytest's arguments (paths relative
# to tests/). A marked subset of the whole suite would be ("-m", "MARKER", ".").
PYTEST_RUNS: tuple[tuple[str, ...], ...] = (
    # The quantised path: the CPU's choices, the int8 and int4 LM and int8 flow, prepared files,
    # HiFT.
    (
        "engine_tests/core/test_cpu.py",
        "engine_tests/core/test_quantize.py",
        "engine_tests/core/test_int4.py",
        "engine_tests/cosyvoice1/test_flow_int8.py",
        "engine_tests/core/test_prepared.py",
        "engine_tests/core/test_hift.py",
    ),
    # CosyVoice3's quantised formats as this CPU runs them (its fallbacks) and its int8 LM and flow
    # against float32.
    (
        "engine_tests/cosyvoice3/test_cosyvoice3_engine.py"
        "::test_every_quantised_format_loads_as_this_cpu_runs_it_and_speaks",
        "engine_tests/cosyvoice3/test_cosyvoice3_engine.py"
        "::test_the_int8_models_load_from_their_prepared_files_and_speak",
        "engine_tests/cosyvoice3/test_cosyvoice3_lm.py::test_int8_lm_stays_close",
        "engine_tests/cosyvoice3/test_cosyvoice3_lm.py::test_int8_load_option",
        "engine_tests/cosyvoice3/test_cosyvoice3_flow.py"
        "::test_int8_flow_swaps_the_dit_linears_and_stays_close",
    ),
    # Pronunciations: how entries read, and v3's phone and pinyin tokens reaching its LM.
    (
        "engine_tests/text/test_pronunciations.py",
        "engine_tests/cosyvoice3/test_cosyvoice3_pronunciations.py",
    ),
    # Every comparison with the official reference data, within the tolerances its spread sets.
    ("-m", "parity", *parity_files()),
)
MANY_THREADS = 4  # a Raspberry Pi's cores
TOKENS = 60  # speech tokens per sentence (the tiny model's weights are random): two chunks
SERVER_START_S = 900  # load and warm-up under emulation

# A product of matrices large enough that the BLAS splits it between threads.
MATMUL = """
import torch
with torch.inference_mode():
    torch.nn.Conv1d(64, 64, 3)(torch.randn(1, 64, 4096))
    a = torch.randn(1024, 1024)
    a @ a
print(torch.get_num_threads())
"""
UNGUARDED = f"import torch\ntorch.set_num_threads({MANY_THREADS})\n{MATMUL}"
AFTER_LOAD = f"""
from engine.cosyvoice1.engine import CosyVoiceEngine
CosyVoiceEngine.load({str(TINY)!r}, threads={MANY_THREADS}, cache_dir={{cache!r}})
{MATMUL}"""


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def fail(message: str) -> None:
    print(f"FAILED: {message}", flush=True)
    sys.exit(1)


def child(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a SIGILL there must not end this process)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def exit_text(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


def check_cpu(expect_ceiling: int | None) -> None:
    from engine.core import cpu

    step("CPU")
    features = cpu.arm_features(cpu.read_cpuinfo())
    print(
        f"machine {platform.machine()}, torch {torch.__version__}, cores {os.cpu_count()}, "
        f"atomics in /proc/cpuinfo: {features is not None and 'atomics' in features}"
    )
    print(
        f"torch's default int8 engine: {torch.backends.quantized.engine}, "
        f"supported: {torch.backends.quantized.supported_engines}"
    )
    choices = cpu.detect()
    print(f"engine picks: {choices.describe()}")
    from engine.core.int4 import choose_int4_kernel, int4_fast_here

    kleidiai = getattr(torch.backends, "kleidiai", None)
    print(
        f"int4 kernel: {choose_int4_kernel()}, faster than int8 here: {int4_fast_here()} "
        f"(torch built with KleidiAI: {kleidiai is not None and kleidiai.is_available()})"
    )
    if choices.int8_kernels != "qnnpack":
        fail(f"expected the qnnpack int8 kernels, got {choices.int8_kernels}")
    if choices.thread_ceiling != expect_ceiling:
        fail(f"expected thread ceiling {expect_ceiling}, got {choices.thread_ceiling}")


def check_threads(expect_ceiling: int | None, cache: Path) -> None:
    step(f"a matrix product on {MANY_THREADS} threads")
    unguarded = child(UNGUARDED)
    print(
        f"without the engine (torch.set_num_threads({MANY_THREADS})): "
        f"{exit_text(unguarded.returncode)}"
    )
    if (unguarded.returncode == 0) != (expect_ceiling is None):
        fail("torch on many threads survives here exactly when there is no thread ceiling")
    guarded = child(AFTER_LOAD.format(cache=str(cache)))
    if guarded.returncode != 0:
        fail(
            f"after CosyVoiceEngine.load(threads={MANY_THREADS}): "
            f"{exit_text(guarded.returncode)}\n{guarded.stderr[-2000:]}"
        )
    threads = int(guarded.stdout.split()[-1])
    print(f"after CosyVoiceEngine.load(threads={MANY_THREADS}): ran on {threads} thread(s)")
    if threads != min(MANY_THREADS, expect_ceiling or MANY_THREADS):
        fail(f"ran on {threads} threads")


def expected_lm(lm_weights: str) -> str:
    """The LM format a profile's ``lm_weights`` loads in here: int4 only where its kernel is fast,
    else int8, as the engine falls back (engine.core.runtime)."""
    from engine.core.runtime import int4_kernel_for_lm

    return "int8" if lm_weights == "int4" and not int4_kernel_for_lm() else lm_weights


def check_profiles(
    family: str, model_dir: Path, cache: Path, voice: CustomVoice | None = None
) -> None:
    """Load ``model_dir`` in each profile's weight formats, as the server does (the LM int4 or
    int8, the flow and HiFT formats; the int8 caches are written by the first loads and read by
    the later ones), and speak a sentence in the profile: finite, non-silent audio, in more than
    one chunk where the profile streams and its first hop is shorter than the answer, the LM in
    the format this CPU runs."""
    from engine.family import load_engine
    from wyoming_cosyvoice.config import load_config

    config = load_config(CONFIG)
    for name, profile in config.profiles.items():
        step(f"{family}: profile {name}")
        start = time.perf_counter()
        engine = load_engine(
            model_dir,
            lm_int8=profile.lm_weights == "int8",
            lm_int4=profile.lm_weights == "int4",
            flow_int8=profile.flow_weights == "int8",
            hift_bf16=profile.hift_weights == "bf16",
            hift_int8=profile.hift_weights == "int8",
            cache_dir=cache,
        )
        loaded = time.perf_counter() - start
        if voice is not None:
            engine.add_voice(voice)
        speaker = voice.name if voice is not None else None
        options = profile.options(speaker=speaker, seed=0, instruct=None, force_tokens=TOKENS)
        start = time.perf_counter()
        chunks = [c.samples for c in engine.synthesize("Hello there. 你好。", options)]
        audio = torch.from_numpy(np.concatenate(chunks)) if chunks else torch.zeros(0)
        formats = {part: names[0] for part, names in engine.weight_formats.items()}
        print(
            f"load {loaded:.1f} s (prepared first: {', '.join(engine.prepared_at_load) or 'none'}; "
            f"formats {formats}, HiFT {engine.hift_dtype}); {len(chunks)} chunks, "
            f"{audio.numel() / engine.sample_rate:.2f} s of audio in "
            f"{time.perf_counter() - start:.1f} s"
        )
        if audio.numel() == 0 or not torch.isfinite(audio).all() or audio.abs().max() == 0:
            fail(f"{family}, profile {name}: no usable audio")
        if profile.stream_audio and profile.schedule.first_hop < TOKENS and len(chunks) < 2:
            fail(f"{family}, profile {name}: the audio was not streamed ({len(chunks)} chunk)")
        if formats["llm"] != expected_lm(profile.lm_weights):
            fail(
                f"{family}, profile {name}: the LM runs {formats['llm']}, expected "
                f"{expected_lm(profile.lm_weights)} for lm_weights {profile.lm_weights}"
            )


def v3_voice() -> CustomVoice:
    """The official v3 prompt voice stored with the engine cases (the tiny model has no speakers;
    the server makes its voices from recordings)."""
    from engine.prompt.extract import PromptFeatures
    from engine.prompt.voices import CustomVoice

    cases = torch.load(V3_DATA / "engine_cases.pt", weights_only=True)
    features = PromptFeatures(
        cases[f"{V3_VOICE}/embedding"],
        cases[f"{V3_VOICE}/prompt_tokens"].to(torch.int32),
        cases[f"{V3_VOICE}/prompt_feat"],
    )
    return CustomVoice(V3_VOICE, "Hello there.", "en", features, 1.0, family="cosyvoice3")


def check_cosyvoice3_profiles(tmp: Path, cache: Path) -> None:
    """Fun-CosyVoice3 (tiny model, a copy without prepared files) in every profile."""
    from engine.core.prepared import PREPARED_DIR

    model_dir = tmp / V3_MODEL
    shutil.copytree(TINY_V3, model_dir, ignore=shutil.ignore_patterns(PREPARED_DIR))
    check_profiles("Fun-CosyVoice3", model_dir, cache, voice=v3_voice())


def report_deviations(cache: Path) -> None:
    from engine.bench.deviation import lm_int8_kl, mel_relative_l2
    from engine.core.quantize import quantize_flow_int8
    from engine.cosyvoice1.engine import CosyVoiceEngine
    from engine.cosyvoice1.model_dir import load_model_dir

    step("int8 deviations on this CPU's kernels (tiny model, random weights)")
    # The load applies the int8 kernels the engine picks.
    engine = CosyVoiceEngine.load(TINY, cache_dir=cache)
    fp32 = load_model_dir(TINY)
    embedding = fp32.speakers[engine.speakers[0]].reshape(1, -1)
    text_ids = engine.frontend.segments("Hello there, this is a test.")[0].token_ids
    kl = lm_int8_kl(fp32.llm, text_ids, embedding)
    int8_flow = quantize_flow_int8(load_model_dir(TINY).flow)
    mel = mel_relative_l2(int8_flow, embedding, n_timesteps=10, cfg_rate=0.7, exact_flow=fp32.flow)
    print(
        f"kernels {torch.backends.quantized.engine}: LM next-token KL(fp32 || int8) mean "
        f"{kl['lm_int8_kl_mean']:.3g}, max {kl['lm_int8_kl_max']:.3g} nats; int8 flow mel "
        f"relative L2 {mel:.4f}"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, server: subprocess.Popen[str]) -> dict:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            fail(
                f"the server ended ({exit_text(server.returncode)}):\n"
                f"{server.communicate()[1][-3000:]}"
            )
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return json.loads(answer.read())
        except OSError:  # not listening yet, or 503 while loading
            time.sleep(2)
    fail(f"the server was not ready within {SERVER_START_S} s")
    raise AssertionError


async def describe_and_stream(port: int) -> tuple[dict, int, list[str]]:
    from wyoming.client import AsyncTcpClient
    from wyoming.event import Event

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Event("describe"))
        info = await asyncio.wait_for(client.read_event(), 60)
    text = "Hello from an Arm CPU. 你好。"
    types: list[str] = []
    samples = 0
    async with AsyncTcpClient("127.0.0.1", port) as client:  # Home Assistant's streaming order
        await client.write_event(Event("synthesize-start", {}))
        for i in range(0, len(text), 5):
            await client.write_event(Event("synthesize-chunk", {"text": text[i : i + 5]}))
        await client.write_event(Event("synthesize", {"text": text}))
        await client.write_event(Event("synthesize-stop"))
        while True:
            event = await asyncio.wait_for(client.read_event(), 600)
            if event is None:
                break
            types.append(event.type)
            if event.type == "audio-chunk":
                samples += len(event.payload or b"") // 2
            if event.type in ("synthesize-stopped", "error"):
                break
    return info.data if info else {}, samples, types


def check_server() -> None:
    step("server: the add-on's defaults (all cores, auto, warm-up), /health, describe, stream")
    port, http_port = free_port(), free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wyoming_cosyvoice.bench.server",  # the server's command line plus --force-tokens
            "--config",
            str(CONFIG),
            "--model-dir",
            str(TINY),
            "--uri",
            f"tcp://127.0.0.1:{port}",
            "--http-port",
            str(http_port),
            "--http-host",
            "127.0.0.1",
            "--force-tokens",
            str(TOKENS),
            "--offline",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        health = wait_healthy(f"http://127.0.0.1:{http_port}/health", server)
        print(f"/health: {json.dumps(health)}")
        info, samples, types = asyncio.run(describe_and_stream(port))
        tts = info.get("tts") or [{}]
        print(
            f"describe: {tts[0].get('name')}, {len(tts[0].get('voices') or [])} voices, "
            f"streaming {tts[0].get('supports_synthesize_streaming')}"
        )
        print(
            f"stream: {types.count('audio-chunk')} audio chunks, {samples / 22050:.2f} s, "
            f"ends with {types[-1] if types else 'nothing'}"
        )
        if health.get("status") != "ready" or "cpu" not in health:
            fail("/health does not show a ready engine and its CPU choices")
        if not tts[0].get("voices"):
            fail("describe did not list the voices")
        if samples == 0 or types[-1:] != ["synthesize-stopped"]:
            fail(f"the streaming request did not end with audio: {types}")
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            _, err = server.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
            _, err = server.communicate()
    logged = [line for line in err.splitlines() if " INFO " in line or " WARNING " in line]
    print("server log:\n  " + "\n  ".join(line for line in logged if "uvicorn.access" not in line))
    if server.returncode not in (0, -signal.SIGTERM) or "Traceback" in err:
        fail(f"the server ended badly ({exit_text(server.returncode)}):\n{err[-3000:]}")


def run_tests() -> None:
    for arguments in PYTEST_RUNS:
        step(f"pytest {' '.join(arguments)}")
        # -P: the installed package is tested, not the copy beside the tests.
        done = subprocess.run(
            [
                sys.executable,
                "-P",
                "-m",
                "pytest",
                "-v",
                "-p",
                "no:cacheprovider",
                "-o",
                "timeout=3600",
                *arguments,
            ],
            cwd=SRC / "tests",
            check=False,
        )
        if done.returncode != 0:
            fail(f"pytest {' '.join(arguments)}: {exit_text(done.returncode)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--expect-thread-ceiling", type=int, default=None)
    args = parser.parse_args()
    from engine.core import cpu

    # As the engine's load does, before any torch op: this process's own threads within the
    # ceiling (the runs on more threads are made in child processes).
    threads = cpu.capped_threads(None, cpu.thread_ceiling())
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "int8"
        check_cpu(args.expect_thread_ceiling)
        check_threads(args.expect_thread_ceiling, cache)
        check_profiles("CosyVoice1", TINY, cache)
        report_deviations(cache)
        check_cosyvoice3_profiles(Path(tmp), cache)
    check_server()
    run_tests()
    print("\nsmoke test passed", flush=True)


if __name__ == "__main__":
    main()
