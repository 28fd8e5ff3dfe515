"""Combine the repeats and the machine limits into one result; print it as a table or JSON.

Every measured figure is the median over the repeats, with ``min``/``max`` under ``spread``.
Bounds use this run's limits: ``lm_bound_ms_per_token`` = the bytes a decode step reads (weights
and KV cache) ÷ read bandwidth, ``flow_bound_ms_per_audio_s`` / ``hift_bound_ms_per_audio_s`` =
FLOPs per audio second ÷ GEMM throughput. ``*_vs_bound`` is measured ÷ bound (1.0 = at this
machine's physical limit); ``lm_overhead_ms_per_token`` = ``lm_ms_per_token`` minus that
bound, the decode time that is not reading bytes. ``lm_kernel_bound_ms_per_token`` = the weight
bytes ÷ the rate the LM's own GEMV kernel reaches alone (``gemv_gbps``) plus the cache bytes ÷
read bandwidth; what ``lm_vs_kernel_bound`` exceeds 1.0 by is the engine's own time (small ops,
Python), not the kernel's. ``work_per_audio_s`` holds, per stage, the work of one second of
speech, the time it bounds here and the time measured (the figures ``script/board-estimates``
scales to other machines).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from typing import Any, TextIO

from engine.bench.timers import FIRST_AUDIO_PARTS

# Figures that are measured per repeat and summarised as median/min/max.
MEASURED = (
    "load_s",
    "warmup_s",
    "peak_rss_mb",
    "stream_peak_rss_mb",
    "first_audio_ms",
    "stall_ms",
    "gapless_first_audio_ms",
    "gapless_stall_ms",
    "stream_total_ms",
    "total_ms",
    "rtf",
    "lm_prefill_ms",
    "lm_ms_per_token",
    "flow_ms_per_audio_s",
    "hift_ms_per_audio_s",
    "audio_s",
    "stream_cpu_s_per_audio_s",
    "cpu_s_per_audio_s",
    *FIRST_AUDIO_PARTS,
)
# Per-run facts that do not vary between repeats (taken from the first run that has them).
# The cache hits are the first run's (a cold cache misses once); the table lists every run's.
FACTS = (
    "threads",
    "lm_weights",
    "flow_weights",
    "hift_weights",
    "tokens",
    "chunks",
    "first_chunk_tokens",
    "stream_flow_ms_per_audio_s_by_chunk",
    "lm_weight_bytes_per_token",
    "lm_cache_bytes_per_token",
    "lm_cache_positions",
    "flow_gflop_per_audio_s",
    "hift_gflop_per_audio_s",
    "estimator_mflop_per_frame_step",
    "estimator_mflop_per_frame_pass",
    "flow_passes",
    "flow_encoder_gflop_per_audio_s",
    "mel_frames_per_audio_s",
    "mel_rel_l2_vs_exact",
    "wave_rel_l2_vs_exact_hift",
    "lm_int8_kl_mean",
    "lm_int8_kl_max",
    "lm_int8_cache_hit",
    "flow_int8_cache_hit",
    "cpu",
)


BUSY_CORES = 0.2  # other processes' average load above which the figures are flagged


def _median(values: Iterable[float | None]) -> dict[str, float] | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present)}


def _ratio(value: float | None, bound: float | None) -> float | None:
    return value / bound if value is not None and bound else None


def summarize(
    runs: list[dict[str, Any]],
    limits: dict[str, float | None],
    *,
    text: str,
    profile: dict[str, Any],
    model_dir: str,
) -> dict[str, Any]:
    """One JSON-able object: medians at the top level, spread, limits, bounds and ratios."""
    result: dict[str, Any] = {
        "model_dir": model_dir,
        "text": text,
        "profile": profile["name"],
        "profile_settings": profile,
        "repeats": len(runs),
    }
    spread = {key: _median(run.get(key) for run in runs) for key in MEASURED}
    for key, stats in spread.items():
        result[key] = stats["median"] if stats else None
    for key in FACTS:
        result[key] = next((run[key] for run in runs if run.get(key) is not None), None)
    result.update(limits)

    bw, gemm = limits.get("mem_bw_gbps"), limits.get("gemm_gflops")
    weight_bytes = result["lm_weight_bytes_per_token"]
    cache_bytes = result["lm_cache_bytes_per_token"] or 0
    result["lm_bytes_per_token"] = weight_bytes + cache_bytes if weight_bytes else None
    result["lm_bound_ms_per_token"] = (
        result["lm_bytes_per_token"] / (bw * 1e9) * 1e3 if weight_bytes and bw else None
    )
    # What a decode step costs beyond reading its bytes at the measured bandwidth: the kernels'
    # distance from the memory's speed plus everything that is not a matrix product.
    result["lm_overhead_ms_per_token"] = (
        result["lm_ms_per_token"] - result["lm_bound_ms_per_token"]
        if result["lm_ms_per_token"] is not None and result["lm_bound_ms_per_token"] is not None
        else None
    )
    gemv = limits.get("gemv_gbps")
    result["lm_kernel_bound_ms_per_token"] = (
        (weight_bytes / (gemv * 1e9) + cache_bytes / (bw * 1e9)) * 1e3
        if weight_bytes and gemv and bw
        else None
    )
    result["lm_vs_kernel_bound"] = _ratio(
        result["lm_ms_per_token"], result["lm_kernel_bound_ms_per_token"]
    )
    for stage in ("flow", "hift"):
        gflop = result[f"{stage}_gflop_per_audio_s"]
        result[f"{stage}_bound_ms_per_audio_s"] = gflop / gemm * 1e3 if gflop and gemm else None
    for stage, unit in (
        ("lm", "ms_per_token"),
        ("flow", "ms_per_audio_s"),
        ("hift", "ms_per_audio_s"),
    ):
        result[f"{stage}_vs_bound"] = _ratio(
            result[f"{stage}_{unit}"], result[f"{stage}_bound_{unit}"]
        )
    # Bound-limited RTF: every stage at its bound, run back to back (no overlap credited).
    bounds = (
        result["lm_bound_ms_per_token"],
        result["flow_bound_ms_per_audio_s"],
        result["hift_bound_ms_per_audio_s"],
    )
    if all(bounds) and result["tokens"] and result["audio_s"]:
        tokens_per_s = result["tokens"] / result["audio_s"]
        result["rtf_bound"] = (bounds[0] * tokens_per_s + bounds[1] + bounds[2]) / 1000
    else:
        result["rtf_bound"] = None
    result["work_per_audio_s"] = work_per_audio_s(result)
    result["spread"] = {k: v for k, v in spread.items() if v is not None}
    result["runs"] = runs
    return result


def _times(*factors: float | None) -> float | None:
    product = 1.0
    for factor in factors:
        if factor is None:
            return None
        product *= factor
    return product


def work_per_audio_s(result: dict[str, Any]) -> dict[str, Any] | None:
    """Per stage, the work of one second of speech, the time it bounds on this machine and the
    time measured (a whole request's stages, one after the other), all in ms per audio second.

    None when the run counted no work (its FLOPs are counted in the first repeat only).
    """
    tokens, audio_s = result.get("tokens"), result.get("audio_s")
    if not (tokens and audio_s and result.get("lm_bytes_per_token")):
        return None
    tokens_per_s = tokens / audio_s
    lm = {
        "tokens": tokens_per_s,
        "weight_bytes_per_token": result["lm_weight_bytes_per_token"],
        "cache_bytes_per_token": result.get("lm_cache_bytes_per_token"),
        "cache_positions": result.get("lm_cache_positions"),
        "gb": result["lm_bytes_per_token"] * tokens_per_s / 1e9,
        "bound_ms": _times(result.get("lm_bound_ms_per_token"), tokens_per_s),
        "measured_ms": _times(result.get("lm_ms_per_token"), tokens_per_s),
    }
    flow = {
        "steps": result["profile_settings"].get("n_timesteps"),
        "passes": result.get("flow_passes"),
        "frames": result.get("mel_frames_per_audio_s"),
        "mflop_per_frame_pass": result.get("estimator_mflop_per_frame_pass"),
        "encoder_gflop": result.get("flow_encoder_gflop_per_audio_s"),
        "gflop": result.get("flow_gflop_per_audio_s"),
        "bound_ms": result.get("flow_bound_ms_per_audio_s"),
        "measured_ms": result.get("flow_ms_per_audio_s"),
    }
    hift = {
        "gflop": result.get("hift_gflop_per_audio_s"),
        "bound_ms": result.get("hift_bound_ms_per_audio_s"),
        "measured_ms": result.get("hift_ms_per_audio_s"),
    }
    return {"lm": lm, "flow": flow, "hift": hift}


def fmt(value: Any, digits: int = 1) -> str:
    """A table cell: "–" for a figure not measured, a float with ``digits`` decimals."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


_TABLE = (
    # (label, key, unit, bound key, ratio key, digits)
    ("load", "load_s", "s", None, None, 2),
    ("peak RSS", "peak_rss_mb", "MB", None, None, 0),
    ("peak RSS, streaming only", "stream_peak_rss_mb", "MB", None, None, 0),
    ("first audio (stream)", "first_audio_ms", "ms", None, None, 0),
    ("playback stalls (stream)", "stall_ms", "ms", None, None, 0),
    ("first audio, gapless start", "gapless_first_audio_ms", "ms", None, None, 0),
    ("stalls, gapless start", "gapless_stall_ms", "ms", None, None, 0),
    ("CPU per audio s (stream)", "stream_cpu_s_per_audio_s", "CPU-s", None, None, 2),
    ("total (whole)", "total_ms", "ms", None, None, 0),
    ("CPU per audio s (whole)", "cpu_s_per_audio_s", "CPU-s", None, None, 2),
    ("RTF (whole)", "rtf", "", "rtf_bound", None, 2),
    ("LM prefill", "lm_prefill_ms", "ms", None, None, 0),
    ("LM decode", "lm_ms_per_token", "ms/token", "lm_bound_ms_per_token", "lm_vs_bound", 1),
    ("LM decode beyond its reads", "lm_overhead_ms_per_token", "ms/token", None, None, 1),
    (
        "LM decode, vs its kernel",
        "lm_ms_per_token",
        "ms/token",
        "lm_kernel_bound_ms_per_token",
        "lm_vs_kernel_bound",
        1,
    ),
    ("flow", "flow_ms_per_audio_s", "ms/audio-s", "flow_bound_ms_per_audio_s", "flow_vs_bound", 0),
    ("HiFT", "hift_ms_per_audio_s", "ms/audio-s", "hift_bound_ms_per_audio_s", "hift_vs_bound", 0),
)


def print_table(result: dict[str, Any], out: TextIO) -> None:
    """A readable summary: medians with min–max, bounds and how far each stage is from its bound."""
    w = out.write
    w(f"model     {result['model_dir']}\n")
    settings = json.dumps(result["profile_settings"], ensure_ascii=False)
    w(f"profile   {result['profile']} {settings}\n")
    w(f"text      {result['text']}\n")
    w(
        f"tokens    {result['tokens']} → {fmt(result['audio_s'], 2)} s of audio, "
        f"threads {result['threads']}, repeats {result['repeats']}\n"
    )
    w(
        f"machine   read bandwidth {fmt(result.get('mem_bw_gbps'))} GB/s, "
        f"{result.get('lm_weights') or 'LM'} GEMV {fmt(result.get('gemv_gbps'))} GB/s, "
        f"fp32 GEMM {fmt(result.get('gemm_gflops'))} GFLOP/s; other processes used "
        f"{fmt(result.get('other_load_cores'), 2)} cores on average during the run\n"
    )
    if result.get("cpu"):
        w(f"cpu       {', '.join(f'{k} {v}' for k, v in result['cpu'].items())}\n")
    neighbours = result.get("neighbours") or {}
    if neighbours.get("count"):
        w(
            f"busy      {neighbours['count']} {neighbours['kind']} neighbour process(es) ran "
            "throughout, as on a shared Home Assistant box\n"
        )
    elif (result.get("other_load_cores") or 0) > BUSY_CORES:
        w("WARNING   the machine was busy with other work: these figures are pessimistic\n")
    w("\n")
    w(
        f"{'metric':<26}{'median':>12}{'min':>11}{'max':>11}  {'unit':<11}"
        f"{'bound':>10}{'×bound':>8}\n"
    )
    w("-" * 89 + "\n")
    for label, key, unit, bound_key, ratio_key, digits in _TABLE:
        stats = result["spread"].get(key) or {}
        w(
            f"{label:<26}{fmt(result.get(key), digits):>12}{fmt(stats.get('min'), digits):>11}"
            f"{fmt(stats.get('max'), digits):>11}  {unit:<11}"
            f"{fmt(result.get(bound_key), digits) if bound_key else '':>10}"
            f"{fmt(result.get(ratio_key), 2) if ratio_key else '':>8}\n"
        )
    _print_first_audio_parts(result, out)
    by_chunk = result.get("stream_flow_ms_per_audio_s_by_chunk")
    if by_chunk:
        cells = ", ".join(f"{value:,}" for value in by_chunk)
        out.write(f"flow per streamed chunk (first run): {cells} ms/audio-s\n")
    for part, label in (("lm", "LM"), ("flow", "flow")):  # a miss quantises: load_s differs
        loads = [
            (run.get(f"{part}_int8_cache_hit"), run.get("load_s")) for run in result.get("runs", [])
        ]
        if any(hit is not None for hit, _ in loads):
            w(
                f"\nint8 {label} cache per run: "
                + ", ".join(
                    f"{'hit' if hit else 'miss'} (load {fmt(load, 2)} s)" for hit, load in loads
                )
                + "\n"
            )
    _print_work(result, out)
    if result.get("flow_weights") == "int8":
        w(
            "The flow runs int8 weights: its bound is the float32 GEMM rate's, so its ratio can "
            "fall below 1.\n"
        )
    if result.get("hift_weights") in ("bfloat16", "int8"):
        w(
            f"HiFT's filter runs in {result['hift_weights']}: its bound is the float32 GEMM "
            "rate's, so its ratio can fall below 1.\n"
        )
    w(f"Deviation from the exact path: mel relative L2 {fmt(result.get('mel_rel_l2_vs_exact'), 4)}")
    if result.get("lm_int8_kl_mean") is not None:
        w(
            f", int8 LM next-token KL mean {fmt(result['lm_int8_kl_mean'], 5)} "
            f"max {fmt(result.get('lm_int8_kl_max'), 5)} nats"
        )
    if result.get("wave_rel_l2_vs_exact_hift"):
        hift = result.get("hift_weights")
        w(f", {hift} HiFT waveform relative L2 {fmt(result['wave_rel_l2_vs_exact_hift'], 4)}")
    w(".\n")


def _print_work(result: dict[str, Any], out: TextIO) -> None:
    """The work of one second of speech per stage, the time it bounds here and the time taken."""
    work = result.get("work_per_audio_s")
    if not work:
        return
    lm, flow, hift = work["lm"], work["flow"], work["hift"]
    formats = f"LM {result.get('lm_weights')}, flow {result.get('flow_weights')}"
    out.write(
        f"\nWork per second of speech ({formats}, HiFT {result.get('hift_weights')}), the "
        "time it takes at least on this machine, and the time measured (ms per audio-s):\n"
    )
    cache = lm["cache_bytes_per_token"] or 0
    positions = fmt(lm["cache_positions"], 0)
    stages = (
        (
            "LM",
            f"{lm['tokens']:.1f} tokens × {(lm['weight_bytes_per_token'] + cache) / 1e6:,.1f} MB "
            f"(weights {lm['weight_bytes_per_token'] / 1e6:,.1f} + KV cache {cache / 1e6:,.1f} "
            f"at {positions} positions) = {lm['gb']:,.2f} GB",
            lm,
        ),
        (
            "flow",
            f"{flow['steps']} steps × {flow['passes']} pass(es) × {fmt(flow['frames'])} frames × "
            f"{fmt(flow['mflop_per_frame_pass'])} MFLOP + encoder "
            f"{fmt(flow['encoder_gflop'])} GFLOP = {fmt(flow['gflop'])} GFLOP",
            flow,
        ),
        ("HiFT", f"{fmt(hift['gflop'])} GFLOP", hift),
    )
    for label, counted, stage in stages:
        out.write(
            f"  {label:<5}{counted:<86} bound {fmt(stage['bound_ms'], 0):>6}"
            f"  measured {fmt(stage['measured_ms'], 0):>6}\n"
        )
    bounds = [stage["bound_ms"] for _, _, stage in stages]
    measured = [stage["measured_ms"] for _, _, stage in stages]
    if all(v is not None for v in (*bounds, *measured)):
        out.write(
            f"  {'all':<5}{'stages one after the other':<86} bound {sum(bounds):>6,.0f}"
            f"  measured {sum(measured):>6,.0f}\n"
        )


def _print_first_audio_parts(result: dict[str, Any], out: TextIO) -> None:
    """One line: the median first audio's parts, in the order the request waits for them."""
    if any(result.get(key) is None for key in FIRST_AUDIO_PARTS):
        return
    tokens = result.get("first_chunk_tokens")
    more = f"{tokens - 1} more tokens" if tokens else "more tokens"
    labels = ("frontend", "LM prefill", more, "flow", "HiFT", "other")
    parts = " + ".join(
        f"{label} {result[key]:,.0f}" for label, key in zip(labels, FIRST_AUDIO_PARTS, strict=True)
    )
    out.write(
        f"\nfirst audio (medians of its parts; first chunk {tokens or '?'} tokens): {parts} ms\n"
    )


def print_json(result: dict[str, Any], out: TextIO) -> None:
    out.write(json.dumps(result, ensure_ascii=False) + "\n")
