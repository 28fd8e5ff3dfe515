"""The real server on a tiny model of a family whose models ship no speakers (CosyVoice2,
CosyVoice3), in a thread of the test process: the real loader, Wyoming and HTTP, the voices
folder as the command serves it.

Its data dir holds the tiny model with tiny ONNX stand-ins of its prompt models and maybe the
tiny v1-SFT model, from whose speakers the first start makes the built-in voices. Random weights
never end a sentence by themselves, so every request makes ``TOKENS`` speech tokens and the audio
length is known exactly. :class:`LmInputs` records what the engine's LM is asked for, so
instructions and inline tags are checked where they take effect.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import DATA, wait_until
from test_http import BackgroundServer

from engine.core.types import SynthesisOptions

TINY_V1 = DATA / "tiny_model"
ONNX = DATA / "zero_shot" / "onnx"
TOKENS = 60  # speech tokens per sentence (25 a second)
SAMPLES = TOKENS * 2 * 480  # two mel frames a token, 480 samples a frame at 24 kHz
# How the tiny v1 model says each built-in voice's sentence: 4 s, cheap flow steps.
QUICK_V1 = SynthesisOptions(force_tokens=200, n_timesteps=2)


@dataclass(frozen=True)
class TinyFamily:
    """A family's tiny model and its official name; its speech tokenizer's stand-in is the tiny
    v2 one (v3's has the same inputs, outputs and 6561 codes)."""

    name: str  # the family's (engine.family)
    model: str
    source: Path
    tokenizer: str  # the speech tokenizer's file name in a model directory
    # Where the voices made from v1's speakers are kept, under the download directory (existing
    # installs have CosyVoice2's, so these names stay).
    builtin_voices: str


V2 = TinyFamily(
    "cosyvoice2",
    "CosyVoice2-0.5B",
    DATA / "cosyvoice2" / "tiny",
    "speech_tokenizer_v2.onnx",
    "CosyVoice2-voices-from-CosyVoice-300M-SFT",
)
V3 = TinyFamily(
    "cosyvoice3",
    "Fun-CosyVoice3-0.5B",
    DATA / "cosyvoice3" / "tiny",
    "speech_tokenizer_v3.onnx",
    "Fun-CosyVoice3-voices-from-CosyVoice-300M-SFT",
)


def data_dir(root: Path, family: TinyFamily, *, with_v1: bool) -> Path:
    """A data dir holding the family's tiny model (with its prompt models) and maybe the tiny
    v1-SFT model."""
    data = root / "data"
    ignore = shutil.ignore_patterns("prepared")
    shutil.copytree(family.source, data / family.model, ignore=ignore)
    shutil.copy(ONNX / "tiny_campplus.onnx", data / family.model / "campplus.onnx")
    shutil.copy(ONNX / "tiny_speech_tokenizer_v2.onnx", data / family.model / family.tokenizer)
    if with_v1:
        shutil.copytree(TINY_V1, data / "CosyVoice-300M-SFT", ignore=ignore)
    return data


def wait_for_voice(srv: BackgroundServer, name: str) -> None:
    """Until the voices folder's scan offers ``name`` (a bounded wait)."""
    catalog = lambda: srv.running.scheduler.catalog  # noqa: E731
    wait_until(lambda: catalog().find(name) is not None, f"voice {name!r} is offered")


class TinyServer(BackgroundServer):
    """The background server with the real loader on a data dir of :func:`data_dir`."""

    def __init__(self, data: Path, family: TinyFamily,
                 overrides: dict[str, Any] | None = None) -> None:  # fmt: skip
        settings = {"server.model": family.model, "server.data_dirs": [str(data)],
                    "server.offline": True, "server.threads": 1, "server.seed": 0}  # fmt: skip
        super().__init__({**settings, **(overrides or {})}, simple_splitter=False)

    async def _start(self) -> None:
        from wyoming_cosyvoice.config import load_config
        from wyoming_cosyvoice.custom_voices.folder import CustomVoices
        from wyoming_cosyvoice.http import start_http
        from wyoming_cosyvoice.models.model import resolve_model_dir
        from wyoming_cosyvoice.wyoming.server import create_server

        config = load_config(None, self.settings.items())
        self.config = dataclasses.replace(config, force_tokens=TOKENS)
        self.running = await create_server(self.config, resolve_model_dir(self.config))
        self.http = await start_http(self.config, self.running.scheduler, "127.0.0.1", 0)
        self.voices = None
        if self.config.voices_dir is not None:  # as the command starts it
            model_dir = self.running.scheduler.model_dir
            self.voices = CustomVoices(self.config, self.running.scheduler, model_dir).start()
        await asyncio.wait_for(asyncio.shield(self.running.load_task), 300)

    async def _stop(self) -> None:
        if self.voices is not None:
            await self.voices.stop()
        await super()._stop()


class LmInputs:
    """What the engine's LM is asked for, request by request (wraps its ``generate``)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.lock, self.calls = engine, threading.Lock(), []
        inner = engine.models.llm.generate

        def generate(text_ids: list[int], prompt_text_ids: list[int],
                     prompt_tokens: list[int], **kwargs: Any) -> Any:  # fmt: skip
            with self.lock:
                self.calls.append((list(text_ids), list(prompt_text_ids), list(prompt_tokens)))
            return inner(text_ids, prompt_text_ids, prompt_tokens, **kwargs)

        engine.models.llm.generate = generate

    def take(self) -> list[tuple[list[int], list[int], list[int]]]:
        with self.lock:
            calls, self.calls = self.calls, []
        return calls


class LogLines(logging.Handler):
    """The server's log lines at INFO and above, and the thread that logged each."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        self.threads: dict[str, str] = {}  # message -> the thread that logged it

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        self.threads[record.getMessage()] = record.threadName or ""

    def text(self) -> str:
        return "\n".join(self.lines)


@contextmanager
def server_log() -> Iterator[LogLines]:
    """The server's log (``wyoming_cosyvoice`` at INFO) while the block runs; the built-in
    voices are spoken in :data:`QUICK_V1`."""
    handler, logger = LogLines(), logging.getLogger("wyoming_cosyvoice")
    logger.addHandler(handler)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(logger, "level", logging.INFO)
            patch.setattr("wyoming_cosyvoice.models.builtin_voices.SPEAKING_OPTIONS", QUICK_V1)
            yield handler
    finally:
        logger.removeHandler(handler)
