"""Float32 Linear and Conv1d layers run by oneDNN on weights reordered once at load.

The flow estimator's transformer blocks multiply 70-400 rows by 256-1024-wide weights, ten
passes per chunk. At those sizes torch's default CPU path (``F.linear``, MKL's sgemm) measured
15-27 % slower per estimator pass than oneDNN's matmul on a weight laid out for it in advance
(AVX-512 host, interleaved A/B in one process: 202 -> 151 ms at 77 frames, 421 -> 320 ms at
206). Its convolutions are the same story: ``F.conv1d`` hands oneDNN the plain weight,
which it reorders on every call; on a reordered weight a single k3 conv over 35-70 frames took
23-35 % less (:class:`OneDnnConv1d`), a whole float32 pass 3-5 % less. Same float32 maths;
only the summation order differs (≈1e-6 relative).

The reordered weight is a copy in oneDNN's blocked layout; the float32 pages it was read from
go with the load's mapping of the prepared file (engine.core.prepared): no second resident copy.
Where torch was built without oneDNN the layers stay ``nn.Linear`` and ``nn.Conv1d``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
from torch import nn

_LOGGER = logging.getLogger(__name__)

# The row count oneDNN is told to expect when it picks the weight's layout; any count works at
# run time. A streamed chunk's estimator pass sees 70-400 rows (2 CFG rows x frames, halved in
# the U-Net's middle).
_EXPECTED_ROWS = 128
# Likewise the frame count a convolution's weight layout is chosen for (35-200 in a pass).
_EXPECTED_FRAMES = 128


def _has_mkldnn_ops(*names: str) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        for name in names:
            getattr(torch.ops.mkldnn, name)  # raises when the op is missing
    except (AttributeError, RuntimeError):
        return False
    return True


def onednn_linear_available() -> bool:
    """Whether this torch build has oneDNN's matmul on reordered weights."""
    return _has_mkldnn_ops("_reorder_linear_weight", "_linear_pointwise")


def onednn_conv_available() -> bool:
    """Whether this torch build has oneDNN's convolution on reordered weights."""
    return _has_mkldnn_ops("_reorder_convolution_weight", "_convolution_pointwise")


def onednn_linears_faster() -> bool:
    """Whether oneDNN's matmul beats torch's default float32 Linear on this CPU: with AVX-512
    (a 2-core Intel Xeon: 1.2-1.3x on the CosyVoice3 DiT's products at 100-200 rows), where an
    AVX2 Zen 3 measured the same rate on both paths (docs/dev/cosyvoice3-flow.md)."""
    return onednn_linear_available() and torch.backends.cpu.get_cpu_capability() == "AVX512"


