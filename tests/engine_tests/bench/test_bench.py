"""The engine benchmark runs and reports every field (no timed assertions: timings are machine
facts). The server's benchmark (its profiles, runs through the server) is tested in
test_server_bench.py."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

from engine.bench.__main__ import main as bench_main
from engine.bench.__main__ import model_files, warm_page_cache
from engine.bench.limits import measure_gemv_gbps
from engine.bench.measure import RunConfig, playback_stall_s
from engine.bench.profiles import BUILTIN_PROFILES, BenchProfile
from engine.bench.report import summarize
from engine.bench.synthetic import (
    EOS_BIAS,
    SFT_SPEAKERS,
    ensure_synthetic_model,
    official_config_path,
    state_dict_specs,
    weight_norm_hift_specs,
)
from engine.bench.timers import FIRST_AUDIO_PARTS, StageEvent, StageTimer
from engine.bench.work import lm_weight_bytes_per_token
from engine.core.weight_norm import LEGACY_SUFFIXES

DATA = ROOT / "tests" / "data"
TINY_MODEL = DATA / "tiny_model"

REQUIRED_FIELDS = (
    "load_s", "peak_rss_mb", "stream_peak_rss_mb", "first_audio_ms", "stall_ms", "total_ms", "rtf",
    "gapless_first_audio_ms", "gapless_stall_ms",
    "lm_ms_per_token", "flow_ms_per_audio_s", "hift_ms_per_audio_s",
    "mem_bw_gbps", "gemv_gbps", "gemm_gflops", "lm_bound_ms_per_token", "lm_overhead_ms_per_token",
    "lm_kernel_bound_ms_per_token", "lm_vs_kernel_bound", "flow_bound_ms_per_audio_s",
    "hift_bound_ms_per_audio_s", "lm_vs_bound", "flow_vs_bound", "hift_vs_bound",
    "threads", "profile", "tokens", "text", "audio_s",
    "stream_cpu_s_per_audio_s", "cpu_s_per_audio_s",
)  # fmt: skip


def test_playback_stall() -> None:
    # Chunks of 1 s ready at 0, 0.5 and 3 s: playback runs 0–2 s, waits 1 s, then plays on.
    assert playback_stall_s([0.0, 0.5, 3.0], [1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert playback_stall_s([2.0, 2.1, 2.2], [1.0, 1.0, 1.0]) == 0.0
    assert playback_stall_s([], []) == 0.0


def test_first_audio_parts_follow_the_first_chunk() -> None:
    # Request at t=10 s; the LM starts at 10.1, yields its first token at 10.3 and the chunk's
    # third at 10.5; the flow runs 10.5–10.9 and HiFT 10.9–11.2; the audio is out at 11.25.
    # Later calls (the next chunk, the next sentence), later tokens and an LM call that yielded
    # nothing do not count.
    timer = StageTimer()
    timer.events += [
        StageEvent("lm", 12.5, 13.0, token_times=[12.7, 12.8]),
        StageEvent("lm", 10.0, 10.05),
        StageEvent("lm", 10.1, 12.0, token_times=[10.3, 10.4, 10.5, 11.5, 12.0]),
        StageEvent("flow", 11.3, 11.6),
        StageEvent("flow", 10.5, 10.9),
        StageEvent("hift", 10.9, 11.2),
        StageEvent("hift", 11.6, 11.8),
    ]
    parts = timer.first_audio_parts(10.0, 11.25)
    expected = {
        "frontend": 100,
        "prefill": 200,
        "tokens": 200,
        "flow": 400,
        "hift": 300,
        "other": 50,
    }
    assert {k: parts[f"first_audio_{k}_ms"] for k in expected} == pytest.approx(expected)
    assert parts["first_chunk_tokens"] == 3
    assert StageTimer().first_audio_parts(0.0, 1.0) == {}  # nothing recorded: no parts


def test_the_limits_are_the_best_of_a_probe_before_the_runs_and_after_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import engine.bench.__main__ as bench

    probes = iter(
        [
            {"mem_bw_gbps": 30.0, "gemv_gbps": 20.0, "gemm_gflops": 75.0},
            {"mem_bw_gbps": 40.0, "gemv_gbps": 18.0, "gemm_gflops": 130.0},
            {"mem_bw_gbps": 35.0, "gemv_gbps": 22.0, "gemm_gflops": 100.0},
        ]
    )
    monkeypatch.setattr(bench, "measure_limits", lambda threads, lm_weights: next(probes))
    monkeypatch.setattr(bench, "warm_page_cache", lambda files: 0)
    monkeypatch.setattr(
        bench, "run_worker", lambda config: {"first_audio_ms": 1.0, "total_ms": 2.0, "rtf": 1.0}
    )
    args = bench.build_parser().parse_args(["--model-dir", str(tmp_path), "--repeats", "2"])
    result = bench.run_benchmark(args, tmp_path, BUILTIN_PROFILES["realtime"])
    assert (result["mem_bw_gbps"], result["gemv_gbps"], result["gemm_gflops"]) == (40, 22, 130)
    assert next(probes, None) is None  # one probe before the runs and one after each


def test_the_page_cache_is_warmed_with_every_file_a_load_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "llm.pt").write_bytes(b"x" * 3000)
    (model / "flow.pt").write_bytes(b"y" * 5)
    (model / "sub").mkdir()  # not a file: not read
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    realtime = BUILTIN_PROFILES["realtime"]
    files = model_files(model, realtime)
    assert files[:2] == [model / "flow.pt", model / "llm.pt"]
    # The prepared files of the profile's formats: absent until a load.
    assert model / "prepared" / "llm.int8.safetensors" in files
    assert model / "prepared" / "flow.fp32.safetensors" in files
    assert warm_page_cache(files, block=1024) == 3005
    fp32_lm = model_files(model, realtime.with_weights(lm="fp32"))
    assert model / "prepared" / "llm.fp32.safetensors" in fp32_lm


def test_lm_weight_bytes_skip_positional_projection() -> None:
    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear_q = nn.Linear(8, 8)
            self.linear_pos = nn.Linear(8, 8, bias=False)  # precomputable: not read per token

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.text_encoder = nn.Linear(8, 8)  # runs once per request
            self.llm = nn.Sequential(Layer(), nn.LayerNorm(8))
            self.llm_decoder = nn.Linear(8, 5)

    assert lm_weight_bytes_per_token(LM()) == 4 * ((64 + 8) + (8 + 8) + (40 + 5))


def test_synthetic_300m_matches_the_official_checkpoint_layout() -> None:
    """Keys and shapes equal the released files' (HiFT's weight norm as weight_g/weight_v, the
    names the release's code wrote)."""
    manifest = json.loads((DATA / "manifest_300m.json").read_text(encoding="utf-8"))
    specs = state_dict_specs(official_config_path())
    specs["hift.pt"] = weight_norm_hift_specs(specs["hift.pt"], LEGACY_SUFFIXES)
    official = {
        "llm.pt": {e["key"]: e["shape"] for e in manifest["llm"]["state_dict"]},
        "flow.pt": {e["key"]: e["shape"] for e in manifest["flow"]["state_dict"]},
        "hift.pt": dict(manifest["weight_norm"]["hift_state_dict_in_legacy_layout"]),
    }
    for name, expected in official.items():
        assert {k: list(v) for k, v in specs[name].items()} == expected, name


