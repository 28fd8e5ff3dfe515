"""Engine command line: `python -m engine synthesize`, `prepare` and `frontend`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
import wave
from pathlib import Path

import numpy as np

from engine.core.types import (
    LOW_LATENCY_SCHEDULE,
    OFFICIAL_SCHEDULE,
    EngineError,
    SynthesisOptions,
)
from engine.text import cli as frontend_cli

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
    from engine.family import load_engine

    schedule = OFFICIAL_SCHEDULE if args.schedule == "official" else LOW_LATENCY_SCHEDULE
    # Checked before the (slow) load: a bad speed fails at once.
    options = SynthesisOptions(
        speaker=args.speaker,
        stream=args.stream,
        schedule=schedule,
        seed=args.seed,
        instruct=args.instruct,
        speed=args.speed,
    )
    engine = load_engine(
        args.model_dir,
        threads=args.threads,
        lm_int8=args.lm_weights == "int8",
        lm_int4=args.lm_weights == "int4",
    )
    if args.voices_dir is not None:
        engine.enable_custom_voices(args.voices_dir)  # rejected voices are logged
    elif not engine.speakers:
        raise EngineError(
            f"{args.model_dir} has no built-in speakers: give it a voice with --voices-dir DIR "
            "(a recording NAME.wav and its transcript NAME.txt) and --speaker NAME"
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


def _prepare(args: argparse.Namespace) -> int:
    from engine.core.prepared import prepare_model
    from engine.family import model_family

    formats = {"llm": args.lm, "flow": args.flow, "hift": args.hift}
    parts = model_family(args.model_dir).model_parts()
    for label, path, prepared_now in prepare_model(
        args.model_dir, formats, args.cache_dir, parts=parts
    ):
        _LOGGER.info("%s: %s (%s)", label, path, "prepared" if prepared_now else "up to date")
    return 0


def _prepare_arguments(prep: argparse.ArgumentParser) -> None:
    from engine.core.prepared import WEIGHT_FORMATS

    prep.add_argument(
        "--model-dir", type=Path, required=True, help="model directory in the official layout"
    )
    for option, part in (("--lm", "llm"), ("--flow", "flow"), ("--hift", "hift")):
        prep.add_argument(
            option,
            nargs="+",
            choices=WEIGHT_FORMATS[part],
            default=[WEIGHT_FORMATS[part][0]],
            help=f"{part} weight formats (default: {WEIGHT_FORMATS[part][0]})",
        )
    prep.add_argument(
        "--cache-dir",
        type=Path,
        help="where to write them if the model directory is read-only "
        "(default: $XDG_CACHE_HOME/cosyvoice-engine)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="verbose logging")
    sub = parser.add_subparsers(dest="command", required=True)

    synth = sub.add_parser("synthesize", help="text → WAV file")
    synth.add_argument(
        "--model-dir", type=Path, required=True, help="model directory in the official layout"
    )
    synth.add_argument("--text", required=True)
    synth.add_argument(
        "--out",
        type=Path,
        required=True,
        help="output WAV, mono at the model's rate (v1: 22050 Hz, CosyVoice2: 24000 Hz)",
    )
    synth.add_argument(
        "--speaker", help="built-in speaker or custom voice name (default: the first)"
    )
    synth.add_argument(
        "--voices-dir",
        type=Path,
        help="custom voices: NAME.wav + NAME.txt (CosyVoice2 has no built-in speakers)",
    )
    synth.add_argument(
        "--instruct", help="instruction text (-Instruct model; CosyVoice2: with any voice)"
    )
    synth.add_argument("--seed", type=int, help="seed for a reproducible voice")
    synth.add_argument(
        "--speed", type=float, default=1.0, help="speaking speed, 0.5 to 2.0 (default 1.0)"
    )
    synth.add_argument(
        "--stream",
        action="store_true",
        help="synthesize in streamed chunks and log when each is ready",
    )
    synth.add_argument("--schedule", choices=("low_latency", "official"), default="low_latency")
    synth.add_argument("--threads", type=int, help="torch CPU threads")
    synth.add_argument(
        "--lm-weights",
        choices=("int8", "int4", "fp32"),
        default="int8",
        help="LM decoder weights: int8 (default, as the server's exact profiles), int4 "
        "(engine.core.int4, as its fast ones) or fp32 (the official maths)",
    )

    prep = sub.add_parser(
        "prepare",
        help="write the files the engine runs from (done on first use otherwise)",
        description="Write the prepared weight files of a model directory, in prepared/ beside "
        "the model files (or under --cache-dir when the model directory cannot be written). "
        "Files already up to date are kept. Each format option takes one or more formats; "
        "the defaults are what the engine loads by default.",
    )
    _prepare_arguments(prep)

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
        return _prepare(args) if args.command == "prepare" else _synthesize(args)
    except (EngineError, ValueError, OSError) as err:
        _LOGGER.error("%s", err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