class OneDnnLinear(nn.Module):
    """``y = x W^T + b`` through oneDNN, with W reordered once (inference only)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            weight.detach(), _EXPECTED_ROWS
        )
        # A copy: the layer must not keep the load's mapping of the prepared file alive.
        self.bias = None if bias is None else bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )


def _swap_children(
    owners: Iterable[nn.Module], replace: Callable[[nn.Module], nn.Module | None]
) -> int:
    """Set every child of ``owners`` for which ``replace`` returns a module to that module."""
    swapped = 0
    with torch.no_grad():
        for owner in list(owners):
            for name, child in list(owner.named_children()):
                new = replace(child)
                if new is not None:
                    setattr(owner, name, new)
                    swapped += 1
    return swapped


def use_onednn_linears(root: nn.Module, block_type: type[nn.Module]) -> int:
    """Swap every float ``nn.Linear`` inside modules of ``block_type`` for a
    :class:`OneDnnLinear`. Returns how many were swapped (0 without oneDNN)."""
    if not onednn_linear_available():
        _LOGGER.debug("torch has no oneDNN matmul: Linear layers stay on the default path")
        return 0

    def replace(child: nn.Module) -> nn.Module | None:
        if type(child) is nn.Linear and child.weight.dtype == torch.float32:
            return OneDnnLinear(child.weight, child.bias)
        return None

    owners = (
        owner
        for block in root.modules()
        if isinstance(block, block_type)
        for owner in block.modules()
    )
    return _swap_children(owners, replace)


def use_onednn_linears_in_groups(
    root: nn.Module,
    groups: Iterable[Sequence[str]],
    reread: Callable[[Sequence[str]], None] | None = None,
) -> int:
    """Swap the float32 ``nn.Linear`` layers named in ``groups`` (dotted names from ``root``)
    for :class:`OneDnnLinear` ones, a group at a time. ``reread(names)`` is called first for
    each group's layers, to point their weights at a mapping of their own: the pages the
    reordering reads then go with that mapping, and a load never holds every weight twice.
    Returns how many were swapped (0 without oneDNN)."""
    if not onednn_linear_available():
        return 0
    swapped = 0
    with torch.no_grad():
        for group in groups:
            names = [name for name in group if _float_linear(root.get_submodule(name))]
            if reread is not None and names:
                reread(names)
            for name in names:
                layer = cast(nn.Linear, root.get_submodule(name))
                root.set_submodule(name, OneDnnLinear(layer.weight, layer.bias))
                swapped += 1
    return swapped


def _float_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.weight.dtype == torch.float32


class OneDnnConv1d(nn.Module):
    """A zero-padded, ungrouped ``nn.Conv1d`` through oneDNN, weight reordered once (inference).

    The time axis runs as the height of a 2-D convolution with width 1 (oneDNN reorders 2-D and
    3-D weights only). The output is (B, C_out, T) laid out channels-last, i.e. the transpose
    of a contiguous (B, T, C_out): the transformer blocks that follow in the estimator take that
    without a copy, and a channels-last input is what this layer reads fastest.
    """

    @staticmethod
    def supports(conv: nn.Conv1d) -> bool:
        return (
            conv.groups == 1
            and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str)
            and conv.weight.dtype == torch.float32
        )

    def __init__(self, conv: nn.Conv1d, expected_frames: int = _EXPECTED_FRAMES) -> None:
        super().__init__()
        if not self.supports(conv):
            raise ValueError(
                f"only zero-padded, ungrouped float32 convolutions are supported: {conv}"
            )
        self.in_channels, self.out_channels = conv.in_channels, conv.out_channels
        self.kernel_size = conv.kernel_size[0]
        self.padding = [conv.padding[0], 0]
        self.stride = [conv.stride[0], 1]
        self.dilation = [conv.dilation[0], 1]
        # The input size only guides oneDNN's choice of layout; any batch and length work.
        self.packed_weight = torch.ops.mkldnn._reorder_convolution_weight(
            conv.weight.detach().unsqueeze(-1),
            self.padding,
            self.stride,
            self.dilation,
            1,
            [2, conv.in_channels, expected_frames, 1],
        )
        self.bias = None if conv.bias is None else conv.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mkldnn._convolution_pointwise(
            x.unsqueeze(-1),
            self.packed_weight,
            self.bias,
            self.padding,
            self.stride,
            self.dilation,
            1,
            "none",
            [],
            "",
        )
        return y.squeeze(-1)

    def extra_repr(self) -> str:
        return (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride[0]}, padding={self.padding[0]}, dilation={self.dilation[0]}"
        )


def use_onednn_convs(root: nn.Module) -> int:
    """Swap every ``nn.Conv1d`` under ``root`` that :class:`OneDnnConv1d` supports (zero
    padding, no groups, float32; others stay). Returns how many were swapped (0 without
    oneDNN)."""
    if not onednn_conv_available():
        _LOGGER.debug("torch has no oneDNN convolution: Conv1d layers stay on the default path")
        return 0

    def replace(child: nn.Module) -> nn.Module | None:
        if type(child) is nn.Conv1d and OneDnnConv1d.supports(child):
            return OneDnnConv1d(child)
        return None

    return _swap_children(root.modules(), replace)
