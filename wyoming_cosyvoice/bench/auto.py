"""``--profile auto`` in the server's benchmark: ``auto`` beside the profiles it chooses from.

Each profile of ``auto.profiles`` is measured as any profile is (the engine benchmark's runs,
each in a fresh process). Then ``auto`` itself, also in a fresh process per repeat, the way the
server runs it: the model loaded with every weight format auto needs, the warm-up, the stage
costs measured (:meth:`~wyoming_cosyvoice.auto.profile.AutoProfile.calibrate`), the choice for
the benchmark's text, and that choice's streamed request: first audio, playback stalls, peak
memory. Its deviation from the exact maths is the chosen profile's.

Run as a worker: ``python -m wyoming_cosyvoice.bench.auto '<json config>'`` prints one JSON
object as its last stdout line.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TextIO

from engine.bench.report import fmt

_LOGGER = logging.getLogger("wyoming_cosyvoice.bench")
SEED = 0
# What the comparison shows of each run, medians over the repeats.
COMPARED = ("first_audio_ms", "stall_ms", "rtf", "peak_rss_mb", "load_s")
DEVIATIONS = ("mel_rel_l2_vs_exact", "wave_rel_l2_vs_exact_hift", "lm_int8_kl_mean")


@dataclass(frozen=True)
class AutoRunConfig:
    """What the parent asks one auto worker to measure."""

    model_dir: str
    text: str
    tokens: int | None
    threads: int | None = None
    lm_weights: str | None = None  # instead of the server's (an experiment's --lm-weights)
    config: str | None = None  # the server settings file with the auto: section
    warmup: bool = True


def run(config: AutoRunConfig) -> dict[str, Any]:
    """Load as an ``auto`` server does, choose for the text, measure the streamed request."""
    from engine.api import PrimesVoices
    from engine.bench.measure import peak_rss_mb, stream_request
    from engine.bench.timers import StageTimer
    from engine.family import load_engine, model_family
    from wyoming_cosyvoice.config import AUTO_PROFILE, load_config
    from wyoming_cosyvoice.models.model import auto_profile, weight_options

    overrides: list[tuple[str, Any]] = [
        ("server.profile", AUTO_PROFILE),
        ("server.threads", config.threads),
    ]
    if config.lm_weights:
        overrides.append(("server.lm_weights", config.lm_weights))
    settings = load_config(Path(config.config) if config.config else None, overrides)
    auto = auto_profile(settings)
    assert auto is not None  # server.profile is auto
    weights = settings.load.weights
    start = time.perf_counter()
    engine = load_engine(config.model_dir, threads=config.threads, **weight_options(weights))
    result: dict[str, Any] = {"load_s": time.perf_counter() - start}
    speaker = None
    if model_family(config.model_dir).voices_from is not None:  # a prompt voice, as a server has
        from engine.bench.cosyvoice2 import add_bench_voice
        from engine.bench.measure import PROMPT_TRANSCRIPT

        speaker = add_bench_voice(engine, PROMPT_TRANSCRIPT)
    if config.warmup:
        engine.warmup()
    auto.calibrate(engine)
    out_of_reach = auto.out_of_reach(engine)
    if isinstance(engine, PrimesVoices):  # as the server: none primed for a profile never chosen
        for out in out_of_reach:
            options = out.options(speaker=speaker, seed=None, instruct=None, force_tokens=None)
            engine.unprime_voice(options)
    profile = auto.choose(
        config.text,
        engine=engine,
        speaker=speaker,
        client="the benchmark",
        force_tokens=config.tokens,
    )
    assert auto.last is not None
    result["choice"] = auto.last.as_dict()
    options = profile.options(speaker=speaker, seed=SEED, instruct=None, force_tokens=config.tokens)
    if isinstance(engine, PrimesVoices):  # the chosen settings' prompt chunks, before the request
        engine.prime_voice(options)
    # The chosen profile's models (its format where loaded, else the primary: as the engine runs)
    llm = engine.lms.get(profile.lm_weights, engine.models.llm)
    flow = engine.flows.get(profile.flow_weights, engine.models.flow)
    hift = engine.hifts.get(profile.hift_weights, engine.models.hift)
    timer = StageTimer(engine.sample_rate, engine.models.hift.upp)
    timer.install(SimpleNamespace(llm=llm, flow=flow, hift=hift))
    result.update(stream_request(engine, config.text, options, timer))
    result["peak_rss_mb"] = peak_rss_mb()
    return result


def run_worker(config: AutoRunConfig) -> dict[str, Any]:
    """One repeat in a fresh interpreter (clean peak RSS, real load time)."""
    command = [sys.executable, "-m", "wyoming_cosyvoice.bench.auto", json.dumps(asdict(config))]
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the auto benchmark run failed (exit code {done.returncode})")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def run_benchmark(args: Any, model_dir: Path, config: Path | None) -> dict[str, Any]:
    """Every profile auto chooses from, then auto; one JSON-able object."""
    from engine.bench import __main__ as engine_bench
    from wyoming_cosyvoice.bench.profiles import server_profiles
    from wyoming_cosyvoice.config import load_config

    settings = load_config(config)
    assert settings.auto is not None
    bench_profiles = server_profiles(config)
    profiles = {}
    for name in settings.auto.profiles:
        _LOGGER.info("Profile %s", name)
        profiles[name] = engine_bench.run_benchmark(args, model_dir, bench_profiles[name])
    runs = []
    for index in range(args.repeats):
        _LOGGER.info("Profile auto, run %d/%d", index + 1, args.repeats)
        run_config = AutoRunConfig(
            model_dir=str(model_dir),
            text=args.text,
            tokens=args.tokens or None,
            threads=args.threads,
            lm_weights=args.lm_weights,
            config=str(config) if config else None,
            warmup=not args.no_warmup,
        )
        runs.append(run_worker(run_config))
        choice = runs[-1]["choice"]
        _LOGGER.info("  chose %s: %s", choice["profile"], choice["reason"])
    return {
        "model_dir": str(model_dir),
        "text": args.text,
        "tokens": args.tokens or None,
        "first_audio_target_s": settings.auto.first_audio_s,
        "profiles": profiles,
        "auto": summarize_auto(runs, profiles),
    }


def summarize_auto(runs: list[dict[str, Any]], profiles: dict[str, Any]) -> dict[str, Any]:
    """Medians of the auto runs; its deviation is the profile it chose (the first run's)."""
    chosen = [run["choice"]["profile"] for run in runs]
    summary: dict[str, Any] = {
        key: statistics.median(run[key] for run in runs if run.get(key) is not None)
        for key in COMPARED
        if any(run.get(key) is not None for run in runs)
    }
    summary["chosen"] = chosen
    summary["choice"] = runs[0]["choice"]
    # auto streams: its RTF is the chosen profile's, measured on a whole request there.
    summary["rtf"] = profiles[chosen[0]].get("rtf")
    for key in DEVIATIONS:
        summary[key] = profiles[chosen[0]].get(key)
    summary["runs"] = runs
    return summary


def print_table(result: dict[str, Any], out: TextIO) -> None:
    """auto beside the profiles it chooses from: first audio, stalls, RTF, memory, deviation."""
    w = out.write
    w(f"model     {result['model_dir']}\n")
    w(f"text      {result['text']}\n")
    w(f"tokens    {result['tokens'] or 'until the model ends'} per request\n")
    w(f"auto      first audio within {result['first_audio_target_s']:g} s\n\n")
    header = (
        f"{'profile':<18}{'first audio':>12}{'stalls':>10}{'RTF':>7}{'peak RSS':>10}"
        f"{'load':>7}  {'mel rel L2':>10}{'wave rel L2':>12}\n"
    )
    w(header)
    w("-" * (len(header) - 1) + "\n")
    rows = [(name, profile) for name, profile in result["profiles"].items()]
    auto = result["auto"]
    rows.append((f"auto → {', '.join(dict.fromkeys(auto['chosen']))}", auto))
    for label, row in rows:
        w(
            f"{label:<18}{fmt(row.get('first_audio_ms'), 0) + ' ms':>12}"
            f"{fmt(row.get('stall_ms'), 0) + ' ms':>10}{fmt(row.get('rtf'), 2):>7}"
            f"{fmt(row.get('peak_rss_mb'), 0) + ' MB':>10}{fmt(row.get('load_s'), 2) + ' s':>7}"
            f"  {fmt(row.get('mel_rel_l2_vs_exact'), 4):>10}"
            f"{fmt(row.get('wave_rel_l2_vs_exact_hift'), 4):>12}\n"
        )
    w(f"\nauto's choice: {auto['choice']['profile']}, {auto['choice']['reason']}\n")
    w(
        "First audio and stalls: a streamed request played in real time from its first chunk; "
        "RTF: a whole request's (auto: its choice's); deviation: from the exact maths "
        "(auto: its choice's).\n"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    result = run(AutoRunConfig(**json.loads(argv[0])))
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
