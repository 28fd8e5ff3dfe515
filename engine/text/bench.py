"""Per-call cost of the text frontend: ``python -m engine.text.bench [--n 200] [TEXT]``."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

from engine.text.frontend import TextFrontend

BENCH_TEXT = "您好，您咨询的iPhone15 Pro壳子有现货，支持顺丰次日达，现在下单还送钢化膜。"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.text.bench")
    parser.add_argument("text", nargs="?", default=BENCH_TEXT)
    parser.add_argument("--n", type=int, default=200, help="timed calls")
    args = parser.parse_args(argv)

    t0 = time.perf_counter()
    frontend = TextFrontend()
    frontend.warm_up()
    load_s = time.perf_counter() - t0
    for _ in range(10):
        frontend.segments(args.text)
    times, cpu = [], []
    for _ in range(args.n):
        t, c = time.perf_counter(), time.thread_time()
        segs = frontend.segments(args.text)
        cpu.append((time.thread_time() - c) * 1000)
        times.append((time.perf_counter() - t) * 1000)
    times.sort()
    cpu.sort()
    sys.stdout.write(
        f"text: {args.text}\n"
        f"segments: {[s.text for s in segs]}\n"
        f"first load + warm-up: {load_s * 1000:.0f} ms\n"
        f"per call over {args.n} calls: median {statistics.median(times):.2f} ms, "
        f"p90 {times[int(0.9 * len(times))]:.2f} ms, min {times[0]:.2f} ms (wall clock)\n"
        # CPU time of this thread: what the call costs when it is not waiting for a core.
        f"CPU time per call: median {statistics.median(cpu):.2f} ms, "
        f"p90 {cpu[int(0.9 * len(cpu))]:.2f} ms\n"
    )
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main(sys.argv[1:]))
