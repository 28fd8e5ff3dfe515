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


def _entry(hift_ran: str = "float32", flow_ms: float = 1500.0, hift_ms: float = 1000.0) -> dict:
    """A realtime run on HERE: the LM at 2× its bound, the flow (float32) at 1.5× and HiFT at
    2×, unless given other times."""
    return {
        "settings": {"lm_weights": "int8", "flow_weights": "fp32"},
        "hift_ran": hift_ran,
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
            "flow": {"gflop": 100.0, "measured_ms": flow_ms},  # bound 1000 ms
            "hift": {"gflop": 50.0, "measured_ms": hift_ms},  # bound 500 ms
        },
    }


def test_a_board_takes_the_work_at_the_measured_distance_from_its_limits() -> None:
    entry = _entry()
    best = boards.efficiencies({"realtime": entry}, HERE)
    assert best == {("lm", "int8"): 2.0, ("flow", "fp32"): 1.5, ("hift", "float32"): 2.0}
    # A board of 10 GB/s and 50 GFLOP/s.
    result = estimate(entry, 10.0, 50.0, best, HERE)
    assert result.lm_ms_per_token == pytest.approx(100e6 / 10e9 * 1e3 * 2)  # 20 ms
    assert result.flow_ms == pytest.approx(100 / 50 * 1e3 * 1.5)  # 3000 ms
    assert result.hift_ms == pytest.approx(50 / 50 * 1e3 * 2)  # 2000 ms
    assert result.rtf == pytest.approx((50 * 20 + 3000 + 2000) / 1e3)
    assert result.rtf_bound == pytest.approx((50 * 10 + 2000 + 1000) / 1e3)
    # 10 more tokens at 20 ms; the rest of the first audio at half the matrix rate.
    assert result.first_audio_s == pytest.approx((10 * 20 + 2 * (10 + 40 + 300 + 100 + 50)) / 1e3)


def test_each_stage_runs_as_efficiently_as_in_the_familys_best_run() -> None:
    # Two runs of the same formats, the second in a busy moment (flow and HiFT twice as slow):
    # both count at the first's efficiency, and the busy run's first audio loses what the
    # busy moment added to it.
    quiet, busy = _entry(), _entry(flow_ms=3000.0, hift_ms=2000.0)
    for part in boards.COMPUTE_PARTS:
        busy["first_audio_parts_ms"][part] *= 2
    best = boards.efficiencies({"quiet": quiet, "busy": busy}, HERE)
    assert best[("flow", "fp32")] == 1.5 and best[("hift", "float32")] == 2.0
    assert estimate(busy, 10.0, 50.0, best, HERE) == estimate(quiet, 10.0, 50.0, best, HERE)


def test_a_stage_faster_than_its_bound_counts_at_its_bound() -> None:
    # An int8 flow ahead of the float32 rate, or a probe that read a busy moment: no gain.
    best = boards.efficiencies({"realtime": _entry(flow_ms=500.0)}, HERE)
    assert best[("flow", "fp32")] == 1.0


def test_a_bfloat16_hift_runs_as_float32_on_a_board() -> None:
    # Measured with a native bfloat16 HiFT at 1× its bound beside a float32 HiFT at 2×: on the
    # board it runs in float32, and so does its first chunk's HiFT.
    fp32, bf16 = _entry(), _entry("bfloat16", hift_ms=500.0)
    best = boards.efficiencies({"realtime": fp32, "fast": bf16}, HERE)
    assert best[("hift", "bfloat16")] == 1.0
    on_board = estimate(bf16, 10.0, 50.0, best, HERE)
    assert on_board.hift_ms == estimate(fp32, 10.0, 50.0, best, HERE).hift_ms == 2000.0
    parts = bf16["first_audio_parts_ms"]
    compute = sum(parts[p] for p in boards.COMPUTE_PARTS) + parts["hift"]  # HiFT twice
    assert on_board.first_audio_s == pytest.approx((10 * 20 + 2 * compute) / 1e3)


def test_a_range_of_figures_gives_a_range_of_estimates() -> None:
    board = Board("b", (10.0, 20.0), (50.0, 100.0), "r", "g")
    (low, high) = board_estimates({"realtime": _entry()}, board, HERE)["realtime"]
    assert high.rtf < low.rtf and high.first_audio_s < low.first_audio_s
    assert boards._cell((low, high)) == "≈ 0.6–1.2 s / 3–6"


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
            "solver": "euler",
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
    # A profile whose steps, guidance, solver, first chunk or formats changed must be measured
    # again.
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
                "solver": profile.solver,
                "first_hop": profile.schedule.first_hop,
                "lm_weights": profile.lm_weights,
                "flow_weights": profile.flow_weights,
            }
            assert entry["settings"] == today, f"{family} {name}: measure it again"
