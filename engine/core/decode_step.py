"""An LM's decode step through all of its layers in one native call
(engine/core/native/decode_step_avx2.cpp), where every layer it runs is one of the engine's
kernels.

A decode step is ~20 small operators per layer around the matrix products; dispatched from
Python they cost about two thirds of the time of a CosyVoice2 step's int4 products. The native
step runs the same operators in the same order (the engine's kernels and torch's own), so its
results are bit for bit the Python path's; the families keep that path for every other case
(float32 layers, other kernels, autograd) and as the reference the tests hold it to.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import torch
from torch import nn

from engine.core import native
from engine.core.decode_attention import kernel_runs as attention_runs
from engine.core.int4 import AVX2, Int4Linear
from engine.core.int8_avx2 import Avx2Int8Linear


@functools.cache
def kernel() -> ModuleType | None:
    """The compiled step, where built and this CPU runs the kernels it calls."""
    step = native.load("decode_step_avx2")
    # The step calls the other kernels as torch operators: importing them registers those.
    kernels = ("int8_avx2", "int4_avx2", "norm_avx2", "attention_avx2")
    if step is None or any(native.load(name) is None for name in kernels):
        return None
    return step


def native_linear(module: nn.Module, relu: bool = False) -> Any | None:
    """The native step's handle on an LM layer ``module``, or None where it is not one of the
    engine's kernels (float32, QNNPACK, KleidiAI, torch's int4pack)."""
    step = kernel()
    if step is None:
        return None
    if isinstance(module, Avx2Int8Linear):
        return step.Int8Linear(
            module.blocks, module.rowsum, module.scale, module.bias, module.out_features, relu
        )
    if isinstance(module, Int4Linear) and module.kernel == AVX2 and not relu:
        return step.Int4Linear(module.packed, module.bias, module.out_features)
    return None


def runs(x: torch.Tensor, kv: torch.Tensor, head_size: int) -> bool:
    """Whether a decode step of the row ``x`` on the cache ``kv`` with heads of ``head_size``
    may run natively: float32 on the CPU without autograd, heads the attention kernel takes."""
    return (
        kernel() is not None
        and x.dtype == kv.dtype == torch.float32
        and x.device.type == kv.device.type == "cpu"
        and not torch.is_grad_enabled()
        and attention_runs(head_size)
    )
