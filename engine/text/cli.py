"""``python -m engine frontend "text" [--json]``: show how text is normalised and tokenised."""

from __future__ import annotations

import argparse
import json
import logging
import sys

_LOGGER = logging.getLogger(__name__)
DESCRIPTION = "Print the normalised segments of TEXT and their whisper BPE token ids."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The frontend command's arguments; options go before or after the text."""
    parser.add_argument("text", help="text to normalise ('-' reads stdin)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--instruct", action="store_true", help="treat TEXT as instruct text")
    parser.add_argument(
        "--language-tags", action="store_true", help="prefix each segment with <|lang|>"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine frontend", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str]) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Print the segments of ``args.text`` (arguments from :func:`add_arguments`)."""
    from engine.text.errors import TextInputError
    from engine.text.frontend import TextFrontend

    text = sys.stdin.read() if args.text == "-" else args.text
    frontend = TextFrontend(language_tags=args.language_tags)
    try:
        if args.instruct:
            ids = frontend.instruct_ids(text)
            segments = [{"text": frontend.tokenizer.decode(ids), "token_ids": ids}]
        else:
            segments = [{"text": s.text, "token_ids": s.token_ids} for s in frontend.segments(text)]
    except TextInputError as err:
        _LOGGER.error("%s", err)
        return 2
    if args.json:
        sys.stdout.write(json.dumps({"segments": segments}, ensure_ascii=False) + "\n")
        return 0
    if not segments:
        sys.stdout.write("(nothing to say)\n")
    for i, seg in enumerate(segments):
        sys.stdout.write(f"[{i}] {seg['text']}\n    {seg['token_ids']}\n")
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main(sys.argv[1:]))
