"""The int8 HiFT: its residual blocks' convolutions on oneDNN's int8 kernels (``hift_weights:
int8``, an approximation for the fast profiles).

Where a CPU has no native bfloat16 (every AVX2 x86 CPU), the vocoder's float32 convolutions
already run near the CPU's float32 FMA rate; int8 products run about twice as many
multiply-adds a cycle there. The residual blocks hold ≈ 95 % of the vocoder's multiply-adds, so
only their convolutions are swapped; the upsampling, the source convolutions, ``conv_pre`` and
``conv_post`` stay float32, as do the F0 predictor, the source, the STFT and the iSTFT.

* Weights: symmetric int8 per output channel (scale = max |w| / 127), quantised once when the
  prepared file is made and packed for oneDNN at load.
* Activations: asymmetric uint8 per call over the whole input (scale and zero point from its
  minimum and maximum, zero included): the input of a residual convolution is a Snake output
  whose range follows the mel, so no fixed range fits every answer.
* The products are exact integer sums; oneDNN dequantises to float32 and adds the bias. On a
  CPU with AMX a load with these convolutions keeps oneDNN below AMX, where it compiled each
  one anew for every input length (engine.core.runtime.configure_onednn).
* Every residual convolution reads a Snake output: on x86-64 with AVX2 the Snake, the causal
  left padding and the activation's quantisation are one native kernel
  (engine/core/native/snake_avx2.cpp, :meth:`Int8Conv.after_snake`): torch's seven passes
  (mul, sin, square, addcmul, aminmax, quantize, int_repr) become two. It computes the same
  codes but for its own sin (within about an ulp of SLEEF's), which moves a few codes in a
  hundred thousand by one; elsewhere the torch path runs.

The rounding of the two quantisations is what the format costs; the tests bound its deviation
from the float32 vocoder on the same mel (tests/engine_tests/core/test_hift_int8.py).
"""

from __future__ import annotations

import functools
import logging
import platform
import warnings
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core import native
from engine.core.snake import Snake

_LOGGER = logging.getLogger(__name__)

_QMAX_WEIGHT = 63
_QMAX_ACTIVATION = 255
# torch's CPU capabilities whose oneDNN int8 convolutions were measured faster than float32.
_FAST_CAPABILITIES = ("AVX2", "AVX512")


class Int8Conv(nn.Module):
    """A residual block's convolution with int8 weights and per-call uint8 activations.

    Made from a float Conv1d of numeric padding; takes and returns (1, C, 1, L) channels-last
    float32 tensors, as :class:`engine.core.hift.CLConv1d`. A causal convolution's ``left``
    padding (:class:`engine.core.hift.CausalCLConv1d`, CosyVoice3) is kept: zeros on the left
    only, added before the activation is quantised (zero is in every activation's range). Its
    state (``weight`` int8 (O, I, K), ``weight_scale`` and ``bias`` float32 (O,)) is what a
    prepared ``hift.int8`` file holds; the oneDNN packing is made from it by
    :meth:`materialize_derived`.
    """

    weight: Tensor
    weight_scale: Tensor
    bias: Tensor

    def __init__(self, conv: nn.Conv1d) -> None:
        super().__init__()
        self.padding = int(conv.padding[0])  # HiFT's convolutions are built with numbers
        self.left = int(getattr(conv, "left", 0))  # a causal convolution's left-only padding
        self.dilation = conv.dilation[0]
        if conv.stride[0] != 1 or conv.groups != 1 or conv.bias is None:
            raise ValueError("int8 HiFT convolutions are the residual blocks': stride 1, biased")
        w = conv.weight.detach()
        if w.is_meta:
            weight = torch.empty(w.shape, dtype=torch.int8, device="meta")
            scale = torch.empty(w.shape[0], device="meta")
        else:
            weight, scale = quantize_weight(w)
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("bias", conv.bias.detach().float())
        self._packed: Tensor | None = None
        self.materialize_derived()

    def materialize_derived(self) -> None:
        """Pack the int8 weight for oneDNN (after an assigning load replaced it)."""
        if self.weight.is_meta:
            self._packed = None
            return
        weight4d = self.weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)
        # The activation scale and zero point given here only shape the packing: each call
        # passes its own.
        self._packed = torch.ops.onednn.qconv_prepack(
            weight4d,
            self.weight_scale,
            1.0,
            0,
            [1, 1],
            [0, self.padding],
            [1, self.dilation],
            1,
            None,
        )
        self._zero_points = torch.zeros(self.weight.shape[0], dtype=torch.int64)

    def forward(self, x: Tensor) -> Tensor:
        if self.left:
            x = F.pad(x, (self.left, 0))  # keeps the channels-last layout
        return self._conv(*quantize_activation(x))

    def after_snake(self, snake: Snake, x: Tensor) -> Tensor:
        """``self(snake(x))``: where the engine's kernel runs, the Snake, the left padding and
        the activation's quantisation are one call (a few codes in a hundred thousand move by
        one: its sin is its own)."""
        kernel = snake_kernel()
        if kernel is None:
            return self(snake(x))
        return self._conv(*kernel.snake_quantize(x, snake.alpha, self.left))

    def _conv(self, q: Tensor, scale: float, zero_point: int) -> Tensor:
        """The convolution of the uint8 activation ``q`` (padded already on the left if causal)."""
        if self._packed is None:
            raise RuntimeError("int8 convolution used before its weights were loaded")
        return torch.ops.onednn.qconv2d_pointwise(
            q,
            scale,
            zero_point,
            self._packed,
            self.weight_scale,
            self._zero_points,
            self.bias,
            [1, 1],
            [0, self.padding],
            [1, self.dilation],
            1,
            1.0,
            0,
            torch.float32,
            "none",
            [],
            "",
        )


