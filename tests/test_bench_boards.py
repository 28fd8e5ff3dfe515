"""The add-on's board estimates: computed from the recorded work and the boards' figures, and
addon/DOCS.md says what that computation gives."""

from __future__ import annotations

import json

import pytest

from engine.bench import boards
from engine.bench.boards import (
    COUNTS,
    FAMILIES,
    Board,
    Limits,
    board_estimates,
    estimate,
    record,
)
from wyoming_cosyvoice.bench.profiles import server_profiles

HERE = Limits(read_gbps=20.0, gemm_gflops=100.0)  # the measured machine


def _entry(hift_ran: str = "float32") -> dict:
    """A profile measured on HERE: the LM at 2× its bound, the flow at 1.5×, HiFT at 1×."""
    return {
        "hift_ran": hift_ran,
        "gemm_gflops": 100.0,
        "first_chunk_tokens": 11,
        "first_audio_parts_ms": {
            "frontend": 10.0,
            "prefill": 40.0,
            "tokens": 200.0,
            "flow": 300.0,
            "hift": 100.0,
            "other": 50.0,
        },
        "work_per_audio_s": {
            "lm": {
                "tokens": 50,
                "weight_bytes_per_token": 90e6,
                "cache_bytes_per_token": 10e6,
                "gb": 5.0,  # 100 MB 50 times: 250 ms at 20 GB/s
                "measured_ms": 500.0,
            },
            "flow": {"gflop": 100.0, "measured_ms": 1500.0},
            "hift": {"gflop": 50.0, "measured_ms": 500.0},
        },
    }


def test_a_board_takes_the_work_at_the_measured_distance_from_its_limits() -> None:
    fp32_hift = {"gflop": 50.0, "measured_ms": 1000.0}
    # A board of 10 GB/s and 50 GFLOP/s.
    result = estimate(_entry(), 10.0, 50.0, fp32_hift, HERE)
    assert result.lm_ms_per_token == pytest.approx(100e6 / 10e9 * 1e3 * 2)  # 20 ms
    assert result.flow_ms == pytest.approx(100 / 50 * 1e3 * 1.5)  # 3000 ms
    assert result.hift_ms == pytest.approx(50 / 50 * 1e3 * 1.0)  # the entry's HiFT: 1× bound
    assert result.rtf == pytest.approx((50 * 20 + 3000 + 1000) / 1e3)
    assert result.rtf_bound == pytest.approx((50 * 10 + 2000 + 1000) / 1e3)
    # 10 more tokens at 20 ms; the rest of the first audio at half the matrix rate.
    assert result.first_audio_s == pytest.approx((10 * 20 + 2 * (10 + 40 + 300 + 100 + 50)) / 1e3)


def test_a_stage_faster_than_its_bound_counts_at_its_bound() -> None:
    # An int8 flow ahead of the float32 rate, or a probe that read a busy moment: no gain.
    entry = _entry()
    entry["work_per_audio_s"]["flow"]["measured_ms"] = 500.0  # half its bound
    fp32_hift = entry["work_per_audio_s"]["hift"]
    assert estimate(entry, 10.0, 50.0, fp32_hift, HERE).flow_ms == pytest.approx(100 / 50 * 1e3)


def test_a_bfloat16_hift_runs_as_float32_on_a_board() -> None:
    # Measured with a native bfloat16 HiFT at 1× its float32 bound; the board runs float32,
    # at the float32 HiFT's 2×: its HiFT and its first chunk's HiFT take twice as long.
    fp32_hift = {"gflop": 50.0, "measured_ms": 1000.0}
    bf16 = estimate(_entry("bfloat16"), 10.0, 50.0, fp32_hift, HERE)
    fp32 = estimate(_entry("float32"), 10.0, 50.0, fp32_hift, HERE)
    assert bf16.hift_ms == pytest.approx(2000.0) and fp32.hift_ms == pytest.approx(1000.0)
    assert bf16.first_audio_s - fp32.first_audio_s == pytest.approx(2 * 100 / 1e3)


def test_a_range_of_figures_gives_a_range_of_estimates() -> None:
    board = Board("b", (10.0, 20.0), (50.0, 100.0), "r", "g")
    (low, high) = board_estimates({"realtime": _entry()}, board, HERE)["realtime"]
    assert high.rtf < low.rtf and high.first_audio_s < low.first_audio_s
    assert boards._cell((low, high)) == "≈ 0.6–1.2 s / 2.5–5"


def test_the_measured_machine_is_the_best_its_probes_read() -> None:
    # A probe in a busy moment reads the machine slow; each limit is the best of the runs.
    counts = {
        "families": {
            "CosyVoice-300M-SFT": {"realtime": {"mem_bw_gbps": 8.0, "gemm_gflops": 150.0}},
            "CosyVoice2-0.5B": {"fastest": {"mem_bw_gbps": 30.0, "gemm_gflops": 90.0}},
        }
    }
    assert boards.measured_limits(counts) == Limits(30.0, 150.0)


def test_a_recorded_result_keeps_what_the_estimates_need() -> None:
    parts = {f"first_audio_{p}_ms": 1.0 for p in (*boards.COMPUTE_PARTS, "tokens")}
    result = {
        "model_dir": "/x/CosyVoice2-0.5B",
        "profile": "fastest",
        "profile_settings": {
            "n_timesteps": 4,
            "cfg_rate": 0.0,
            "first_hop": 21,
            "lm_weights": "int8",
            "flow_weights": "int8",
        },
        "hift_weights": "float32",
        "threads": 2,
        "mem_bw_gbps": 20.0,
        "gemm_gflops": 100.0,
        "work_per_audio_s": _entry()["work_per_audio_s"],
        "first_chunk_tokens": 14,
        "first_audio_ms": 1000.0,
        "rtf": 1.2,
        **parts,
    }
    counts = boards.add_records({}, [result])
    entry = counts["families"]["CosyVoice2-0.5B"]["fastest"]
    assert entry["first_audio_parts_ms"]["tokens"] == 1.0 and entry["settings"]["n_timesteps"] == 4
    with pytest.raises(ValueError, match="no counted work"):
        record({**result, "work_per_audio_s": None})


def test_the_add_on_docs_say_what_the_counts_give() -> None:
    assert boards.main(["--check"]) == 0


def test_every_recorded_profile_is_the_servers_profile_of_today() -> None:
    # A profile whose steps, guidance, first chunk or formats changed must be measured again.
    counts = json.loads(COUNTS.read_text(encoding="utf-8"))
    assert set(counts["families"]) == set(FAMILIES)
    profiles = server_profiles()
    for family, recorded in counts["families"].items():
        assert set(recorded) == set(boards.PROFILES), family
        for name, entry in recorded.items():
            profile = profiles[name]
            today = {
                "n_timesteps": profile.n_timesteps,
                "cfg_rate": profile.cfg_rate,
                "first_hop": profile.schedule.first_hop,
                "lm_weights": profile.lm_weights,
                "flow_weights": profile.flow_weights,
            }
            assert entry["settings"] == today, f"{family} {name}: measure it again"
