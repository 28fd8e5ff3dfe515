"""``python -m wyoming_cosyvoice.bench --llm-stream``: an LLM's reply streamed word by word into
the real server with early speech on and off, on the tiny CosyVoice2 model (no timed assertions:
timings are machine facts), and the command line's answers to bad arguments."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT

from wyoming_cosyvoice.bench import server as launcher
from wyoming_cosyvoice.bench import streamed_text
from wyoming_cosyvoice.bench.__main__ import main as bench_main

TINY_V1 = ROOT / "tests" / "data" / "tiny_model"
TINY_V2 = ROOT / "tests" / "data" / "cosyvoice2" / "tiny"
TOKENS = 30  # speech tokens per sentence, forced
TOKEN_RATE = 25  # CosyVoice2's speech tokens per second of audio
WORDS_PER_S = 40.0


@pytest.fixture
def tiny_v2(tmp_path: Path) -> Path:
    """A copy of the tiny CosyVoice2 model: the server writes its prepared files beside it."""
    model = tmp_path / "CosyVoice2-0.5B"
    shutil.copytree(TINY_V2, model, ignore=shutil.ignore_patterns("prepared"))
    return model


@pytest.mark.long
def test_an_llm_reply_streamed_with_and_without_early_speech(tiny_v2: Path) -> None:
    command = [sys.executable, "-m", "wyoming_cosyvoice.bench", "--model-dir", str(tiny_v2)]
    command += ["--llm-stream", str(WORDS_PER_S), "--tokens", str(TOKENS), "--repeats", "1"]
    command += ["--threads", "1", "--json"]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["mode"] == "streamed_text" and result["text"] == streamed_text.DEFAULT_TEXT
    words = len(streamed_text.DEFAULT_TEXT.split())
    assert (result["words"], result["llm_words_per_s"], result["tokens"]) == (
        words,
        WORDS_PER_S,
        TOKENS,
    )
    assert result["voice_transcript"] == streamed_text.PROMPT_TRANSCRIPTS["en"]  # zero-shot
    on, off = result["settings"]
    assert (on["early_speech"], off["early_speech"]) == (True, False)
    # The sentence in progress was one growing sentence with early speech; without, the
    # splitter cut the long sentence at a comma into two. Each is exactly TOKENS long.
    assert (on["audio_blocks"], off["audio_blocks"]) == (1, 2)
    for setting in (on, off):
        (run,) = setting["runs"]
        assert run["server_ready_s"] > 0 and Path(run["server_log"]).is_file()
        assert setting["audio_s"] == pytest.approx(setting["audio_blocks"] * TOKENS / TOKEN_RATE)
        # The fragments went out on schedule: the last one no sooner than its time.
        assert setting["last_fragment_ms"] >= (words - 1) / WORDS_PER_S * 1000
        assert 0 < setting["first_audio_ms"] <= setting["stopped_ms"]
        assert setting["stopped_ms"] >= setting["last_fragment_ms"]
        assert setting["first_audio_after_text_end_ms"] == pytest.approx(
            setting["first_audio_ms"] - setting["last_fragment_ms"]
        )
    assert result["first_audio_gain_ms"] == pytest.approx(
        off["first_audio_ms"] - on["first_audio_ms"]
    )


def test_the_table_names_both_settings_and_the_gain(capsys: pytest.CaptureFixture[str]) -> None:
    runs = [
        {
            True: {"first_audio_ms": 400.0, "last_fragment_ms": 900.0, "stopped_ms": 9000.0,
                   "audio_s": 8.0, "audio_blocks": 1},
            False: {"first_audio_ms": 1500.0, "last_fragment_ms": 900.0, "stopped_ms": 9900.0,
                    "audio_s": 8.0, "audio_blocks": 1},
        }
        for _ in range(2)
    ]  # fmt: skip
    runs[1][False]["first_audio_ms"] = 1300.0
    result = {"model_dir": "m", "profile": "fastest", "threads": None, "tokens": 200,
              "text": "t", "words": 3, "llm_words_per_s": 15.0, "voice_transcript": "v",
              "repeats": 2, **streamed_text.summarize(runs)}  # fmt: skip
    assert result["first_audio_gain_ms_each"] == [1100.0, 900.0]
    assert result["first_audio_gain_ms"] == 1000.0
    on, off = result["settings"]
    assert (on["first_audio_after_text_end_ms"], off["first_audio_ms"]) == (-500.0, 1400.0)
    streamed_text.print_table(result, sys.stdout)
    table = capsys.readouterr().out
    assert "3 words at 15 words/s" in table
    assert "1,000 ms earlier than without" in table
    rows = [line.split() for line in table.splitlines() if line.split()[:1] in (["on"], ["off"])]
    assert [row[:3] for row in rows] == [["on", "400", "-500"], ["off", "1,400", "500"]]


def test_a_reply_the_server_refuses_ends_with_its_error(wy: SimpleNamespace) -> None:
    async def go() -> None:
        async with wy.fake_server({"limits.max_text_chars": 20}) as srv:
            with pytest.raises(RuntimeError, match="server error: text of .* over the limit"):
                await streamed_text.stream_reply(srv.port, streamed_text.DEFAULT_TEXT, 200.0)

    asyncio.run(go())


def test_the_reply_is_streamed_one_word_per_fragment() -> None:
    parts = streamed_text.fragments(" Turn on  the\nlights. ")
    assert parts == ["Turn ", "on ", "the ", "lights."]
    assert streamed_text.fragments("Hi") == ["Hi"]


def test_the_voice_speaks_the_texts_language() -> None:
    assert (
        streamed_text.prompt_transcript("打开客厅的灯，") == streamed_text.PROMPT_TRANSCRIPTS["zh"]
    )
    assert streamed_text.prompt_transcript("Sure, I") == streamed_text.PROMPT_TRANSCRIPTS["en"]
    args = streamed_text.setting_args(False, "Sure, I")
    assert args[:2] == ["--set", "server.early_speech=false"]
    assert args[2:] == ["--synthetic-voice", streamed_text.PROMPT_TRANSCRIPTS["en"]]


def test_the_launcher_gives_cosyvoice2_the_synthetic_voice(tiny_v2: Path) -> None:
    """Instead of the built-in voices (made from another model, downloaded if absent)."""
    own, server_args = launcher.parse_all(
        ["--synthetic-voice", "Hello there.", "--model-dir", str(tiny_v2), "--threads", "1"]
    )
    assert own.synthetic_voice == "Hello there." and server_args.threads == 1
    config = launcher.server_config(server_args, None)
    engine = launcher.synthetic_voice_loader(config, own.synthetic_voice)(tiny_v2, 1)
    assert engine.speakers == ["synthetic"]
    assert engine.voices["synthetic"].transcript == "Hello there."


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--llm-stream", "0"], "argument --llm-stream: must be a positive number of words"),
        (["--llm-stream", "fast"], "argument --llm-stream: must be a positive number of words"),
        (["--llm-stream", "15", "--concurrency", "1"], "not allowed with argument"),
    ],
)
def test_bad_stream_arguments_get_a_usage_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        bench_main(["--model-dir", str(TINY_V2), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("synthetic", ["cosyvoice2", "cosyvoice3"])
def test_both_families_that_speak_growing_text_can_show_early_speech(synthetic: str) -> None:
    from wyoming_cosyvoice.bench.streamed_text import model_problem

    assert model_problem(synthetic, None) is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--synthetic", "300m"], "--synthetic cosyvoice2 or cosyvoice3"),
        (["--model-dir", str(TINY_V1)], "--llm-stream needs a model that speaks a sentence before"),
        (["--model-dir", str(TINY_V2), "--text", "  "], "--text has no words to stream"),
    ],
)
def test_a_stream_the_model_or_text_cannot_give_is_refused_in_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main([*argv, "--llm-stream", "15"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m wyoming_cosyvoice.bench: ") and message in err
    assert len(err.strip().splitlines()) == 1
