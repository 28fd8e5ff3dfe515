"""One measured run in a fresh process: load, warm up, one streamed and one whole request.

Run as ``python -m engine.bench.measure '<json config>'``; prints one JSON object as its last
stdout line. A fresh process per repeat keeps ``peak_rss_mb`` honest (no earlier run, limit probe
or model generation in the same address space) and measures ``load_s`` the way a server start
would see it, with a warm page cache (``engine.bench`` reads the model files just before).

What a run measures:

* ``load_s``: the engine's load of the model directory in the profile's weight formats (with an
  int8 LM, ``lm_int8_cache_hit`` says whether its weights were already prepared:
  engine.core.prepared).
* streaming request: ``first_audio_ms`` (request → first audio chunk), its parts
  (``first_audio_*_ms``, from the stage timers) and ``stall_ms`` (playing from the first chunk
  in real time, the total time playback waits for the next chunk); the flow's cost per chunk
  (``stream_flow_ms_per_audio_s_by_chunk``: flat if no chunk redoes earlier chunks' work).
* both requests: CPU seconds of this process per audio second (``stream_cpu_s_per_audio_s``,
  ``cpu_s_per_audio_s``): what the audio costs the machine, whatever else runs on it.
* non-streaming request: ``total_ms`` and ``rtf``; the stages then run one after the other, so
  the stage timers give clean ``lm_ms_per_token``, ``flow_ms_per_audio_s``, ``hift_ms_per_audio_s``.
* the work (engine.bench.work): the LM's weight bytes per token and its cache bytes at the
  positions the decode steps read; optionally FLOPs of flow and HiFT per audio second.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.bench.profiles import BenchProfile
from engine.bench.timers import StageTimer
from engine.bench.work import (
    count_stage_flops,
    lm_cache_bytes_per_position,
    lm_weight_bytes_per_token,
)
from engine.core.constants import SPEECH_VOCAB, TOKEN_RATE
from engine.core.solver import EXACT_SOLVER, evaluation_count

_LOGGER = logging.getLogger(__name__)
FLOP_COUNT_TOKENS = 50  # fallback window when the request made no tokens to size it by
SEED = 0
# The transcript of a CosyVoice2 run's synthetic prompt voice (engine.bench.cosyvoice2).
PROMPT_TRANSCRIPT = "今天的会议改到下午三点，请大家准时参加，不要迟到。"


@dataclass(frozen=True)
class RunConfig:
    """What the parent process asks one worker to measure."""

    model_dir: str
    text: str
    tokens: int | None
    profile: dict[str, Any]  # BenchProfile.to_json(): the settings and formats, not a name
    threads: int | None = None
    count_flops: bool = False
    warmup: bool = True


def peak_rss_mb() -> float:
    """Peak resident set size of this process (VmHWM; ru_maxrss where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    # Linux reports ru_maxrss in KiB, macOS in bytes.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**20


def playback_stall_s(arrivals: list[float], durations: list[float]) -> float:
    """Total wait of a real-time player that starts at the first chunk and never skips.

    ``arrivals[i]`` is when chunk i was ready, ``durations[i]`` its length in seconds. Whenever
    a chunk arrives after the previous audio has finished playing, the player waits.
    """
    if not arrivals:
        return 0.0
    stall = 0.0
    play_end = arrivals[0] + durations[0]
    for arrival, duration in zip(arrivals[1:], durations[1:], strict=True):
        if arrival > play_end:
            stall += arrival - play_end
            play_end = arrival
        play_end += duration
    return stall


def stream_request(
    engine: Any, text: str, options: Any, timer: StageTimer
) -> dict[str, float | int | list[int]]:
    arrivals: list[float] = []
    durations: list[float] = []
    cpu_start = time.process_time()
    start = time.perf_counter()
    for chunk in engine.synthesize(text, options):
        if chunk.duration_s > 0:
            arrivals.append(time.perf_counter() - start)
            durations.append(chunk.duration_s)
    cpu_s = time.process_time() - cpu_start
    if not arrivals:
        raise RuntimeError("the streaming request produced no audio")
    if options.force_tokens is not None:
        expected = options.force_tokens / getattr(engine, "token_rate", TOKEN_RATE)
    else:
        from engine.core.start_policy import estimate_speech_seconds

        expected = estimate_speech_seconds(text)
    held = replay_gapless(arrivals, durations, expected, engine.sample_rate)
    flow_calls = sorted(timer.of("flow"), key=lambda event: event.start)
    first_audio = start + arrivals[0]  # a perf_counter time, like the stage timers'
    return {
        **timer.first_audio_parts(start, first_audio),
        "first_audio_ms": arrivals[0] * 1000,
        "stall_ms": playback_stall_s(arrivals, durations) * 1000,
        "gapless_first_audio_ms": held[0] * 1000,
        "gapless_stall_ms": playback_stall_s(held, durations) * 1000,
        "stream_total_ms": arrivals[-1] * 1000,
        "chunks": len(arrivals),
        "stream_cpu_s_per_audio_s": cpu_s / sum(durations),
        # Flat when each chunk's flow computes its own frames only, however long the answer.
        "stream_flow_ms_per_audio_s_by_chunk": [
            round(event.seconds * 1000 / event.audio_s) for event in flow_calls if event.audio_s
        ],
    }


def replay_gapless(
    arrivals: list[float], durations: list[float], expected_s: float, sample_rate: int
) -> list[float]:
    """When each chunk would reach the listener under the engine's gapless start policy.

    The policy only delays delivery (compute is unchanged), so replaying the eager run's
    timings through it with a fake clock gives its exact behaviour on this run.
    """
    from engine.core.start_policy import hold_until_gapless
    from engine.core.types import AudioChunk

    now = [0.0]

    def timed_chunks():
        for arrival, duration in zip(arrivals, durations, strict=True):
            now[0] = arrival
            samples = np.zeros(round(duration * sample_rate), dtype=np.float32)
            yield AudioChunk(samples, sample_rate)

    return [now[0] for _ in hold_until_gapless(timed_chunks(), expected_s, clock=lambda: now[0])]


def _whole_request(engine: Any, text: str, options: Any) -> dict[str, float]:
    cpu_start = time.process_time()
    start = time.perf_counter()
    audio_s = sum(chunk.duration_s for chunk in engine.synthesize(text, options))
    total = time.perf_counter() - start
    cpu_s = time.process_time() - cpu_start
    if audio_s <= 0:
        raise RuntimeError("the non-streaming request produced no audio")
    return {
        "total_ms": total * 1000,
        "audio_s": audio_s,
        "rtf": total / audio_s,
        "cpu_s_per_audio_s": cpu_s / audio_s,
    }


def _stage_flops(
    engine: Any, timer: StageTimer, n_timesteps: int, cfg_rate: float, n_tokens: int
) -> dict[str, float]:
    """FLOPs of flow and HiFT per audio second, counted on one vocoder call of ``n_tokens``.

    The same window as each flow call of the timed non-streaming request: the estimator's
    attention grows with the square of the window, so a shorter one would understate the work.
    """
    from engine.core.streaming import FlowPrompt, GeneratorNoise
    from engine.cosyvoice1.streaming import ChunkVocoder

    models = engine.models
    embedding = models.speakers[engine.speakers[0]].reshape(1, -1)
    tokens = torch.randint(
        0,
        SPEECH_VOCAB,
        (1, n_tokens or FLOP_COUNT_TOKENS),
        generator=torch.Generator().manual_seed(SEED),
    )

    def run_chunk(steps: int) -> None:
        noise = GeneratorNoise(torch.Generator().manual_seed(SEED))
        vocoder = ChunkVocoder(
            models.flow,
            models.hift,
            FlowPrompt(embedding),
            noise,
            n_timesteps=steps,
            cfg_rate=cfg_rate,
        )
        with torch.inference_mode():
            vocoder.chunk(tokens, finalize=True)

    return asdict(count_stage_flops(run_chunk, timer, n_timesteps, cfg_rate))


def run(config: RunConfig) -> dict[str, Any]:
    """Measure one configuration in this process; returns the worker's JSON object."""
    from engine.core.types import SynthesisOptions
    from engine.family import load_engine, model_family

    profile = BenchProfile.from_json(config.profile)
    family = model_family(config.model_dir).name
    # Families without built-in speakers (CosyVoice2, Fun-CosyVoice3) speak with a prompt voice.
    cosyvoice2 = family != "cosyvoice"
    start = time.perf_counter()
    lm_int8, flow_int8 = profile.lm_weights == "int8", profile.flow_weights == "int8"
    engine = load_engine(config.model_dir, threads=config.threads, **profile.load_keywords())
    result: dict[str, Any] = {
        "load_s": time.perf_counter() - start,
        "threads": torch.get_num_threads(),
        "lm_weights": profile.lm_weights,
        "flow_weights": profile.flow_weights,
        # what HiFT ran in: bf16 is asked for, float32 without CPU support
        "hift_weights": engine.hift_dtype,
        # int8 kernels, native bfloat16 and thread ceiling (engine.core.cpu)
        "cpu": engine.cpu_choices.as_dict() if engine.cpu_choices is not None else None,
    }
    # A miss prepares the weights first (quantising takes seconds); a hit reads them prepared.
    if lm_int8:
        result["lm_int8_cache_hit"] = "llm.int8" not in engine.prepared_at_load
    if flow_int8:
        result["flow_int8_cache_hit"] = "flow.int8" not in engine.prepared_at_load
    timer = StageTimer(engine.sample_rate, engine.models.hift.upp)
    timer.install(engine.models)
    speaker = None
    if cosyvoice2:  # no built-in speakers: a prompt voice, as a server has one
        from engine.bench.cosyvoice2 import add_bench_voice

        speaker = add_bench_voice(engine, PROMPT_TRANSCRIPT)

    if config.warmup and hasattr(engine, "warmup"):
        start = time.perf_counter()
        engine.warmup()  # as the server does: first-call kernel setup is not the request's cost
        result["warmup_s"] = time.perf_counter() - start

    options = SynthesisOptions(
        speaker=speaker,
        stream=True,
        schedule=profile.schedule,
        # No fixed seed, as a server's requests (server.seed: null): a fixed one would cut a
        # paced schedule at its own hops (engine.core.pacing). The token count is forced.
        seed=None,
        n_timesteps=profile.n_timesteps,
        cfg_rate=profile.cfg_rate,
        solver=profile.solver,
        force_tokens=config.tokens,
        on_stage=timer.hear if timer.hears_hift else None,
    )
    if cosyvoice2:  # its prompt chunks computed at the profile's settings, before the request
        engine.prime_voice(options)
    timer.reset()
    result.update(stream_request(engine, config.text, options, timer))
    # What a streaming server holds: load, warm-up and streamed chunks. The whole request below
    # vocodes every second of audio in one flow and HiFT pass, so it peaks higher.
    result["stream_peak_rss_mb"] = peak_rss_mb()

    timer.reset()
    whole = replace(options, stream=False)
    result.update(_whole_request(engine, config.text, whole))
    result.update(timer.lm_summary())
    if config.tokens and result["tokens"] % config.tokens:
        # The engine treats force_tokens as a cap once min_len is reached: a model that
        # samples EOS earlier produces fewer tokens (then "tokens" says how many).
        _LOGGER.warning(
            "asked for %d speech tokens per sentence, the LM produced %d (EOS)",
            config.tokens,
            result["tokens"],
        )
    # Tokens per flow call of the whole request (one call per text segment): the FLOP window.
    flow_window = result["tokens"] // max(1, len(timer.of("flow")))
    # The FLOPs are counted per estimator evaluation: a solver's evaluations stand for steps.
    evaluations = evaluation_count(profile.solver, profile.n_timesteps)
    result["flow_ms_per_audio_s"] = timer.ms_per_audio_s("flow")
    result["hift_ms_per_audio_s"] = timer.ms_per_audio_s("hift")
    # Before the FLOP count: the peak of a serving process, not of the counting pass.
    result["peak_rss_mb"] = peak_rss_mb()

    result["lm_weight_bytes_per_token"] = lm_weight_bytes_per_token(engine.models.llm)
    positions = result["lm_cache_positions"]
    if positions is not None:
        per_position = lm_cache_bytes_per_position(engine.models.llm)
        result["lm_cache_bytes_per_token"] = round(positions * per_position)
    if config.count_flops and cosyvoice2:
        from engine.bench import cosyvoice2 as v2

        steps, cfg = profile.n_timesteps, profile.cfg_rate
        result.update(asdict(v2.stage_flops(engine, timer, evaluations, cfg, flow_window)))
        result.update(
            v2.deviations(
                engine,
                steps,
                cfg,
                config.text,
                lm_int8=lm_int8,
                flow_approx=profile.flow_weights != "fp32",  # int8 or bf16
                solver=profile.solver,
            )  # fmt: skip
        )
    elif config.count_flops:
        result.update(_stage_flops(engine, timer, evaluations, profile.cfg_rate, flow_window))
        result.update(_deviations(engine, config, profile))
    return result


def _deviations(engine: Any, config: RunConfig, profile: BenchProfile) -> dict[str, float]:
    """How far this run's fast-path options are from the exact path (0 when exact)."""
    from engine.bench.deviation import (
        EXACT_CFG,
        EXACT_STEPS,
        hift_relative_l2,
        lm_int8_kl,
        mel_relative_l2,
        random_tokens_mel,
    )
    from engine.cosyvoice1.model_dir import load_model_dir

    embedding = engine.models.speakers[engine.speakers[0]].reshape(1, -1)
    n_timesteps, cfg_rate, solver = profile.n_timesteps, profile.cfg_rate, profile.solver
    # An int8 or bfloat16 flow is an approximation of the float32 one.
    lm_int8, flow_approx = profile.lm_weights == "int8", profile.flow_weights != "fp32"
    hift_approx = engine.hift_dtype != "float32"
    # The exact references are float32 models loaded afresh: the engine's may be int8 / bf16.
    fp32 = load_model_dir(Path(config.model_dir)) if lm_int8 or flow_approx or hift_approx else None
    out = {"mel_rel_l2_vs_exact": 0.0, "wave_rel_l2_vs_exact_hift": 0.0}
    if flow_approx or (n_timesteps, cfg_rate, solver) != (EXACT_STEPS, EXACT_CFG, EXACT_SOLVER):
        out["mel_rel_l2_vs_exact"] = mel_relative_l2(
            engine.models.flow,
            embedding,
            n_timesteps=n_timesteps,
            cfg_rate=cfg_rate,
            solver=solver,
            exact_flow=fp32.flow if flow_approx and fp32 is not None else None,
        )
    if lm_int8 and fp32 is not None:
        text_ids = engine.frontend.segments(config.text)[0].token_ids
        out.update(lm_int8_kl(fp32.llm, text_ids, embedding))
    if hift_approx and fp32 is not None:  # both vocoders on the same mel (the exact flow's)
        mel = random_tokens_mel(fp32.flow, embedding, n_timesteps=EXACT_STEPS, cfg_rate=EXACT_CFG)
        out["wave_rel_l2_vs_exact_hift"] = hift_relative_l2(engine.models.hift, fp32.hift, mel)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = RunConfig(**json.loads(argv[0]))
    result = run(config)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
