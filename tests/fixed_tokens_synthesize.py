"""``python -m wyoming_cosyvoice synthesize`` with a fixed number of speech tokens per sentence.

``python tests/fixed_tokens_synthesize.py N ARGS...`` runs the command exactly as a user types
it, except that every sentence is N speech tokens long: a random-weight model never ends an
utterance by itself, and fixed-length audio keeps the tests short.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from wyoming_cosyvoice import synthesize  # noqa: E402


def with_fixed_tokens(tokens: int) -> None:
    """Make ``synthesize.main`` run every sentence with ``tokens`` speech tokens."""
    settings = synthesize.settings

    def fixed(args: Any) -> Any:
        return replace(settings(args), force_tokens=tokens)

    synthesize.settings = fixed  # type: ignore[assignment]


if __name__ == "__main__":
    with_fixed_tokens(int(sys.argv[1]))
    sys.exit(synthesize.main(sys.argv[2:]))
