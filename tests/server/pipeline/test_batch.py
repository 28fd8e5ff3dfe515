"""``synthesize`` command line: argument/file/stdin → WAV, ``--batch`` for long texts.

The 2,000-character run goes through a real subprocess (the command as a user types it) on the
tiny model, each segment fixed at a few speech tokens so it is short
(``tests/fixed_tokens_synthesize.py``); the rest calls ``main`` in-process.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import wave
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from wyoming_cosyvoice import synthesize as batch
from wyoming_cosyvoice.pipeline.sentences import split_text

TINY = ROOT / "tests" / "data" / "tiny_model"
CHAPTER = " ".join(
    f"Sentence number {i} of this chapter is read aloud, slowly and clearly, by the model."
    for i in range(40)
)[:2000]


def frames(path: Path | io.BytesIO) -> tuple[int, bytes]:
    with wave.open(path if isinstance(path, io.BytesIO) else str(path)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 22050)
        n = wav.getnframes()
        return n, wav.readframes(n)


def run_cli(
    *args: str, tmp_path: Path, tokens: int | None, timeout: float = 240
) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "wyoming_cosyvoice", "synthesize"]
    if tokens is not None:
        command = [sys.executable, str(ROOT / "tests" / "fixed_tokens_synthesize.py"), str(tokens)]
    return subprocess.run(
        [*command, "--model-dir", str(TINY), "--threads", "1", "--seed", "0", *args],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def check_book(tmp_path: Path, tokens: int | None) -> subprocess.CompletedProcess:
    (tmp_path / "chapter.txt").write_text(CHAPTER, encoding="utf-8")
    done = run_cli("--batch", "-f", "chapter.txt", "-o", "chapter.wav", "--segments-dir", "parts",
                   "--voice", "en-male", tmp_path=tmp_path, tokens=tokens)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    expected = split_text(CHAPTER)
    parts = sorted((tmp_path / "parts").glob("*.wav"))
    assert len(parts) == len(expected) > 10
    total, pcm = frames(tmp_path / "chapter.wav")
    lengths = [frames(p) for p in parts]
    assert total == sum(n for n, _ in lengths) and all(n > 0 for n, _ in lengths)
    assert pcm == b"".join(data for _, data in lengths)  # the segments, in order, back to back
    # progress: tqdm's bar counted every segment, and the summary names the batch profile
    assert f"{len(parts)}/{len(parts)}" in done.stderr and "seg" in done.stderr
    assert "batch profile" in done.stderr
    return done


@pytest.mark.long
def test_batch_of_a_2000_character_chapter(tmp_path: Path) -> None:
    assert len(CHAPTER) == 2000
    check_book(tmp_path, tokens=10)


@pytest.mark.slow
def test_batch_chapter_without_forced_tokens(tmp_path: Path) -> None:
    check_book(tmp_path, tokens=None)


@pytest.fixture()
def ten_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every sentence of an in-process ``main`` is 10 speech tokens long."""
    settings = batch.settings
    monkeypatch.setattr(batch, "settings", lambda args: replace(settings(args), force_tokens=10))


@pytest.mark.usefixtures("ten_tokens")
def test_text_from_stdin_argument_and_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    common = ["--model-dir", str(TINY), "--threads", "1", "--seed", "1"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello from standard input."))
    assert batch.main(["-o", str(tmp_path / "stdin.wav"), *common]) == 0
    assert batch.main(["Hello from the argument.", "-o", str(tmp_path / "arg.wav"), *common]) == 0
    (tmp_path / "t.txt").write_text("你好，世界。", encoding="utf-8")
    assert batch.main(["-f", str(tmp_path / "t.txt"), "-o", str(tmp_path / "f.wav"), *common]) == 0
    for name in ("stdin.wav", "arg.wav", "f.wav"):
        n, pcm = frames(tmp_path / name)
        assert n > 0 and any(pcm)


@pytest.mark.usefixtures("ten_tokens")
def test_wav_to_stdout(
    monkeypatch: pytest.MonkeyPatch, capsysbinary: pytest.CaptureFixture
) -> None:
    args = ["Hi there.", "-o", "-", "--model-dir", str(TINY), "--seed", "0"]
    assert batch.main(args) == 0
    n, _ = frames(io.BytesIO(capsysbinary.readouterr().out))
    assert n > 0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["Hi.", "--voice", "ja-robot"], "unknown voice 'ja-robot'"),
        (["?!..."], "nothing to speak"),
        (["Hi.", "--profile", "turbo"], "unknown profile 'turbo'"),
        (["Hi.", "-f", "missing.txt"], "not both"),
    ],
)
def test_refusals_exit_2_before_loading_the_model(
    argv: list[str], needle: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert batch.main([*argv, "--model-dir", str(TINY), "-o", os.devnull]) == 2
    assert needle in caplog.text


MIXED = "Good morning, this is the English part. 今天天气很好，我们去公园吧。 And English again."


@pytest.mark.parametrize(
    ("voice", "speakers"),
    [(None, ["英文男", "中文女", "英文男"]), ("zh-female", ["中文女", "中文女", "中文女"])],
)
def test_batch_reads_each_sentence_in_a_voice_of_its_language(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wy: Any, voice: str | None,
    speakers: list[str],
) -> None:  # fmt: skip
    """Without --voice, a mixed text switches voice per segment, as the server picks one for
    a request; --voice keeps one voice throughout."""
    from wyoming_cosyvoice.models import model

    engines: list[Any] = []

    def loader(config: Any) -> Any:
        def load(model_dir: Path, threads: int | None) -> Any:
            engines.append(wy.FakeEngine(model_dir, threads, delay=0.0))
            return engines[-1]

        return load

    monkeypatch.setattr(model, "engine_loader", loader)
    argv = ["--batch", MIXED, "--model-dir", str(TINY), "-o", str(tmp_path / "mixed.wav"),
            "--quiet", *(["--voice", voice] if voice else [])]  # fmt: skip
    assert batch.main(argv) == 0
    assert [call.speaker for call in engines[0].calls] == speakers
    n, _ = frames(tmp_path / "mixed.wav")
    assert n == sum(wy.FakeEngine.expected_samples(call.text) for call in engines[0].calls)
