"""This machine's physical limits, measured in the same run, and the cost of each stage.

A stage's *bound* is the time it could not beat on this machine: the LM decode step must stream
every weight it multiplies from DRAM once per token (bandwidth bound); the flow estimator and HiFT
must execute their FLOPs (compute bound). The benchmark reports each stage's time as a multiple
of its bound, which says how much an optimisation could still gain.

* ``mem_bw_gbps``: read bandwidth of a large fp32 array (a reduction, like a GEMV's weight read).
* ``gemv_gbps``: weight bytes per second the LM's own matrix-vector kernel reads (fbgemm int8 or
  fp32, as the LM is loaded) when one row goes through LM-shaped layers, far beyond the caches:
  what a decode step could reach with that kernel if it did nothing but its matrix products.
* ``gemm_gflops``: fp32 matmul throughput at the flow estimator's Linear shapes (CFG batch 2 ×
  172 frames = 344 rows; q/k/v 256→512, out 512→256, FFN 256→1024→256), the faster of torch's
  default kernel and oneDNN on reordered weights.
* LM bytes per token are counted on the loaded model, in the weight format it actually uses.
* Flow and HiFT FLOPs are counted with ``torch.utils.flop_counter`` on the loaded modules, on the
  same token count as the timed request (attention is quadratic in it), attention included.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.bench.timers import StageEvent, StageTimer
from engine.core.onednn_layers import OneDnnLinear, onednn_linear_available

_LOGGER = logging.getLogger(__name__)

MEM_BW_BYTES = 720 * 10**6  # ≈ the fp32 LM weights read per token; far beyond any cache
# One LM decoder block's matrix products as (out, in): q/k/v (one fused layer in the int8 LM,
# three in the fp32 one), out, FFN in and out. 12.6 M weights either way.
GEMV_BLOCK_SHAPES = {
    "int8": ((3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)),
    "fp32": ((1024, 1024),) * 4 + ((4096, 1024), (1024, 4096)),
}
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


def measure_gemv_gbps(*, int8: bool, blocks: int = GEMV_BLOCKS, repeats: int = 5) -> float:
    """GB/s of weights read by the LM's matrix-vector kernel: one row through LM-shaped layers."""
    from functools import partial

    from engine.core.quantize import int8_linear

    products: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]] = []
    n_bytes = 0
    for _ in range(blocks):
        for out, n_in in GEMV_BLOCK_SHAPES["int8" if int8 else "fp32"]:
            # Constant values: these kernels' speed does not depend on them.
            weight = torch.full((out, n_in), 0.01)
            layer = (
                int8_linear(weight) if int8 else partial(torch.nn.functional.linear, weight=weight)
            )
            products.append((layer, torch.full((1, 1, n_in), 0.5)))
            n_bytes += weight.numel() * (1 if int8 else weight.element_size())

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


# --- LM weight bytes per decode step --------------------------------------------------------


def _module_bytes(module: nn.Module) -> int:
    """Bytes of the weights a module multiplies with, in the stored format (fp32, int8, ...)."""
    packed = getattr(module, "_packed_params", None)
    weight_of, bias_of = getattr(module, "weight", None), getattr(module, "bias", None)
    if packed is not None and callable(weight_of) and callable(bias_of):
        # torch.ao dynamic-quantized Linear: the weight lives in an opaque packed blob.
        weight, bias = weight_of(), bias_of()
        size = weight.numel() * weight.element_size()
        return size + (bias.numel() * bias.element_size() if bias is not None else 0)
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(
        t.numel() * t.element_size()
        for t in tensors
        if t.is_floating_point() or t.dtype in (torch.int8, torch.uint8, torch.qint8, torch.quint8)
    )


