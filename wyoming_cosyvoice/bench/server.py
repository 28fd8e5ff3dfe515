"""``python -m wyoming_cosyvoice.bench.server [--force-tokens N] [--synthetic-voice TRANSCRIPT]
SERVER-OPTIONS``: the server as the benchmark (and a test that needs short fixed-length answers)
runs it.

The start-up of ``python -m wyoming_cosyvoice`` (its options and settings, model directory,
engine, the HTTP API if asked, serve until SIGINT/SIGTERM) with settings no user needs: every
sentence is exactly N speech tokens long (a model with random weights never samples its end of
speech, so without a fixed count each request would run to the LM's length cap), and a
CosyVoice2 model may speak in the engine benchmark's synthetic 5-second prompt voice instead of
the built-in voices (which are made from another model, downloaded if absent).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.api import Engine
from wyoming_cosyvoice import __main__ as server_cli
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.models.download import ModelNotFoundError
from wyoming_cosyvoice.models.model import family_at, load_cosyvoice, load_options
from wyoming_cosyvoice.pipeline.scheduler import EngineFactory

PROG = "python -m wyoming_cosyvoice.bench.server"
_LOGGER = logging.getLogger("wyoming_cosyvoice")


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {value!r}")
    return number


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__,
        epilog="Every other option is one of `python -m wyoming_cosyvoice`.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the server's options pass through untouched
    )
    parser.add_argument(
        "--force-tokens",
        type=_positive_int,
        metavar="N",
        help="exactly N speech tokens per sentence (default: until the model ends it)",
    )
    parser.add_argument(
        "--synthetic-voice",
        metavar="TRANSCRIPT",
        help="CosyVoice2: speak in the engine benchmark's synthetic 5-second prompt voice with "
        "this transcript (its language against the text's chooses zero-shot or cross-lingual), "
        "the only voice (default: the built-in voices)",
    )
    return parser


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, int | None]:
    """The server's options and the token count; argparse exits on a bad option."""
    own, server_args = parse_all(argv)
    return server_args, own.force_tokens


def parse_all(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """The launcher's own options and the server's; argparse exits on a bad option."""
    own, rest = build_parser().parse_known_args(argv)
    return own, server_cli.build_parser().parse_args(rest)


def server_config(server_args: argparse.Namespace, force_tokens: int | None) -> ServerConfig:
    """The server's settings from its options, with the fixed token count (None: until EOS).

    Raises ConfigError naming a bad setting.
    """
    config = server_cli.config_from_args(server_args)
    return config if force_tokens is None else replace(config, force_tokens=force_tokens)


def synthetic_voice_loader(config: ServerConfig, transcript: str) -> EngineFactory:
    """The config's loader, except that a CosyVoice2 model gets the engine benchmark's
    synthetic prompt voice (seeded, with ``transcript``) as its only voice."""
    options = load_options(config)

    def load(model_dir: Path, threads: int | None) -> Engine:
        engine: Any = load_cosyvoice(model_dir, threads, **options)
        if family_at(model_dir).voices_from is not None:  # no speakers of its own
            from engine.bench.cosyvoice2 import add_bench_voice

            add_bench_voice(engine, transcript)
        return engine

    return load


def http_settings(args: argparse.Namespace) -> tuple[str, int, bool, tuple[str, ...]] | None:
    """What ``serve`` needs for the HTTP API (None: Wyoming only), as the server's CLI reads it.

    Raises ValueError with the message for a bad combination or origin.
    """
    if args.http_port is None and not args.http_only:
        return None
    if args.http_port is None:
        raise ValueError("--http-only needs --http-port")
    try:
        from wyoming_cosyvoice.http.origin import parse_allowed_origins
    except ImportError as err:
        raise ValueError(f"the HTTP API needs the http extra ({err})") from None

    try:
        origins = parse_allowed_origins(args.http_allow_origin)
    except ValueError as err:
        raise ValueError(f"--http-allow-origin: {err}") from None
    return args.http_host, args.http_port, args.http_only, origins


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    own, server_args = parse_all(argv)
    try:
        config = server_config(server_args, own.force_tokens)
        http = http_settings(server_args)
    except ValueError as err:  # ConfigError included
        sys.stderr.write(f"{PROG}: {err}\n")
        return 2
    logging.basicConfig(
        level=logging.DEBUG if config.debug else logging.INFO, format=config.log_format
    )
    try:
        model_dir = server_cli.resolve_model_dir(config)
    except ModelNotFoundError as err:
        _LOGGER.error("%s", err)
        return 1
    if problem := server_cli.import_engine():
        _LOGGER.error("%s", problem)
        return 1
    factory: EngineFactory = load_cosyvoice  # the config's loader
    if own.synthetic_voice is not None:
        factory = synthetic_voice_loader(config, own.synthetic_voice)
    try:
        return asyncio.run(server_cli.serve(config, model_dir, http, engine_factory=factory))
    except OSError as err:  # e.g. the port is taken
        _LOGGER.error("Cannot listen on %s: %s", config.uri, err)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