def test_synthetic_model_loads_with_the_engine(tmp_path: Path) -> None:
    from engine.cosyvoice1.model_dir import load_model_dir

    model_dir = ensure_synthetic_model(tmp_path, config=TINY_MODEL / "cosyvoice.yaml")
    hift = torch.load(model_dir / "hift.pt", weights_only=True)
    assert any(k.endswith(".weight_g") for k in hift)
    assert not any("parametrizations" in k for k in hift)
    models = load_model_dir(model_dir)
    assert sorted(models.speakers) == sorted(SFT_SPEAKERS)
    stamp = (model_dir / "llm.pt").stat().st_mtime_ns
    assert ensure_synthetic_model(tmp_path, config=TINY_MODEL / "cosyvoice.yaml") == model_dir
    assert (model_dir / "llm.pt").stat().st_mtime_ns == stamp  # reused, not regenerated


def test_synthetic_lm_runs_to_the_forced_token_count(tmp_path: Path) -> None:
    """Random weights must not stop at a random EOS: the benchmark needs exactly N tokens."""
    from engine.cosyvoice1.hparams import load_model_args
    from engine.cosyvoice1.llm import TransformerLM

    model_dir = ensure_synthetic_model(tmp_path, config=TINY_MODEL / "cosyvoice.yaml")
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    assert state["llm_decoder.bias"][-1] == EOS_BIAS  # the EOS class (after 4096 speech tokens)
    llm = TransformerLM(load_model_args(model_dir / "cosyvoice.yaml").llm)
    llm.load_state_dict(state)
    llm.eval()
    embedding = torch.load(model_dir / "spk2info.pt", weights_only=True)[SFT_SPEAKERS[0]]
    tokens = list(
        llm.generate(
            [1, 2, 3],
            embedding=embedding["embedding"],
            max_tokens=200,
            generator=torch.Generator().manual_seed(0),
        )
    )
    assert len(tokens) == 200


