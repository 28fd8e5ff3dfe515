"""This machine's physical limits, measured in the same run.

A stage's *bound* is the time it could not beat on this machine: the LM decode step must stream
every weight it multiplies, and its KV cache, from DRAM once per token (bandwidth bound); the flow
estimator and HiFT must execute their FLOPs (compute bound). The work itself is counted on the
loaded model (engine.bench.work); the benchmark reports each stage's time as a multiple of its
bound, which says how much an optimisation could still gain.

* ``mem_bw_gbps``: read bandwidth of a large fp32 array (a reduction, like a GEMV's weight read).
* ``gemv_gbps``: weight bytes per second the LM's own matrix-vector kernels read (int8, int4 or
  fp32, as the LM is loaded) when one row goes through LM-shaped layers, far beyond the caches:
  what a decode step could reach with those kernels if it did nothing but its matrix products.
* ``gemm_gflops``: fp32 matmul throughput at the flow estimator's Linear shapes (CFG batch 2 ×
  172 frames = 344 rows; q/k/v 256→512, out 512→256, FFN 256→1024→256), the faster of torch's
  default kernel and oneDNN on reordered weights.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.core.onednn_layers import OneDnnLinear, onednn_linear_available

_LOGGER = logging.getLogger(__name__)

MEM_BW_BYTES = 720 * 10**6  # ≈ the fp32 LM weights read per token; far beyond any cache
# One LM decoder block's matrix products as (out, in): q/k/v (one fused layer in the int8 and
# int4 LMs, three in the fp32 one), out, FFN in and out. 12.6 M weights in each format; the
# int4 format keeps the attention's in int8 (engine.core.int4.KEPT_INT8).
GEMV_BLOCK_SHAPES = {
    "int8": ((3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)),
    "int4": ((3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)),
    "fp32": ((1024, 1024),) * 4 + ((4096, 1024), (1024, 4096)),
}
GEMV_INT4_LAYERS = 2  # the int4 block's last two (the feed-forward ones) are 4-bit
GEMV_BLOCKS = 8  # 100 MB of int8 (400 MB fp32): three times the 32 MB L3 of the project's VM
GEMM_ROWS = 344  # CFG batch 2 × 172 mel frames (2 s of audio)
GEMM_SHAPES = ((256, 512), (256, 512), (256, 512), (512, 256), (256, 1024), (1024, 256))


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    """Fastest of ``repeats`` runs after one warm-up: the bound is what the machine *can* do."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_mem_bw_gbps(n_bytes: int = MEM_BW_BYTES, repeats: int = 5) -> float:
    """GB/s of a streaming fp32 read (``sum`` over an array much larger than the caches)."""
    data = torch.ones(n_bytes // 4)
    try:
        return n_bytes / _best_time(data.sum, repeats) / 1e9
    finally:
        del data


def _gemv_layer(
    weights: str, weight: torch.Tensor
) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """One LM layer in format ``weights`` and the weight bytes a product reads."""
    from functools import partial

    from engine.core.int4 import pack_int4, quantize_groups
    from engine.core.quantize import lm_int8_linear

    if weights == "int8":
        return lm_int8_linear(weight), weight.numel()
    if weights == "int4":
        codes, scales = quantize_groups(weight)
        parts = {"layer.weight": codes, "layer.weight_scale": scales}
        return pack_int4(parts, "layer"), codes.numel() + scales.numel() * scales.element_size()
    return partial(torch.nn.functional.linear, weight=weight), weight.numel() * 4


def measure_gemv_gbps(*, weights: str, blocks: int = GEMV_BLOCKS, repeats: int = 5) -> float:
    """GB/s of weights read by the LM's matrix-vector kernels (``weights``: the LM's format,
    fp32, int8 or int4): one row through LM-shaped layers."""
    products: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = []
    n_bytes = 0
    shapes = GEMV_BLOCK_SHAPES[weights]
    for _ in range(blocks):
        for index, (out, n_in) in enumerate(shapes):
            four = weights == "int4" and index >= len(shapes) - GEMV_INT4_LAYERS
            # Constant values (the int8 and fp32 kernels' speed does not depend on them) would
            # give a 4-bit layer a single code: seeded random ones there.
            weight = (
                torch.randn(out, n_in, generator=torch.Generator().manual_seed(index))
                if four
                else torch.full((out, n_in), 0.01)
            )
            layer, read = _gemv_layer(
                "int4" if four else "fp32" if weights == "fp32" else "int8", weight
            )
            products.append((layer, torch.full((1, 1, n_in), 0.5)))
            n_bytes += read

    def run() -> None:
        for layer, row in products:
            layer(row)

    with torch.inference_mode():
        return n_bytes / _best_time(run, repeats) / 1e9


def measure_gemm_gflops(rows: int = GEMM_ROWS, repeats: int = 5, inner: int = 10) -> float:
    """GFLOP/s of fp32 products over the flow estimator's shapes, summed like one block: the
    faster of torch's default ``linear`` and oneDNN on reordered weights (the engine's)."""
    generator = torch.Generator().manual_seed(0)
    operands = [
        (torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator))
        for k, n in GEMM_SHAPES
    ]
    flops = inner * sum(2 * rows * k * n for k, n in GEMM_SHAPES)
    kernels: list[list[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]] = [
        [(x, functools.partial(torch.nn.functional.linear, weight=w)) for x, w in operands]
    ]
    if onednn_linear_available():
        kernels.append([(x, OneDnnLinear(w)) for x, w in operands])

    def timed(products: list[tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]]) -> float:
        def run() -> None:
            for _ in range(inner):
                for x, product in products:
                    product(x)

        return _best_time(run, repeats)

    with torch.inference_mode():
        return flops / min(timed(products) for products in kernels) / 1e9


class OtherLoad:
    """CPU time other processes used while the benchmark ran, in cores (0.0 = a quiet machine).

    The box is shared; a figure measured while something else ran is not this engine's speed.
    Busy time of the whole machine (``/proc/stat``) minus our own and our children's CPU time.
    """

    def __init__(self) -> None:
        self._start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float] | None:
        try:
            fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        except OSError:
            return None
        # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        ticks = [int(v) for v in fields[:8]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        usages = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        own = sum(u.ru_utime + u.ru_stime for u in usages)
        return busy, own, time.perf_counter()

    def cores(self) -> float | None:
        """Average number of cores other processes kept busy since construction."""
        end = self._sample()
        if self._start is None or end is None or end[2] <= self._start[2]:
            return None
        other = (end[0] - self._start[0]) - (end[1] - self._start[1])
        return max(0.0, other / (end[2] - self._start[2]))