def lm_weight_bytes_per_token(llm: nn.Module) -> int:
    """Weight bytes one decode step must read: the LM decoder stack, its input layer and head.

    Counted on the official sub-modules ``llm`` (v1: 14 layers + input layer; CosyVoice2: the
    Qwen2 stack) and ``llm_decoder``. ``linear_pos`` is left out: its projection depends only on
    positions, so an efficient engine reads a precomputed table instead (like the K cache, not a
    per-token weight read). So is CosyVoice2's ``lm_head``: the backbone's text head, which the
    speech LM never computes.
    Positional tables and other buffers that are not module weights are not counted either.
    """
    parts = [m for name in ("llm", "llm_decoder") if (m := getattr(llm, name, None)) is not None]
    if not parts:
        raise ValueError("LM has no 'llm'/'llm_decoder' sub-modules to count weights of")
    seen: set[int] = set()
    total = 0
    for part in parts:
        for name, module in part.named_modules():
            if name.split(".")[-1] in ("linear_pos", "lm_head") or id(module) in seen:
                continue
            seen.add(id(module))
            if isinstance(module, (nn.Linear, nn.LayerNorm)) or hasattr(module, "_packed_params"):
                total += _module_bytes(module)
    return total


# --- FLOPs of the flow and HiFT per second of audio ------------------------------------------


@dataclass(frozen=True)
class StageFlops:
    """FLOPs per second of audio of the flow (at the profile's steps) and of HiFT."""

    flow_gflop_per_audio_s: float
    hift_gflop_per_audio_s: float
    estimator_mflop_per_frame_step: float  # per ODE step, both CFG branches (300M: 172.4)


def _cpu_attention_flops(
    query_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
    value_shape: tuple[int, ...],
    *args: object,
    **kwargs: object,
) -> int:
    """Q·Kᵀ and P·V of torch's CPU attention kernel, which the FLOP counter does not know.

    Without it the flow's attention, quadratic in the chunk length, would be missing from its
    bound (a third of the estimator's time on an 8-second utterance).
    """
    *batch, t_q, d = query_shape
    t_k, d_v = key_shape[-2], value_shape[-1]
    rows = 1
    for size in batch:
        rows *= size
    return 2 * rows * t_q * t_k * (d + d_v)


def _packed_linear_flops(
    input_shape: tuple[int, ...], *args: object, out_shape: tuple[int, ...], **kwargs: object
) -> int:
    """The engine's Linear layers on packed weights (the int8 flow's, the float flow's oneDNN
    ones), which the FLOP counter does not know.

    Without it the flow would count only its convolutions and attention, and its bound would
    shrink by three quarters. Counted as the float product it replaces.
    """
    return 2 * math.prod(input_shape) * out_shape[-1]


_EXTRA_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.quantized.linear_dynamic: _packed_linear_flops,
}
if onednn_linear_available():
    _EXTRA_FLOPS[torch.ops.mkldnn._linear_pointwise] = _packed_linear_flops


def count_stage_flops(
    run_chunk: Callable[[int], object], timer: StageTimer, n_timesteps: int
) -> StageFlops:
    """Count FLOPs by running one vocoder chunk with 1 and with 2 ODE steps.

    ``run_chunk(steps)`` runs flow + HiFT once on a fixed token window through the timed model
    methods. The difference between 2 and 1 steps isolates one estimator pass from the flow
    encoder, so the count scales to any number of steps without running all of them.
    """
    from torch.utils.flop_counter import FlopCounterMode

    runs: dict[int, tuple[StageEvent, StageEvent]] = {}
    for steps in (1, 2):
        timer.reset()
        with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as counter:
            timer.counter = counter
            try:
                run_chunk(steps)
            finally:
                timer.counter = None
        runs[steps] = (timer.of("flow")[-1], timer.of("hift")[-1])
    timer.reset()
    (flow1, hift1), (flow2, _) = runs[1], runs[2]
    per_step = flow2.flops - flow1.flops
    encoder = flow1.flops - per_step
    frames = flow1.audio_s * timer.sample_rate / timer.samples_per_frame
    return StageFlops(
        flow_gflop_per_audio_s=(encoder + n_timesteps * per_step) / flow1.audio_s / 1e9,
        hift_gflop_per_audio_s=hift1.flops / hift1.audio_s / 1e9,
        estimator_mflop_per_frame_step=per_step / frames / 1e6,
    )
