"""The server as users run it, in a process of its own, on the tiny models of both families.

``python -m wyoming_cosyvoice.bench.server`` is the server's command line with a fixed number of
speech tokens per sentence (random weights never end a sentence by themselves). Each model is
copied with the tiny stand-ins of its prompt models, so a voices folder works: voices recorded
into it are analysed and spoken by the real engine. The CosyVoice2 model speaks in the engine
benchmark's synthetic voice (its built-in voices would be made from another model).

Everything is on 127.0.0.1; waits are bounded polls of the server's own answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from conftest import FAMILIES, ROOT, free_port  # noqa: F401  (FAMILIES: for the test modules)

DATA = ROOT / "tests" / "data"
ONNX = DATA / "zero_shot" / "onnx"
PROMPT_16K = DATA / "zero_shot" / "prompt16k_pcm16.wav"
# family -> (the tiny model, the prompt models' stand-ins: file in ONNX -> name in the model)
MODELS = {
    "v1": (DATA / "tiny_model", {"tiny_campplus.onnx": "campplus.onnx",
                                 "tiny_speech_tokenizer_v1.onnx": "speech_tokenizer_v1.onnx"}),
    "v2": (DATA / "cosyvoice2" / "tiny", {"tiny_campplus.onnx": "campplus.onnx",
                                          "tiny_speech_tokenizer_v2.onnx":
                                          "speech_tokenizer_v2.onnx"}),
    "v3": (DATA / "cosyvoice3" / "tiny", {}),  # no prompt models: it speaks the synthetic voice
}  # fmt: skip
MODEL_NAMES = {"v1": "tiny_model", "v2": "CosyVoice2-0.5B", "v3": "Fun-CosyVoice3-0.5B"}
SYNTHETIC = "synthetic"  # the CosyVoice2 and 3 servers' built-in voice
WAIT_S = 180.0  # bounds every wait: a busy machine is slow, a broken server never answers


def model_copy(family: str, into: Path) -> Path:
    """The family's tiny model with its prompt models, in ``into`` (v1: the SFT kind)."""
    source, onnx = MODELS[family]
    model = into / MODEL_NAMES[family]
    shutil.copytree(source, model)
    for name, target in onnx.items():
        shutil.copy(ONNX / name, model / target)
    return model


def record_voice(folder: Path, name: str, transcript: str = "希望你以后能够做的比我还好呦。"
                 ) -> None:  # fmt: skip
    """A 5 s recording (the 2.5 s test prompt, twice) and its transcript, as users drop in."""
    folder.mkdir(parents=True, exist_ok=True)
    with wave.open(str(PROMPT_16K), "rb") as recording:
        pcm, params = recording.readframes(recording.getnframes()), recording.getparams()
    with wave.open(str(folder / f"{name}.wav"), "wb") as doubled:
        doubled.setparams(params)
        doubled.writeframes(pcm + pcm)
    (folder / f"{name}.txt").write_text(transcript, encoding="utf-8")


class ServerProcess:
    """One server process: Wyoming and HTTP on free loopback ports, its log in a file."""

    def __init__(self, family: str, workdir: Path, *, tokens: int = 40,
                 voices: Path | None = None, args: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.family = family
        self.port, self.http_port = free_port(), free_port()
        workdir.mkdir(parents=True, exist_ok=True)
        model = model_copy(family, workdir)
        self.log_path = workdir / "server.log"
        command = [
            sys.executable, "-m", "wyoming_cosyvoice.bench.server", "--force-tokens", str(tokens),
            "--uri", f"tcp://127.0.0.1:{self.port}", "--http-port", str(self.http_port),
            "--http-host", "127.0.0.1", "--model-dir", str(model), "--threads", "1",
            "--no-warmup", "--seed", "0", "--offline", *args,
        ]  # fmt: skip
        if family != "v1":  # CosyVoice2 and 3 ship no voices
            command += ["--synthetic-voice", "Hello there."]
        if voices is not None:
            command += ["--voices-dir", str(voices), "--web-voice-maker"]
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log,
                env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
            )  # fmt: skip
        self.url = f"http://127.0.0.1:{self.http_port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def client(self, timeout: float = WAIT_S) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def _poll(self, ready: Any, what: str) -> Any:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"server exited with {self.process.returncode}:\n"
                                     f"{self.log[-3000:]}")  # fmt: skip
            try:
                if (found := ready()) is not None:
                    return found
            except (httpx.HTTPError, OSError):
                pass
            time.sleep(0.1)
        raise AssertionError(f"{what} within {WAIT_S} s:\n{self.log[-3000:]}")

    def wait_ready(self) -> ServerProcess:
        def ready() -> bool | None:
            return httpx.get(f"{self.url}/health", timeout=5).json()["status"] == "ready" or None

        self._poll(ready, "the model was not ready")
        return self

    def wait_for_voice(self, name: str) -> dict[str, Any]:
        def offered() -> dict[str, Any] | None:
            voices = httpx.get(f"{self.url}/voices", timeout=5).json()["voices"]
            return next((v for v in voices if v["name"] == name), None)

        return dict(self._poll(offered, f"voice {name!r} was not offered"))

    def health(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.url}/health", timeout=10).json())

    def wait_until(self, condition: Any, what: str) -> None:
        self._poll(lambda: True if condition() else None, what)

    def stop(self) -> int:
        """SIGTERM, as the Supervisor stops an add-on; the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return int(self.process.returncode)


# The shared server of each family (conftest's ``family_server``): its voices folder holds a
# voice named in Chinese, one named in Latin letters and a look-alike of that name dropped in by
# hand beside it; its default voice is named by another look-alike (full-width letters), found
# before the folder is scanned.
CHINESE_NAME = "奶奶"  # a voice name no Latin-1 header can carry
LATIN_NAME = "grandma"
LOOK_ALIKE = "grаndma"  # the a is U+0430
FULL_WIDTH = "ｇｒａｎｄｍａ"


@contextlib.contextmanager
def shared_server(family: str, workdir: Path) -> Iterator[ServerProcess]:
    """The server of ``family`` for the tests that only ask it things, ready with its voices;
    stopped by SIGTERM at the end, which it must survive cleanly. One profile, and audio as the
    engine makes it (no loudness learnt, no replays): the same request gives the same samples
    over HTTP and Wyoming."""
    voices = workdir / "voices"
    record_voice(voices, CHINESE_NAME)
    record_voice(voices, LATIN_NAME)
    record_voice(voices, LOOK_ALIKE)
    args = ("--profile", "realtime", "--voice", FULL_WIDTH,
            "--set", "server.loudness=null", "--set", "cache.max_mb=0")  # fmt: skip
    srv = ServerProcess(family, workdir, voices=voices, args=args)
    try:
        srv.wait_ready().wait_for_voice(CHINESE_NAME)
        srv.wait_for_voice(LATIN_NAME)
        yield srv
    finally:
        code = srv.stop()
    assert code == 0, srv.log[-3000:]
    assert "Traceback" not in srv.log and " ERROR " not in srv.log, srv.log[-3000:]


def raw_post(port: int, path: str, body: bytes, headers: dict[str, str]) -> bytes:
    """One HTTP/1.1 POST over a plain socket with exactly these headers; the raw answer."""
    lines = [f"POST {path} HTTP/1.1", f"Content-Length: {len(body)}", "Connection: close",
             *(f"{k}: {v}" for k, v in headers.items())]  # fmt: skip
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer
