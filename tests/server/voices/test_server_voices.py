"""Custom voices through the real server: folder → describe → synthesis → cache.

Two server processes on tests/data/tiny_model with the tiny stand-in ONNX prompt models:

* server A (the SFT kind, prompt models present): a good voice is extracted and offered under all
  five languages (its transcript's first), bad recordings are skipped with their reason in the
  log, a voice dropped in while it runs appears after a re-scan, all of them speak over TCP;
* server B (a restart, as the -Instruct kind, prompt models deleted, ``--offline``): the voices
  come from their ``NAME.prompt.pt`` caches, untouched, and the time saved against the first
  extraction is reported; a new voice that would need the missing models is skipped with a
  clear message while everything else keeps working; ``voice.speaker`` carries an instruction.

The tiny model has random weights: these tests check plumbing, not sound.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, terminate
from wyoming.info import Describe, Info

from engine.family import DESCRIBED_SPEAKER
from wyoming_cosyvoice.custom_voices.folder import folder_fingerprint
from wyoming_cosyvoice.errors import LimitExceededError
from wyoming_cosyvoice.pipeline.speech import split_instruction
from wyoming_cosyvoice.voices.catalog import ALL_LANGUAGES, VoiceCatalog

DATA = ROOT / "tests" / "data"
ONNX = DATA / "zero_shot" / "onnx"
FORCE_TOKENS = 10  # 0.2 s of audio per sentence: plumbing, not sound
RESCAN_S = 0.3


# --- recordings ------------------------------------------------------------------------------


def voiced(seconds: float, rate: int, f0: float = 140.0) -> np.ndarray:
    """A syllable-modulated harmonic signal: passes the engine's length and loudness checks."""
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(f0 + 20 * np.sin(2 * np.pi * 0.7 * t)) / rate
    x = sum(0.2 / h * np.sin(h * phase) for h in range(1, 12))
    x = x * (0.55 + 0.45 * np.sin(2 * np.pi * 3.1 * t))
    return 0.7 * x / np.abs(x).max()


def write_wav(path: Path, samples: np.ndarray, rate: int) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(np.round(samples * 32767).astype("<i2").tobytes())


def add_voice(folder: Path, name: str, transcript: str | None, seconds: float = 4.0,
              rate: int = 24000, f0: float = 140.0) -> None:  # fmt: skip
    write_wav(folder / f"{name}.wav", voiced(seconds, rate, f0), rate)
    if transcript is not None:
        (folder / f"{name}.txt").write_text(transcript, encoding="utf-8")


# --- server processes and client -------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Server:
    """``python -m wyoming_cosyvoice`` in a subprocess, its log in a file."""

    def __init__(self, model_dir: Path, voices_dir: Path, log: Path) -> None:
        self.port, self.log_path = free_port(), log
        self._log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "wyoming_cosyvoice.bench.server", "--uri", f"tcp://127.0.0.1:{self.port}",
             "--model-dir", str(model_dir), "--voices-dir", str(voices_dir), "--offline",
             "--threads", "1", "--seed", "0", "--no-warmup", "--force-tokens", str(FORCE_TOKENS),
             "--set", f"server.voices_rescan_s={RESCAN_S}"],
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
            stdout=subprocess.DEVNULL, stderr=self._log, text=True,
        )  # fmt: skip

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> str:
        terminate(self.process, timeout=20)
        self._log.close()
        log = self.log
        assert self.process.returncode == 0, log[-3000:]
        assert "Traceback" not in log, log[-3000:]
        return log


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def describe(port: int) -> dict[str, Any]:
    from wyoming.client import AsyncTcpClient

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        while not Info.is_type((event := await asyncio.wait_for(client.read_event(), 5)).type):
            pass
    return {v.name: v for v in Info.from_event(event).tts[0].voices}


