"""CPU-hungry neighbour processes, so the benchmark can measure a machine that is not quiet.

A Home Assistant box runs Home Assistant, speech-to-text, other add-ons and often a local LLM
while it speaks. Two kinds of neighbour stand in for them:

* ``spin``: a busy loop in one process, one core's worth of pure compute;
* ``memory``: copies a 64 MB buffer over and over, one core that also keeps the memory bus busy,
  as an LLM generating tokens does.

``python -m engine.bench.neighbours KIND`` runs one until it is killed; ``running(n, kind)``
starts ``n`` of them for the duration of a ``with`` block.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

KINDS = ("spin", "memory")
MEMORY_BUFFER_BYTES = 64 << 20  # well past any L3 cache, so every copy goes to memory


def spin_forever() -> None:
    count = 0
    while True:
        count += 1


def copy_forever() -> None:
    import numpy as np

    source = np.ones(MEMORY_BUFFER_BYTES // 8)
    target = np.empty_like(source)
    while True:
        np.copyto(target, source)
        np.copyto(source, target)


@contextlib.contextmanager
def running(count: int, kind: str = "spin") -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` neighbour processes of ``kind`` for the duration of the block."""
    if kind not in KINDS:
        raise ValueError(f"unknown neighbour kind {kind!r}; one of {', '.join(KINDS)}")
    processes = [
        subprocess.Popen([sys.executable, "-m", "engine.bench.neighbours", kind])
        for _ in range(count)
    ]
    try:
        yield processes
    finally:
        for process in processes:
            process.kill()
        for process in processes:
            process.wait()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in KINDS:
        sys.stderr.write(f"usage: python -m engine.bench.neighbours {{{','.join(KINDS)}}}\n")
        return 2
    spin_forever() if argv[0] == "spin" else copy_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
