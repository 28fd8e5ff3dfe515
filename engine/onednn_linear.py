"""Float32 Linear layers run by oneDNN on a weight reordered once at load.

The flow estimator's transformer blocks multiply 70-400 rows by 256-1024-wide weights, ten
passes per chunk. At those sizes torch's default CPU path (``F.linear``, MKL's sgemm) measured
15-27 % slower per estimator pass than oneDNN's matmul on a weight laid out for it in advance
(2026-12-04, AVX-512 host, interleaved A/B in one process: 202 -> 151 ms at 77 frames, 421 ->
320 ms at 206). Same float32 maths; only the summation order differs (≈1e-6 relative).

The reordered weight is a copy in oneDNN's blocked layout, so the checkpoint's float32 pages
are no longer read and are fenced off with the rest (engine.weights): no second resident copy.
Where torch was built without oneDNN the layers stay ``nn.Linear``.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

_LOGGER = logging.getLogger(__name__)

# The row count oneDNN is told to expect when it picks the weight's layout; any count works at
# run time. A streamed chunk's estimator pass sees 70-400 rows (2 CFG rows x frames, halved in
# the U-Net's middle).
_EXPECTED_ROWS = 128


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's matmul on reordered weights."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight  # noqa: B018 - raises when the op is missing
        torch.ops.mkldnn._linear_pointwise  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


class OneDnnLinear(nn.Module):
    """``y = x W^T + b`` through oneDNN, with W reordered once (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                    _EXPECTED_ROWS)
        # A copy: the layer must not keep a view into the mapped checkpoint (fenced off later).
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias,
                                                  "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"bias={self.bias is not None}"


def use_onednn_linears(root: nn.Module, block_type: type[nn.Module]) -> int:
    """Swap every float ``nn.Linear`` inside modules of ``block_type`` for a
    :class:`OneDnnLinear`. Returns how many were swapped (0 without oneDNN)."""
    if not onednn_linear_available():
        _LOGGER.debug("torch has no oneDNN matmul: Linear layers stay on the default path")
        return 0
    swapped = 0
    with torch.no_grad():
        for block in root.modules():
            if not isinstance(block, block_type):
                continue
            for owner in block.modules():
                for name, child in owner.named_children():
                    if type(child) is nn.Linear and child.weight.dtype == torch.float32:
                        setattr(owner, name, OneDnnLinear(child.weight, child.bias))
                        swapped += 1
    return swapped