async def wait_for_voices(server: Server, wanted: set[str], timeout: float = 45) -> dict:
    """Describe until every name in ``wanted`` is offered (the server listens before loading)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise AssertionError(f"server exited:\n{server.log[-3000:]}")
        try:
            voices = await describe(server.port)
            if wanted <= voices.keys():
                return voices
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError(f"{wanted} not offered in {timeout} s:\n{server.log[-3000:]}")


def seconds_in_log(log: str, pattern: str) -> float:
    match = re.search(pattern, log)
    assert match, f"{pattern!r} not in the log:\n{log[-3000:]}"
    return float(match.group(1))


# --- the scenario --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    tmp = tmp_path_factory.mktemp("voices")
    model = tmp / "tiny_model"  # the SFT kind (the directory name decides)
    shutil.copytree(DATA / "tiny_model", model)
    shutil.copy(ONNX / "tiny_campplus.onnx", model / "campplus.onnx")
    shutil.copy(ONNX / "tiny_speech_tokenizer_v1.onnx", model / "speech_tokenizer_v1.onnx")
    voices = tmp / "share" / "voices"
    voices.mkdir(parents=True)
    add_voice(voices, "anna", "Hello, this is my voice for the kitchen speaker.")
    add_voice(voices, "short", "Too short to be a voice.", seconds=2.0)
    write_wav(voices / "silent.wav", np.zeros(4 * 16000), 16000)
    (voices / "silent.txt").write_text("Nothing to hear.")
    add_voice(voices, "untold", None)  # no transcript
    yield SimpleNamespace(tmp=tmp, model=model, voices=voices)


@pytest.fixture(scope="module")
def first_run(setup: SimpleNamespace) -> Iterator[SimpleNamespace]:
    server = Server(setup.model, setup.voices, setup.tmp / "a.log")
    try:
        offered = run(wait_for_voices(server, {"anna", "zh-female"}))
        yield SimpleNamespace(server=server, offered=offered, voices=setup.voices)
    finally:
        if server.process.poll() is None:
            server.stop()


def test_good_voice_offered_bad_ones_skipped_with_reason(first_run: SimpleNamespace) -> None:
    anna = first_run.offered["anna"]
    assert anna.installed and "custom voice" in anna.description
    assert anna.languages[0] == "en_US" and sorted(anna.languages) == sorted(ALL_LANGUAGES)
    assert {"en-male", "zh-female", "anna"} == first_run.offered.keys()  # no bad voice
    log = first_run.server.log
    assert "Custom voice 'short' skipped: recording is 2.0 s long" in log
    assert "Custom voice 'silent' skipped: the recording is silent" in log
    assert "Custom voice 'untold' skipped: transcript untold.txt is missing" in log
    assert (first_run.voices / "anna.prompt.pt").is_file()


def test_custom_voice_speaks_over_tcp(first_run: SimpleNamespace, wy: SimpleNamespace) -> None:
    async def main() -> list:
        port = first_run.server.port
        return [
            await wy.synthesize(port, "Good morning, how are you?", {"name": "anna"}),
            await wy.synthesize(port, "早上好。", {"name": "Anna"}),  # cross-lingual, any case
            await wy.stream(port, "One more. And another one!", voice={"name": "anna"}),
            await wy.synthesize(port, "你好。", {"name": "zh-female"}),  # built-ins still work
        ]

    for reply in run(main()):
        assert "error" not in reply.types, reply.error()
        assert reply.samples > 0 and reply.types[-1] in ("audio-stop", "synthesize-stopped")
    assert "Spoke" in first_run.server.log and "(anna)" in first_run.server.log


def test_speaker_is_no_instruction_without_the_instruct_model(
    first_run: SimpleNamespace, wy: SimpleNamespace
) -> None:
    reply = run(wy.synthesize(first_run.server.port, "Hi.", {"name": "anna", "speaker": "Calm."}))
    assert reply.error().code == "VoiceNotFoundError"


def test_voice_dropped_in_later_appears_after_a_rescan(first_run: SimpleNamespace,
                                                      wy: SimpleNamespace) -> None:  # fmt: skip
    # Written under a dot name and renamed: a copy in progress is never half-read.
    add_voice(first_run.voices, ".bert", "你好，这是我的声音，请多多指教。", rate=16000, f0=110)
    os.replace(first_run.voices / ".bert.wav", first_run.voices / "bert.wav")
    os.replace(first_run.voices / ".bert.txt", first_run.voices / "bert.txt")
    offered = run(wait_for_voices(first_run.server, {"bert"}, timeout=60))  # RESCAN_S apart
    assert offered["bert"].languages[0] == "zh_CN" and "anna" in offered
    reply = run(wy.synthesize(first_run.server.port, "你好。", {"name": "bert"}))
    assert "error" not in reply.types and reply.samples > 0


@pytest.mark.long
def test_restart_uses_the_cache_and_survives_missing_prompt_models(
    setup: SimpleNamespace, first_run: SimpleNamespace, wy: SimpleNamespace, capsys: Any
) -> None:
    first_log = first_run.server.stop()
    extracted = seconds_in_log(first_log, r"'anna': prompt extracted in ([\d.]+) s")
    cache = setup.voices / "anna.prompt.pt"
    cache_stamp = cache.stat().st_mtime_ns
    # The restart: the -Instruct kind (by its name), without the ONNX models, and a new voice
    # that would need them.
    model = setup.tmp / "CosyVoice-300M-Instruct"
    model.mkdir()
    for path in setup.model.iterdir():
        if path.suffix != ".onnx":
            (model / path.name).symlink_to(path)
    add_voice(setup.voices, "carl", "A new voice that nobody has analysed yet.", f0=180)
    server = Server(model, setup.voices, setup.tmp / "b.log")
    try:
        bert = {"bert"} if (setup.voices / "bert.wav").exists() else set()  # (run alone: none)
        offered = run(wait_for_voices(server, {"anna", *bert}))
        log = server.log
        assert "carl" not in offered and {"short", "silent", "untold"}.isdisjoint(offered)
        assert "Custom voice 'carl' skipped: custom voices need" in log
        assert "Custom voice(s) carl cannot be used yet" in log and "offline" in log
        cached = seconds_in_log(log, r"'anna' ready: .* prompt from anna\.prompt\.pt in ([\d.]+) s")
        assert cache.stat().st_mtime_ns == cache_stamp  # read, not rewritten

        async def main() -> list:
            port = server.port
            return [
                await wy.synthesize(port, "Hello again.", {"name": "anna"}),
                # -Instruct: a speaker that names no voice is the request's instruction
                await wy.synthesize(port, "Hello.", {"name": "anna", "speaker": "Speak slowly."}),
                await wy.synthesize(port, "你好。", {"name": "zh-female", "speaker": "开心地说"}),
            ]

        for reply in run(main()):
            assert "error" not in reply.types, reply.error()
            assert reply.samples > 0
    finally:
        server.stop()
    with capsys.disabled():
        sys.stdout.write(
            f"\n[custom voice prompt] extracted in {extracted:.3f} s, from the cache in "
            f"{cached:.3f} s: {extracted - cached:.3f} s saved per voice and start "
            f"(tiny stand-in ONNX models)\n"
        )  # a figure to read, not a timed assertion: the cache's use is the log line and mtime


# --- the helpers, without a server -----------------------------------------------------------


def test_speaker_field_as_instruction() -> None:
    catalog = VoiceCatalog(["中文女"], [("anna", "en")])
    voice = {"name": "anna", "speaker": "  Speak   slowly. "}
    assert split_instruction(voice, catalog, DESCRIBED_SPEAKER) == (
        {"name": "anna"},
        "Speak slowly.",
    )
    named = {"name": "anna", "speaker": "zh-female"}  # a voice: keeps its old meaning
    assert split_instruction(named, catalog, DESCRIBED_SPEAKER) == (named, None)
    assert split_instruction(voice, catalog, None) == (voice, None)
    assert split_instruction(None, catalog, DESCRIBED_SPEAKER) == ({}, None)
    with pytest.raises(LimitExceededError):
        split_instruction({"speaker": "x" * 1001}, catalog, DESCRIBED_SPEAKER)


def test_catalog_keeps_builtins_first_and_refuses_taken_names() -> None:
    catalog = VoiceCatalog(
        ["中文女", "英文男"], [("anna", "en"), ("ZH-female", "zh"), ("奶奶", "zh")]
    )
    assert catalog.names == ["en-male", "zh-female", "anna", "奶奶"]
    assert "ZH-female" in catalog.skipped
    assert catalog.for_language("zh_CN").name == "zh-female"  # the default stays built-in
    assert catalog.for_language("ko").name == "anna"  # a custom voice speaks it cross-lingually
    assert catalog.find("奶奶").languages[0] == "zh_CN"
    only_custom = VoiceCatalog([], [("anna", "en"), ("bert", "zh")])
    assert only_custom.for_language("zh").name == "bert"  # its own language first


def test_fingerprint_ignores_caches_and_dot_files(tmp_path: Path) -> None:
    add_voice(tmp_path, "anna", "Hello there, this is me.")
    before = folder_fingerprint(tmp_path, tmp_path)
    (tmp_path / "anna.prompt.pt").write_bytes(b"cache")
    (tmp_path / ".anna.prompt.pt.1.tmp").write_bytes(b"tmp")
    assert folder_fingerprint(tmp_path, tmp_path) == before
    (tmp_path / "anna.txt").write_text("Hello there, this is me again.")
    assert folder_fingerprint(tmp_path, tmp_path) != before
    assert folder_fingerprint(tmp_path / "missing", tmp_path) is None
