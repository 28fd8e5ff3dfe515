"""What the add-on can expect on the boards Home Assistant runs on, computed from the work of a
second of speech (engine.bench.work) and the boards' published figures.

``python -m engine.bench.boards`` (``script/board-estimates``) keeps the table in addon/DOCS.md:

    script/board-estimates --record BENCH.json ...   # the benchmark's JSON of each family/profile
    script/board-estimates                           # write the table into addon/DOCS.md
    script/board-estimates --check                   # exit 1 if the table differs from this
    script/board-estimates --show                    # also each stage's time and the bounds

The model (docs/dev/performance-notes.md, *Board estimates*): each stage takes on a board what
its work needs there, at the engine's measured distance from the bound on the measured machine
(its limits: the best its probes read over the recorded runs):

* LM per token: (weight + KV-cache bytes) ÷ the board's read bandwidth × (measured ÷ bound here);
* flow and HiFT per second of speech: FLOPs ÷ the board's float32 matrix rate × (measured ÷
  bound here); the boards have no native bfloat16, so HiFT counts as the float32 HiFT (the
  family's ``realtime`` run);
* measured ÷ bound of a stage in a format is the least over the family's recorded runs, and at
  least once (:func:`efficiencies`);
* RTF: 50 (v1) or 25 (CosyVoice2) tokens, the flow and HiFT of one second, one after the other;
* first audio: the first chunk's tokens at the board's LM time per token; the other parts of the
  measured first audio (text, prefill, the first chunk's flow and HiFT, the rest), less what a
  busy moment added to that run, scaled by the ratio of the matrix rates.

The counts come from the benchmark of the full-size models (``--record`` keeps the figures the
model needs in ``script/board-estimates.json``); a profile whose settings changed since must be
measured again (tests/engine_tests/bench/test_bench_boards.py checks them against the server's
profiles).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
COUNTS = ROOT / "script" / "board-estimates.json"
DOCS = ROOT / "addon" / "DOCS.md"
# A profile's settings that change its work: a recorded run stands for the profile while they hold.
RECORDED_SETTINGS = ("n_timesteps", "cfg_rate", "solver", "first_hop", "lm_weights", "flow_weights")
BEGIN = "<!-- board-estimates: written by script/board-estimates from its .json; edit those -->"
END = "<!-- /board-estimates -->"
PROFILES = ("realtime", "fast", "faster", "fastest")
FAMILIES = {  # the benchmark's model directory → the table's title
    "CosyVoice-300M-SFT": "CosyVoice-300M-SFT (the default model)",
    "CosyVoice2-0.5B": "CosyVoice2-0.5B",
}
# The first audio's parts (engine.bench.timers.FIRST_AUDIO_PARTS) that scale with the matrix
# rate; the first chunk's tokens scale with the LM's time per token instead.
COMPUTE_PARTS = ("frontend", "prefill", "flow", "hift", "other")


@dataclass(frozen=True)
class Board:
    """A machine's published figures, as ranges (low, high) where sources differ. None of these
    computes bfloat16 natively: HiFT runs in float32 there."""

    name: str
    read_gbps: tuple[float, float]
    gemm_gflops: tuple[float, float]  # float32 matrix products, all cores
    read_source: str
    gemm_source: str


# float32 runs on the same vector units as HPL's float64 with twice the numbers per instruction:
# 2 × HPL. tinymembench counts a copied byte once, while the bus carries it read and written:
# 2 × its copy rate.
_SBC = "geerlingguy/sbc-reviews"
_TOP500 = "geerlingguy/top500-benchmark"
BOARDS = (
    Board(
        "Raspberry Pi 5 (4 × Cortex-A76)",
        (12.4, 12.4),
        (70.3, 70.3),
        f"2 × the 6.2 GB/s tinymembench copy, {_SBC} (Raspberry Pi 5 model B)",
        f"2 × 35.2 Gflops HPL, {_TOP500} (Raspberry Pi 5 8 GB)",
    ),
    Board(
        "Raspberry Pi 4 (4 × Cortex-A72), all cores",
        (5.6, 5.6),
        (23.8, 23.8),
        "STREAM, sci-pi.org.uk's Stream benchmark page",
        f"2 × 11.9 Gflops HPL, {_TOP500} (Raspberry Pi 4)",
    ),
    Board(
        "Raspberry Pi 4, one core (see below)",
        (5.6, 5.6),
        (5.9, 5.9),
        "as all cores: one core reads less, so its LM is slower than this",
        "a quarter of all cores'",
    ),
    Board(
        "Home Assistant Green (4 × Cortex-A55)",
        (5.9, 5.9),
        (11.2, 22.9),
        f"2 × the 2.97 GB/s memcpy of the Pine64 SOQuartz (RK3566, as the Green), {_SBC}",
        f"2 × 5.6 (Orange Pi CM4, {_TOP500}) to 11.4 (Pine64 SOQuartz, {_SBC}) Gflops HPL, "
        "both RK3566",
    ),
    Board(
        "Intel N100 mini PC (4 cores)",
        (12.6, 12.6),
        (74.4, 125.7),
        f"2 × the 6.3 GB/s tinymembench copy of the N150 (same cores), {_SBC} "
        "(GMKtec NucBox G3 Plus)",
        f"2 × 37.2 (Radxa X4) to 62.9 (LattePanda Mu) Gflops HPL, {_TOP500}",
    ),
)


# --- recording the benchmark's counts ---------------------------------------------------------


def record(result: dict[str, Any]) -> dict[str, Any]:
    """What the estimates need of one benchmark result (``python -m engine.bench --json``)."""
    work = result.get("work_per_audio_s")
    if not work or work["flow"]["gflop"] is None:
        raise ValueError(f"{result.get('model_dir')}: the result has no counted work")
    parts = {
        part: result[f"first_audio_{part}_ms"]
        for part in (*COMPUTE_PARTS, "tokens")
        if result.get(f"first_audio_{part}_ms") is not None
    }
    if len(parts) != len(COMPUTE_PARTS) + 1:
        raise ValueError(f"{result.get('model_dir')}: the result has no first-audio parts")
    return {
        "settings": {key: result["profile_settings"][key] for key in RECORDED_SETTINGS},
        "hift_ran": result["hift_weights"],
        "threads": result["threads"],
        "mem_bw_gbps": result["mem_bw_gbps"],
        "gemm_gflops": result["gemm_gflops"],
        "other_load_cores": result.get("other_load_cores"),
        "work_per_audio_s": work,
        "first_chunk_tokens": result["first_chunk_tokens"],
        "first_audio_parts_ms": parts,
        "first_audio_ms": result["first_audio_ms"],
        "rtf": result["rtf"],
    }


def add_records(counts: dict[str, Any], results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``counts`` with each result recorded under its model and profile."""
    families = counts.setdefault("families", {})
    for result in results:
        family = Path(result["model_dir"]).name
        if family not in FAMILIES:
            raise ValueError(f"{family}: not a model of the table ({', '.join(FAMILIES)})")
        families.setdefault(family, {})[result["profile"]] = record(result)
    return counts


