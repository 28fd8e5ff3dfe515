"""``python -m wyoming_cosyvoice.bench``: the engine benchmark with the server's profiles, K
simultaneous requests through the Wyoming server, or an LLM's reply streamed into it.

    python -m wyoming_cosyvoice.bench --synthetic 300m --profile fastest     # the engine's runs
    python -m wyoming_cosyvoice.bench --synthetic 300m --profile auto        # auto and its choices
    python -m wyoming_cosyvoice.bench --synthetic 300m --concurrency 1,2,4   # through the server
    python -m wyoming_cosyvoice.bench --synthetic cosyvoice2 --llm-stream 15 # early speech gain

Without ``--concurrency`` it measures exactly what ``python -m engine.bench`` does, with any
profile of the server's config.yaml (``--config`` for another file); ``--profile auto`` measures
each profile auto chooses from, then auto itself beside them (wyoming_cosyvoice.bench.auto).
``--llm-stream WORDS_PER_S`` streams ``--text`` (default: an LLM-style first sentence) into the
server word by word at that rate, as Home Assistant passes an LLM's reply on, with the server
speaking a sentence while it arrives and without (wyoming_cosyvoice.bench.streamed_text).
Stdout is the product (a table, or one JSON object with ``--json``); progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.bench import __main__ as engine_bench
from engine.bench.profiles import get_profile
from wyoming_cosyvoice.config import AUTO_PROFILE, ConfigError

PROG = "python -m wyoming_cosyvoice.bench"


def concurrency_levels(value: str) -> list[int]:
    try:
        levels = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a list like 1,2,4") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be >= 1")
    return levels


def words_per_second(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        rate = 0.0
    if not rate > 0 or rate == float("inf"):
        raise argparse.ArgumentTypeError(
            f"must be a positive number of words a second, not {value!r}"
        )
    return rate


def build_parser() -> argparse.ArgumentParser:
    parser = engine_bench.build_parser(
        prog=PROG,
        description=__doc__,
        profile_help="auto, or a profile of the server's config.yaml (default: %(default)s)",
    )
    parser.add_argument(
        "--config", type=Path, help="server settings file with the profiles (default: the server's)"
    )
    through_server = parser.add_mutually_exclusive_group()
    through_server.add_argument(
        "--concurrency",
        type=concurrency_levels,
        metavar="K[,K...]",
        help="instead: K simultaneous requests through the Wyoming server",
    )
    through_server.add_argument(
        "--llm-stream",
        type=words_per_second,
        metavar="WORDS_PER_S",
        help="instead: stream --text into the Wyoming server one word per synthesize-chunk at "
        "this rate, as Home Assistant passes an LLM's reply on, with server.early_speech on "
        "and off (CosyVoice2; default text: an LLM-style first sentence)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra server argument for --concurrency and --llm-stream (repeatable)",
    )
    parser.set_defaults(text=None)  # the mode's own: see main
    return parser


def main(argv: list[str] | None = None) -> int:
    from engine.bench.report import print_table
    from wyoming_cosyvoice.bench import concurrency, streamed_text
    from wyoming_cosyvoice.bench.profiles import server_profiles

    args = build_parser().parse_args(argv)
    if args.text is None:
        args.text = streamed_text.DEFAULT_TEXT if args.llm_stream else engine_bench.REFERENCE_TEXT
    try:
        profiles = server_profiles(args.config)
        profile = None if args.profile == AUTO_PROFILE else get_profile(args.profile, profiles)
    except (ConfigError, OSError, ValueError) as err:
        sys.stderr.write(f"{PROG}: {err}\n")
        return 2
    if args.llm_stream:
        return run_streamed_text(args)
    if args.concurrency:
        return engine_bench.run_cli(
            args,
            lambda model_dir: concurrency.run(
                model_dir,
                text=args.text,
                levels=args.concurrency,
                profile=args.profile,
                threads=args.threads,
                tokens=args.tokens or None,
                config=args.config,
                extra_args=args.server_arg,
            ),
            concurrency.print_table,
        )
    if profile is None:  # auto, beside the profiles it chooses from
        from wyoming_cosyvoice.bench import auto

        return engine_bench.run_cli(
            args,
            lambda model_dir: auto.run_benchmark(args, model_dir, args.config),
            auto.print_table,
        )
    return engine_bench.run_cli(
        args, lambda model_dir: engine_bench.run_benchmark(args, model_dir, profile), print_table
    )


def run_streamed_text(args: argparse.Namespace) -> int:
    """``--llm-stream``: the text checked, the model's family too, then the runs."""
    from wyoming_cosyvoice.bench import streamed_text

    if not args.text.split():
        sys.stderr.write(f"{PROG}: --text has no words to stream\n")
        return 2
    if problem := streamed_text.model_problem(args.synthetic, args.model_dir):
        sys.stderr.write(f"{PROG}: {problem}\n")
        return 2
    return engine_bench.run_cli(
        args,
        lambda model_dir: streamed_text.run(
            model_dir,
            text=args.text,
            words_per_s=args.llm_stream,
            repeats=args.repeats,
            profile=args.profile,
            threads=args.threads,
            tokens=args.tokens or None,
            config=args.config,
            extra_args=args.server_arg,
        ),
        streamed_text.print_table,
    )


if __name__ == "__main__":
    sys.exit(main())
