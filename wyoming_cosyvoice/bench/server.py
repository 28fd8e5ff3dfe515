"""``python -m wyoming_cosyvoice.bench.server [--force-tokens N] SERVER-OPTIONS``: the Wyoming
server as the benchmark runs it.

The start-up of ``python -m wyoming_cosyvoice`` (settings, model directory, engine, serve until
SIGINT/SIGTERM) with one setting no user needs: every sentence is exactly N speech tokens long.
A model with random weights never samples its end of speech, so without a fixed count each
request would run to the LM's length cap.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from dataclasses import replace

from wyoming_cosyvoice import __main__ as server_cli
from wyoming_cosyvoice.config import ConfigError, ServerConfig
from wyoming_cosyvoice.download import ModelNotFoundError

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
        epilog="Every other option is one of `python -m wyoming_cosyvoice` (HTTP excepted).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # the server's options pass through untouched
    )
    parser.add_argument(
        "--force-tokens",
        type=_positive_int,
        metavar="N",
        help="exactly N speech tokens per sentence (default: until the model ends it)",
    )
    return parser


def server_config(argv: list[str]) -> ServerConfig:
    """The server's settings from its options, with the benchmark's token count.

    Raises ConfigError for a bad setting; argparse exits with a usage line for a bad option.
    """
    own, rest = build_parser().parse_known_args(argv)
    server_args = server_cli.build_parser().parse_args(rest)
    if server_args.http_port is not None or server_args.http_only:
        raise ConfigError("--http-port", "the benchmark's server serves Wyoming only")
    config = server_cli.config_from_args(server_args)
    if own.force_tokens is not None:
        config = replace(config, force_tokens=own.force_tokens)
    return config


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        config = server_config(argv)
    except ConfigError as err:
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
    try:
        return asyncio.run(server_cli.serve(config, model_dir))
    except OSError as err:  # e.g. the port is taken
        _LOGGER.error("Cannot listen on %s: %s", config.uri, err)
        return 1
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
