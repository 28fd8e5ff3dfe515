"""The server's command line with a stand-in engine whose second chunk never ends.

``python tests/stand_in_server.py SERVER-ARGS...`` runs ``python -m wyoming_cosyvoice`` with
an engine that yields its first chunk at once and then computes for ten minutes, like a long
flow pass on a slow CPU: it looks at its cancel event only to report on stderr that it was
set, and keeps computing. A stop must not wait for it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from fake_surface import FakeSurface

CANCEL_SEEN = "stand-in engine: cancel seen"
# Set by a test: the stand-in creates this file once it is inside its long computation.
COMPUTING_FILE_ENV = "STAND_IN_COMPUTING_FILE"
_COMPUTE_S = 600.0


class StuckEngine(FakeSurface):
    speakers = ["中文女", "英文男"]  # the tiny model's

    def __init__(self, model_dir: Path, threads: int | None = None) -> None:
        pass

    def warmup(self) -> None:
        pass

    def synthesize(
        self, text: str, options: Any, cancel: threading.Event | None = None
    ) -> Iterator[Any]:
        from engine.core.types import AudioChunk

        yield AudioChunk(np.zeros(2205, dtype=np.float32))
        if marker := os.environ.get(COMPUTING_FILE_ENV):
            Path(marker).touch()
        started, reported = time.monotonic(), False
        while time.monotonic() - started < _COMPUTE_S:
            if cancel is not None and cancel.is_set() and not reported:
                sys.stderr.write(CANCEL_SEEN + "\n")
                sys.stderr.flush()
                reported = True
            time.sleep(0.02)
        yield AudioChunk(np.zeros(2205, dtype=np.float32))


def main() -> int:
    from wyoming_cosyvoice.__main__ import main as server_main
    from wyoming_cosyvoice.models import model

    model.engine_loader = lambda config: StuckEngine  # what the real loader would return
    return server_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