# --- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """One family and profile on one board, at one end of its figures' range."""

    lm_ms_per_token: float
    flow_ms: float  # per second of speech
    hift_ms: float
    first_audio_s: float
    rtf: float
    rtf_bound: float  # every stage at the board's limits


@dataclass(frozen=True)
class Limits:
    """The measured machine's read bandwidth and float32 matrix rate."""

    read_gbps: float
    gemm_gflops: float


def measured_limits(counts: dict[str, Any]) -> Limits:
    """The best figures the benchmark's probes read on the measured machine over every recorded
    run, as the benchmark keeps the best of its own probes: on a shared machine one probe can
    read a busy moment, and a probe that understates the machine flatters the engine."""
    entries = [e for profiles in counts["families"].values() for e in profiles.values()]
    return Limits(max(e["mem_bw_gbps"] for e in entries), max(e["gemm_gflops"] for e in entries))


def _raw_efficiencies(entry: dict[str, Any], here: Limits) -> dict[tuple[str, str], float]:
    """How many times its bound each stage of a recorded run took, keyed by stage and format."""
    work, settings = entry["work_per_audio_s"], entry["settings"]
    lm, flow, hift = work["lm"], work["flow"], work["hift"]
    return {
        ("lm", settings["lm_weights"]): lm["measured_ms"] / (lm["gb"] / here.read_gbps * 1e3),
        ("flow", settings["flow_weights"]): flow["measured_ms"]
        / (flow["gflop"] / here.gemm_gflops * 1e3),
        ("hift", entry["hift_ran"]): hift["measured_ms"] / (hift["gflop"] / here.gemm_gflops * 1e3),
    }