@functools.cache
def snake_kernel() -> ModuleType | None:
    """The engine's Snake + quantisation kernel if it is built and this CPU can run it."""
    return native.load("snake_avx2")


def quantize_weight(weight: Tensor) -> tuple[Tensor, Tensor]:
    """(O, I, K) float → int8 weight (contiguous) and its float32 scale per output channel."""
    w = weight.float()
    scale = w.abs().amax(dim=(1, 2)).clamp(min=1e-12) / _QMAX_WEIGHT
    q = torch.round(w / scale.view(-1, 1, 1)).clamp_(-_QMAX_WEIGHT, _QMAX_WEIGHT)
    return q.to(torch.int8).contiguous(), scale


def quantize_activation(x: Tensor) -> tuple[Tensor, float, int]:
    """``x`` as uint8 with one scale and zero point from its range (zero included)."""
    # Over a flat view: aminmax copies a channels-last tensor to reduce it as NCHW.
    lo_t, hi_t = torch.aminmax(x.permute(0, 2, 3, 1).reshape(-1))
    lo, hi = min(float(lo_t), 0.0), max(float(hi_t), 0.0)
    scale = max(hi - lo, 1e-12) / _QMAX_ACTIVATION
    zero_point = min(_QMAX_ACTIVATION, max(0, round(-lo / scale)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated (for torchao)
        q = torch.quantize_per_tensor(x, scale, zero_point, torch.quint8)
    return q.int_repr(), scale, zero_point


@functools.cache
def int8_conv_fast() -> bool:
    """Whether this CPU runs the int8 HiFT faster than float32, and oneDNN computes it right.

    Measured on x86 with AVX2; other CPUs (Arm: oneDNN's int8 convolutions there were never
    measured; x86 without AVX2) stay float32. A small convolution is checked against float32.
    """
    machine = platform.machine().lower()
    capability = torch.backends.cpu.get_cpu_capability()
    if machine not in ("x86_64", "amd64") or capability not in _FAST_CAPABILITIES:
        return False
    gen = torch.Generator().manual_seed(0)
    conv = nn.Conv1d(16, 16, 3, padding=1)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(16, 16, 3, generator=gen) * 0.1)
    x = torch.randn(1, 16, 64, generator=gen)
    try:
        with torch.inference_mode():
            exact = conv(x)
            x4 = x.unsqueeze(2).contiguous(memory_format=torch.channels_last)
            approx = Int8Conv(conv)(x4).squeeze(2)
    except RuntimeError as err:
        _LOGGER.debug("oneDNN's int8 convolution does not work here: %s", err)
        return False
    return float((approx - exact).norm() / exact.norm()) < 0.05  # int8 rounding: ≈ 1 %