def test_summary_medians_bounds_and_ratios() -> None:
    runs = [
        {
            "load_s": s,
            "lm_ms_per_token": 40.0 * s,
            "flow_ms_per_audio_s": 3000.0,
            "hift_ms_per_audio_s": 1000.0,
            "tokens": 400,
            "audio_s": 8.0,
            "lm_weight_bytes_per_token": 720e6,
            "lm_cache_bytes_per_token": 80e6,
            "flow_gflop_per_audio_s": 150.0,
            "hift_gflop_per_audio_s": 50.0,
        }
        for s in (1.0, 3.0, 2.0)
    ]
    result = summarize(
        runs,
        {"mem_bw_gbps": 20.0, "gemv_gbps": 8.0, "gemm_gflops": 60.0},
        text="t",
        profile={"name": "realtime", "n_timesteps": 10},
        model_dir="m",
    )
    assert result["load_s"] == 2.0
    assert result["spread"]["load_s"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert result["lm_bound_ms_per_token"] == pytest.approx(40.0)  # 800 MB at 20 GB/s
    assert result["lm_vs_bound"] == pytest.approx(80.0 / 40.0)
    assert result["lm_overhead_ms_per_token"] == pytest.approx(80.0 - 40.0)  # beyond the reads
    # The weights at the GEMV kernel's 8 GB/s, the cache at the read bandwidth.
    assert result["lm_kernel_bound_ms_per_token"] == pytest.approx(90.0 + 4.0)
    assert result["lm_vs_kernel_bound"] == pytest.approx(80.0 / 94.0)
    assert result["flow_bound_ms_per_audio_s"] == pytest.approx(2500.0)
    assert result["hift_vs_bound"] == pytest.approx(1000.0 / (50 / 60 * 1000))
    assert result["rtf_bound"] == pytest.approx((40.0 * 50 + 2500.0 + 50 / 60 * 1000) / 1000)
    work = result["work_per_audio_s"]  # per second of speech: 50 tokens
    assert work["lm"]["gb"] == pytest.approx(40.0)
    assert (work["lm"]["bound_ms"], work["lm"]["measured_ms"]) == pytest.approx((2000, 4000))
    assert (work["flow"]["gflop"], work["flow"]["bound_ms"]) == pytest.approx((150, 2500))
    assert work["hift"]["measured_ms"] == 1000.0


@pytest.mark.parametrize("weights", ["int8", "int4", "fp32"])
def test_gemv_probe_runs_the_lm_kernel(weights: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.bench.limits
    import engine.core.int8_avx2
    import engine.core.quantize

    built: list[nn.Module] = []
    real = engine.core.quantize.lm_int8_linear

    def recording(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
        built.append(real(weight, bias))
        return built[-1]

    def one_second(fn: Callable[[], object], repeats: int) -> float:
        fn()
        return 1.0

    monkeypatch.setattr(engine.core.quantize, "lm_int8_linear", recording)
    monkeypatch.setattr(engine.bench.limits, "_best_time", one_second)
    # One decoder block's 12.6 M weights in one (pretended) second: 1 byte each in int8, 4 in
    # fp32; the int4 format's feed-forward half in 4 bits and a bfloat16 scale per 32.
    attention, feed_forward = 4 * 1024 * 1024, 2 * 4096 * 1024
    block_bytes = {
        "int8": attention + feed_forward,
        "int4": attention + feed_forward * (0.5 + 2 / 32),
        "fp32": 4 * (attention + feed_forward),
    }[weights]
    assert measure_gemv_gbps(weights=weights, blocks=1, repeats=1) == pytest.approx(
        block_bytes / 1e9
    )
    # int8: the LM's int8 layer (on the engine's kernel where it runs), fused q/k/v included;
    # int4: the attention's in int8; fp32: plain float products.
    lm_layer = "Avx2Int8Linear" if engine.core.int8_avx2.kernel() else "Int8Linear"
    assert [type(m).__name__ for m in built] == [lm_layer] * {"int8": 4, "int4": 2, "fp32": 0}[
        weights
    ]


def run_bench_json(
    *args: str,
    timeout: float,
    env: dict[str, str] | None = None,
    module: str = "engine.bench",
    model_dir: Path = TINY_MODEL,
) -> dict:
    """``python -m MODULE --model-dir MODEL_DIR ARGS --json`` in a subprocess (the tiny
    CosyVoice-300M by default); its JSON."""
    command = [
        sys.executable,
        "-m",
        module,
        "--model-dir",
        str(model_dir),
        *args,
        "--json",
    ]
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.mark.long
def test_benchmark_runs_on_the_tiny_model_beside_a_neighbour() -> None:
    result = run_bench_json(
        "--tokens",
        "60",
        "--repeats",
        "1",
        "--neighbours",
        "1",
        "--neighbour-kind",
        "memory",
        timeout=900,
    )
    missing = [key for key in REQUIRED_FIELDS if result.get(key) is None]
    assert not missing, f"fields missing or null: {missing}"
    assert result["neighbours"] == {"count": 1, "kind": "memory"}
    assert result["cpu_s_per_audio_s"] > 0
    assert result["tokens"] == 60
    assert result["profile"] == "realtime"
    assert result["audio_s"] > 0
    assert 0 < result["stream_peak_rss_mb"] <= result["peak_rss_mb"]
    # The parts of the first audio add up to it, run by run; the realtime schedule's first
    # chunk is 21 new tokens + the 20-token look-ahead.
    run = result["runs"][0]
    assert run["first_chunk_tokens"] == 41
    parts = [run[key] for key in FIRST_AUDIO_PARTS]
    assert all(part >= 0 for part in parts)  # consecutive intervals, so no part is negative
    assert sum(parts) == pytest.approx(run["first_audio_ms"])


def test_neighbours_run_for_the_block_and_are_gone_after_it() -> None:
    from engine.bench.neighbours import running

    with running(2, "spin") as processes:
        assert len(processes) == 2 and all(p.poll() is None for p in processes)
    assert all(p.poll() is not None for p in processes)
    with pytest.raises(ValueError, match="unknown neighbour kind"), running(1, "disk"):
        pass


def test_flop_count_is_the_same_for_the_int8_flow() -> None:
    # The int8 flow does the same products: its bound must not shrink to its convolutions.
    from engine.bench.timers import StageTimer
    from engine.bench.work import count_stage_flops
    from engine.core.constants import SPEECH_VOCAB
    from engine.core.quantize import quantize_flow_int8
    from engine.core.streaming import FlowPrompt, GeneratorNoise
    from engine.cosyvoice1.model_dir import load_model_dir
    from engine.cosyvoice1.streaming import ChunkVocoder

    def flops(int8: bool) -> float:
        models = load_model_dir(TINY_MODEL)
        if int8:
            quantize_flow_int8(models.flow)
        timer = StageTimer()
        timer.install(models)
        embedding = next(iter(models.speakers.values())).reshape(1, -1)
        tokens = torch.randint(0, SPEECH_VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))

        def run_chunk(steps: int) -> None:
            vocoder = ChunkVocoder(
                models.flow,
                models.hift,
                FlowPrompt(embedding),
                GeneratorNoise(torch.Generator().manual_seed(0)),
                n_timesteps=steps,
                cfg_rate=0.7,
            )
            with torch.inference_mode():
                vocoder.chunk(tokens, finalize=True)

        return count_stage_flops(run_chunk, timer, 10, 0.7).flow_gflop_per_audio_s

    fp32 = flops(False)
    assert fp32 > 0 and flops(True) == pytest.approx(fp32, rel=1e-6)


def test_a_worker_is_handed_the_profiles_settings_not_a_name_to_look_up() -> None:
    # The worker runs in a fresh process: a profile the engine does not know (one of the
    # server's) must reach it whole, through the JSON it is started with.
    profile = BenchProfile(
        "fastest",
        BUILTIN_PROFILES["realtime"].schedule,
        n_timesteps=4,
        cfg_rate=0.0,
        source="config.yaml",
        flow_weights="int8",
        hift_weights="bf16",
    )
    config = RunConfig("m", "t", 30, profile.to_json())
    handed = RunConfig(**json.loads(json.dumps(asdict(config))))
    assert BenchProfile.from_json(handed.profile) == profile


@pytest.mark.parametrize(
    "argv",
    [
        ["--synthetic", "300m", "--concurrency", "1,2"],
        ["--model-dir", "m", "--server-arg=--seed=1"],
        ["--model-dir", "m", "--config", "c.yaml"],
    ],
)
def test_the_server_benchmarks_options_say_where_they_moved(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench_main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moved to python -m wyoming_cosyvoice.bench" in err


def test_a_server_profile_is_pointed_at_the_servers_benchmark(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench_main(["--model-dir", "m", "--profile", "fastest"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'fastest'" in err and "python -m wyoming_cosyvoice.bench" in err
