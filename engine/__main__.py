"""Engine command line: `python -m engine synthesize` and `python -m engine frontend`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
import wave
from pathlib import Path

import numpy as np

from engine.text import cli as frontend_cli
from engine.types import (
    LOW_LATENCY_SCHEDULE,
    OFFICIAL_SCHEDULE,
    EngineError,
    SynthesisOptions,
)

_LOGGER = logging.getLogger("engine")


def write_wav(path: Path, samples: np.ndarray, sample_rate: int) -> None:
    """Write mono float samples as a 16-bit PCM WAV file."""
    pcm = (np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2")
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm.tobytes())


def _synthesize(args: argparse.Namespace) -> int:
    from engine.engine import CosyVoiceEngine

    engine = CosyVoiceEngine.load(args.model_dir, threads=args.threads)
    schedule = OFFICIAL_SCHEDULE if args.schedule == "official" else LOW_LATENCY_SCHEDULE
    options = SynthesisOptions(
        speaker=args.speaker,
        stream=args.stream,
        schedule=schedule,
        seed=args.seed,
        instruct=args.instruct,
        force_tokens=args.tokens,
    )
    start = time.perf_counter()
    pieces = []
    for index, chunk in enumerate(engine.synthesize(args.text, options)):
        pieces.append(chunk.samples)
        if args.stream:
            _LOGGER.info(
                "chunk %d ready after %.0f ms (%.2f s of audio)",
                index,
                (time.perf_counter() - start) * 1000,
                chunk.duration_s,
            )
    audio = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)
    write_wav(args.out, audio, engine.sample_rate)
    elapsed = time.perf_counter() - start
    seconds = len(audio) / engine.sample_rate
    _LOGGER.info(
        "wrote %s: %.2f s of audio in %.2f s (RTF %.2f)",
        args.out,
        seconds,
        elapsed,
        elapsed / seconds if seconds else float("nan"),
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="verbose logging")
    sub = parser.add_subparsers(dest="command", required=True)

    synth = sub.add_parser("synthesize", help="text → WAV file")
    synth.add_argument(
        "--model-dir", type=Path, required=True, help="model directory in the official layout"
    )
    synth.add_argument("--text", required=True)
    synth.add_argument("--out", type=Path, required=True, help="output WAV (22050 Hz mono)")
    synth.add_argument("--speaker", help="built-in speaker name (default: the first)")
    synth.add_argument("--instruct", help="instruction text (-Instruct model)")
    synth.add_argument("--seed", type=int, help="seed for a reproducible voice")
    synth.add_argument(
        "--stream",
        action="store_true",
        help="synthesize in streamed chunks and log when each is ready",
    )
    synth.add_argument("--schedule", choices=("low_latency", "official"), default="low_latency")
    synth.add_argument("--threads", type=int, help="torch CPU threads")
    synth.add_argument("--tokens", type=int, help="force this many speech tokens (benchmarks)")

    front = sub.add_parser(
        "frontend",
        help="show normalised segments and token ids",
        description=frontend_cli.DESCRIPTION,
    )
    frontend_cli.add_arguments(front)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.debug else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "frontend":
        return frontend_cli.run(args)
    try:
        return _synthesize(args)
    except (EngineError, ValueError, OSError) as err:
        _LOGGER.error("%s", err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
