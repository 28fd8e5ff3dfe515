"""``python -m wyoming_cosyvoice.bench --profile auto``: auto beside the profiles it chooses
from, on the tiny model (as the other benchmark tests run)."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
from test_bench import TINY_MODEL, run_bench_json

from wyoming_cosyvoice.bench.auto import AutoRunConfig, print_table, run, summarize_auto

TOKENS = 30


def test_an_auto_run_loads_chooses_and_measures_as_the_server_does(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    model = tmp_path / "CosyVoice-300M-SFT"
    shutil.copytree(TINY_MODEL, model, ignore=shutil.ignore_patterns("prepared"))
    result = run(AutoRunConfig(str(model), "Hello there.", TOKENS, threads=1))
    choice = result["choice"]
    assert choice["profile"] in ("realtime", "fast", "faster", "fastest")
    assert set(choice["predicted"]) == {"realtime", "fast", "faster", "fastest"}
    assert choice["speech_s"] == pytest.approx(TOKENS / 50)  # the forced count: exact
    assert result["first_audio_ms"] > 0 and result["stall_ms"] >= 0
    assert result["peak_rss_mb"] > 0 and result["load_s"] > 0
    # Auto loaded every format it chooses from, beside the primary ones.
    prepared = sorted(p.name for p in (model / "prepared").iterdir())
    assert {"flow.fp32.safetensors", "flow.int8.safetensors"} <= set(prepared)


def test_the_table_puts_auto_beside_its_profiles() -> None:
    choice = {"profile": "fast", "reason": "first audio 0.40 s within 1.5 s"}
    runs = [{"choice": choice, "first_audio_ms": 400.0, "stall_ms": 0.0, "peak_rss_mb": 1500.0,
             "load_s": 1.2}]  # fmt: skip
    profiles = {
        "realtime": {"first_audio_ms": 900.0, "stall_ms": 50.0, "rtf": 0.9,
                     "mel_rel_l2_vs_exact": 0.0},
        "fast": {"first_audio_ms": 420.0, "stall_ms": 0.0, "rtf": 0.5,
                 "mel_rel_l2_vs_exact": 0.023, "wave_rel_l2_vs_exact_hift": 0.008},
        "fastest": {"first_audio_ms": 300.0, "stall_ms": 0.0, "rtf": 0.4,
                    "mel_rel_l2_vs_exact": 0.104},
    }  # fmt: skip
    auto = summarize_auto(runs, profiles)
    assert (auto["rtf"], auto["mel_rel_l2_vs_exact"]) == (0.5, 0.023)  # its choice's
    out = io.StringIO()
    print_table({"model_dir": "m", "text": "t", "tokens": 30, "first_audio_target_s": 1.5,
                 "profiles": profiles, "auto": auto}, out)  # fmt: skip
    lines = out.getvalue().splitlines()
    below = lines[next(i for i, line in enumerate(lines) if line.startswith("---")) + 1 :]
    rows = below[: below.index("")]
    assert [row.split()[0] for row in rows] == ["realtime", "fast", "fastest", "auto"]
    assert "auto → fast" in rows[-1] and "400 ms" in rows[-1] and "0.0230" in rows[-1]
    assert "auto's choice: fast, first audio 0.40 s within 1.5 s" in out.getvalue()


@pytest.mark.slow
def test_the_benchmark_reports_auto_beside_the_fixed_profiles() -> None:
    result = run_bench_json("--profile", "auto", "--tokens", str(TOKENS), "--repeats", "1",
                            "--threads", "1", timeout=1800,
                            module="wyoming_cosyvoice.bench")  # fmt: skip
    assert list(result["profiles"]) == ["realtime", "fast", "fastest"]
    for profile in result["profiles"].values():
        assert profile["first_audio_ms"] > 0 and profile["stall_ms"] is not None
    auto = result["auto"]
    (chosen,) = set(auto["chosen"])
    assert chosen in result["profiles"]
    assert auto["first_audio_ms"] > 0 and auto["stall_ms"] >= 0
    assert auto["mel_rel_l2_vs_exact"] == result["profiles"][chosen]["mel_rel_l2_vs_exact"]
    assert result["first_audio_target_s"] == 1.5
