"""The flow estimator's Linear layers in bfloat16 (the ``flow.bf16`` weight format).

Every Linear of ``decoder.estimator`` (the transformer blocks' projections and feed-forwards,
the time MLP: where the flow's FLOPs are) holds a bfloat16 weight and multiplies bfloat16
inputs; oneDNN accumulates the products in float32 and the result is widened back to float32
before the float32 bias. Everything else (normalisations, attention's softmax, the
convolutions, the encoder) stays float32. Where the CPU has native bfloat16 matrix units
(AVX-512 BF16, AMX, Arm BF16: engine.core.cpu.bf16_native) that halves the weights read and
runs the products on those units; elsewhere torch's bfloat16 products take a slow path, so the
engine loads the format only where native (engine.core.runtime). Without native units the layer
computes the same rounding in float32 (bfloat16 inputs and weights, whose products float32 holds
exactly, summed in float32, the sum rounded to bfloat16): that is how its deviation is measured
on any CPU (engine.bench.flow_solvers --bf16), in seconds instead of hours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.cpu import bf16_native

#: The sub-module whose Linear layers run in bfloat16.
ESTIMATOR = "decoder.estimator"


class Bf16Linear(nn.Module):
    """``y = float32(bf16(x) · bf16(W)ᵀ) + b`` (inference only)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, native: bool | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.weight = nn.Parameter(weight.to(torch.bfloat16), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.native = bf16_native() if native is None else native

    def forward(self, x: Tensor) -> Tensor:
        if self.native:
            y = F.linear(x.to(torch.bfloat16), self.weight)
        else:  # the same rounding, computed in float32
            y = F.linear(x.to(torch.bfloat16).float(), self.weight.float()).to(torch.bfloat16)
        return y.float() if self.bias is None else y.float() + self.bias


def bf16_layer_names(flow: nn.Module) -> list[str]:
    """Dotted names of the Linear layers the bfloat16 format swaps: every one of the estimator."""
    estimator = flow.get_submodule(ESTIMATOR)
    return [
        f"{ESTIMATOR}.{name}"
        for name, module in estimator.named_modules()
        if isinstance(module, nn.Linear)
    ]


def use_bf16_linears(flow: nn.Module) -> nn.Module:
    """Swap the estimator's Linear layers for :class:`Bf16Linear` in place (also on the meta
    device: the prepared file's tensors are then the bfloat16 weights); returns ``flow``."""
    for name in bf16_layer_names(flow):
        owner, _, attr = name.rpartition(".")
        linear = flow.get_submodule(name)
        assert isinstance(linear, nn.Linear)
        setattr(flow.get_submodule(owner), attr, Bf16Linear(linear.weight, linear.bias))
    return flow


def has_bf16_linears(module: nn.Module) -> bool:
    return any(isinstance(sub, Bf16Linear) for sub in module.modules())
