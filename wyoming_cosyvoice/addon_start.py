"""The add-on image's command: ``python3 -m wyoming_cosyvoice.addon_start``.

Under tini (the container's init, PID 1): read ``/data/options.json`` into the server's arguments
(``addon``), create the user folders, announce the server to Home Assistant once it listens
(``addon_discovery``, in a thread), and run the server in this process, so that signals reach it
directly and its exit code is the container's. script/image-test runs the image this way.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlparse

from wyoming_cosyvoice.config import packaged_settings
from wyoming_cosyvoice.home_assistant.addon import (
    DATA_DIR,
    INGRESS_PORT,
    OPTIONS_FILE,
    SHARE_DIR,
    URI,
    options_to_args,
    prepare_dirs,
    read_options,
)
from wyoming_cosyvoice.home_assistant.discovery import SUPERVISOR_URL, start_announcing

# Named, not __name__: run with -m, this module is __main__.
_LOGGER = logging.getLogger("wyoming_cosyvoice.addon_start")


def server_command(args: Sequence[str]) -> list[str]:
    """The server's command line, as ``--print`` shows it (the add-on runs it in-process)."""
    return [sys.executable, "-m", "wyoming_cosyvoice", *args]


def _parse_cli(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m wyoming_cosyvoice.addon_start",
        description="Start the Wyoming CosyVoice server from Home Assistant add-on options.",
    )
    parser.add_argument("--options", type=Path, default=OPTIONS_FILE)
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR)
    parser.add_argument("--share-dir", type=Path, default=SHARE_DIR)
    parser.add_argument("--uri", default=URI, help="overridden by tests to use a free port")
    parser.add_argument(
        "--http-port", type=int, default=INGRESS_PORT, help="the web page's port (tests: any free)"
    )
    parser.add_argument(
        "--supervisor-url", default=SUPERVISOR_URL, help="the Supervisor's API (tests: a stand-in)"
    )
    parser.add_argument(
        "--print", action="store_true", help="print the server command instead of running it"
    )
    return parser.parse_args(argv)


def _hand_logging_to_the_server() -> None:
    """Drop this module's log handler: the server sets up logging with its own level and format
    (``logging.basicConfig`` does nothing while a handler is there)."""
    for handler in logging.root.handlers[:]:
        logging.root.removeHandler(handler)


def main(argv: Sequence[str] | None = None) -> int:
    """The image's command: options → server arguments → announce → run the server here.

    The server runs in this process (tini's only child), so signals reach it directly and its
    exit code is the container's.
    """
    cli = _parse_cli(argv)
    # The server's default format, so that the add-on's log reads as one.
    logging.basicConfig(level=logging.INFO, format=packaged_settings()["server"]["log_format"])
    try:
        options = read_options(cli.options)
        args = options_to_args(options, data_dir=cli.data_dir, share_dir=cli.share_dir,
                               uri=cli.uri, http_port=cli.http_port)  # fmt: skip
    except ValueError as err:
        _LOGGER.error("invalid add-on configuration: %s", err)
        return 2
    if cli.print:
        sys.stdout.write(" ".join(server_command(args)) + "\n")
        return 0
    prepare_dirs(cli.data_dir, cli.share_dir)
    port = urlparse(cli.uri).port
    if port is not None:
        start_announcing(port, supervisor_url=cli.supervisor_url)
    _LOGGER.info("starting the server: %s", " ".join(args))
    _hand_logging_to_the_server()
    from wyoming_cosyvoice.__main__ import main as server_main

    return server_main(args)


if __name__ == "__main__":
    sys.exit(main())