def efficiencies(profiles: dict[str, Any], here: Limits) -> dict[tuple[str, str], float]:
    """Each stage's and format's distance from its bound: the least over the family's runs.

    A busy moment of a shared machine only ever slows a run down, so the least is the
    engine's own (as the benchmark keeps the best of its probes). Below once (the int8 flow
    ahead of the float32 rate its bound counts, or a probe that read a busy moment) it counts
    as once: no gain that is not known to carry over to a board.
    """
    best: dict[tuple[str, str], float] = {}
    for entry in profiles.values():
        for key, value in _raw_efficiencies(entry, here).items():
            best[key] = min(value, best.get(key, value))
    return {key: max(1.0, value) for key, value in best.items()}


def estimate(
    entry: dict[str, Any],
    board_read_gbps: float,
    board_gflops: float,
    best: dict[tuple[str, str], float],
    here: Limits,
) -> Estimate:
    """``entry`` (a recorded profile, measured on a machine of limits ``here``) on a board with
    these figures, at the family's ``best`` efficiencies (:func:`efficiencies`). HiFT runs in
    float32 on the board (none computes bfloat16 natively)."""
    work, settings = entry["work_per_audio_s"], entry["settings"]
    lm, flow, hift = work["lm"], work["flow"], work["hift"]
    lm_bytes = lm["weight_bytes_per_token"] + (lm["cache_bytes_per_token"] or 0)
    lm_bound = lm_bytes / board_read_gbps / 1e6  # ms per token
    flow_bound = flow["gflop"] / board_gflops * 1e3
    hift_bound = hift["gflop"] / board_gflops * 1e3
    lm_ms = lm_bound * best[("lm", settings["lm_weights"])]
    flow_ms = flow_bound * best[("flow", settings["flow_weights"])]
    if ("hift", "float32") not in best:
        raise ValueError("no run of the family had HiFT in float32 (record its realtime)")
    hift_ms = hift_bound * best[("hift", "float32")]
    rtf = (lm["tokens"] * lm_ms + flow_ms + hift_ms) / 1e3
    rtf_bound = (lm["tokens"] * lm_bound + flow_bound + hift_bound) / 1e3
    # The first audio's parts as this run measured them, less what a busy moment added (its
    # flow against the family's best of the format), at the board's matrix rate; its HiFT in
    # float32; its first chunk's tokens at the board's LM time.
    raw = _raw_efficiencies(entry, here)
    flow_key, hift_key = ("flow", settings["flow_weights"]), ("hift", entry["hift_ran"])
    busy = max(1.0, raw[flow_key] / best[flow_key])
    parts = entry["first_audio_parts_ms"]
    hift_in_float32 = best[("hift", "float32")] / best[hift_key]
    compute = sum(parts[part] for part in COMPUTE_PARTS) + parts["hift"] * (hift_in_float32 - 1)
    slower = here.gemm_gflops / board_gflops
    first_audio = compute / busy * slower + (entry["first_chunk_tokens"] - 1) * lm_ms
    return Estimate(lm_ms, flow_ms, hift_ms, first_audio / 1e3, rtf, rtf_bound)


def board_estimates(
    profiles: dict[str, Any], board: Board, here: Limits
) -> dict[str, tuple[Estimate, Estimate]]:
    """Each profile on ``board``: (at its low figures, at its high figures)."""
    best = efficiencies(profiles, here)
    return {
        name: (
            estimate(entry, board.read_gbps[0], board.gemm_gflops[0], best, here),
            estimate(entry, board.read_gbps[1], board.gemm_gflops[1], best, here),
        )
        for name, entry in profiles.items()
    }


# --- the table ----------------------------------------------------------------------------------


def _round(value: float) -> str:
    """Two significant digits, halves between 2 and 10, as an estimate deserves."""
    if value >= 10:
        return f"{round(value, -1 if value >= 100 else 0):.0f}"
    if value >= 2:
        return f"{round(value * 2) / 2:g}"
    return f"{value:.1f}"


