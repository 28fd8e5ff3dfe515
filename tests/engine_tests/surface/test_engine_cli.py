"""`python -m engine synthesize` / `frontend`: a real WAV from the tiny model, clear failures."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
import wave
from pathlib import Path

import pytest
from conftest import DATA

from engine import __main__ as cli
from engine.__main__ import build_parser, main
from engine.core.types import SynthesisOptions
from wyoming_cosyvoice.config import load_config


@pytest.mark.parametrize("stream", [False, True])
def test_synthesize_writes_a_wav(
    tmp_path: Path, stream: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    # Random weights never end an utterance: 60 speech tokens make the length exact.
    monkeypatch.setattr(
        cli, "SynthesisOptions", functools.partial(SynthesisOptions, force_tokens=60)
    )
    out = tmp_path / "out.wav"
    argv = [
        "synthesize",
        "--model-dir",
        str(DATA / "tiny_model"),
        "--speaker",
        "英文男",
        "--text",
        "Hello world.",
        "--out",
        str(out),
        "--seed",
        "1",
    ]
    assert main(argv + (["--stream"] if stream else [])) == 0
    with wave.open(str(out)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 22050)
        frames = wav.getnframes()
    assert frames == 103 * 256  # 60 tokens → floor(60·22050/256/50) = 103 mel frames
    if stream:
        assert "chunk 0 ready after" in caplog.text


def test_lm_weights_default_as_the_server() -> None:
    args = build_parser().parse_args(
        ["synthesize", "--model-dir", ".", "--text", "x", "--out", "o"]
    )
    assert args.lm_weights == load_config(None).load.weights.lm == "int8"


def test_bad_model_dir_is_a_clear_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    argv = [
        "synthesize",
        "--model-dir",
        str(tmp_path),
        "--text",
        "hi",
        "--out",
        str(tmp_path / "x.wav"),
    ]
    assert main(argv) == 2
    assert "incomplete: missing cosyvoice.yaml" in caplog.text
    assert not (tmp_path / "x.wav").exists()


def test_frontend_json() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "engine", "frontend", "明天早上7:30提醒我", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    segments = json.loads(result.stdout)["segments"]
    assert segments and all(seg["token_ids"] for seg in segments)
    assert "7" not in "".join(seg["text"] for seg in segments)  # the time is spoken in words


@pytest.mark.parametrize(
    "argv",
    [
        ["frontend", "--json", "你好"],
        ["frontend", "你好", "--json"],
        ["frontend", "--language-tags", "你好", "--json"],
    ],
)
def test_frontend_options_go_before_or_after_the_text(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 0
    segments = json.loads(capsys.readouterr().out)["segments"]
    assert segments and all(seg["token_ids"] for seg in segments)