def _span(low: float, high: float) -> str:
    a, b = _round(min(low, high)), _round(max(low, high))
    return a if a == b else f"{a}–{b}"


def _figures(span: tuple[float, float]) -> str:
    low, high = (f"{value:.3g}" for value in span)
    return low if low == high else f"{low}–{high}"


def _cell(pair: tuple[Estimate, Estimate]) -> str:
    slow, fast = pair
    first = _span(fast.first_audio_s, slow.first_audio_s)
    return f"≈ {first} s / {_span(fast.rtf, slow.rtf)}"


def render(counts: dict[str, Any]) -> str:
    """The generated part of addon/DOCS.md: a table per family, then the boards' figures."""
    lines = [BEGIN, ""]
    here = measured_limits(counts)
    for family, title in FAMILIES.items():
        profiles = counts["families"].get(family)
        if not profiles:
            continue
        shown = [name for name in PROFILES if name in profiles]
        lines.append(f"**{title}**")
        lines.append("")
        header = [f"`{shown[0]}` first audio / RTF", *(f"`{name}`" for name in shown[1:])]
        lines.append("| machine | " + " | ".join(header) + " |")
        lines.append("|---|" + "---|" * len(shown))
        for board in BOARDS:
            cells = board_estimates(profiles, board, here)
            lines.append(f"| {board.name} | " + " | ".join(_cell(cells[n]) for n in shown) + " |")
        lines.append("")
    lines.append("| machine | memory bandwidth | matrix multiply (float32) |")
    lines.append("|---|---|---|")
    for board in BOARDS:
        read, gemm = _figures(board.read_gbps), _figures(board.gemm_gflops)
        lines.append(
            f"| {board.name} | ≈ {read} GB/s: {board.read_source} | ≈ {gemm} GFLOP/s: "
            f"{board.gemm_source} |"
        )
    lines += ["", END]
    return "\n".join(lines)


def replace_block(text: str, block: str) -> str:
    """``text`` with its generated block replaced by ``block``."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"addon/DOCS.md has no block between {BEGIN!r} and {END!r}")
    return text[:start] + block + text[end + len(END) :]


def show(counts: dict[str, Any], out: Any) -> None:
    """Each stage's estimated time and the bound RTF, per family, board and profile."""
    here = measured_limits(counts)
    out.write(f"measured machine: {here.read_gbps:.1f} GB/s, {here.gemm_gflops:.0f} GFLOP/s\n")
    for family, profiles in counts["families"].items():
        for board in BOARDS:
            for name, (low, high) in board_estimates(profiles, board, here).items():
                out.write(
                    f"{family:<20}{board.name[:28]:<30}{name:<10}"
                    f"LM {low.lm_ms_per_token:6.1f}–{high.lm_ms_per_token:<6.1f} ms/token  "
                    f"flow {high.flow_ms:6.0f}–{low.flow_ms:<6.0f} HiFT "
                    f"{high.hift_ms:6.0f}–{low.hift_ms:<6.0f} ms/audio-s  RTF {high.rtf:5.2f}–"
                    f"{low.rtf:<5.2f} (bound {high.rtf_bound:4.2f}–{low.rtf_bound:<4.2f})  "
                    f"first audio {high.first_audio_s:4.1f}–{low.first_audio_s:.1f} s\n"
                )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="script/board-estimates", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--record",
        type=Path,
        nargs="+",
        metavar="BENCH_JSON",
        help="record these benchmark results (python -m engine.bench --json) first",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if addon/DOCS.md differs")
    parser.add_argument("--show", action="store_true", help="print each stage's estimate")
    args = parser.parse_args(argv)
    counts = json.loads(COUNTS.read_text(encoding="utf-8")) if COUNTS.exists() else {}
    if args.record:
        results = [json.loads(path.read_text(encoding="utf-8")) for path in args.record]
        counts = add_records(counts, results)
        COUNTS.write_text(json.dumps(counts, indent=1, ensure_ascii=False) + "\n", "utf-8")
    text = DOCS.read_text(encoding="utf-8")
    updated = replace_block(text, render(counts))
    if args.show:
        show(counts, sys.stdout)
    if args.check:
        if updated != text:
            sys.stderr.write("addon/DOCS.md's board estimates differ: run script/board-estimates\n")
            return 1
        return 0
    if updated != text:
        DOCS.write_text(updated, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
