"""A 4-bit LM: group-wise int4 weights, run by the engine's AVX2 kernel or PyTorch's own.

The LM decode step reads every decoder weight once per token; int4 halves what int8 reads.
The int4 format takes the int8 format's layers (engine.core.quantize: q/k/v and gate/up fused, the
output head, the text encoder's blocks) and runs those of :func:`int4_layer_names` (the
feed-forward ones) in 4 bits, the others (``KEPT_INT8``: the head and the attention) in int8.
A 4-bit weight is quantised in groups of ``GROUP_SIZE`` inputs with one scale per group and
output: ``w ≈ scale * q``, ``q`` in [-8, 7]. The scale of
a group is its largest-magnitude weight over -8 (the 16 codes all used), or a little less where
that rounds the group closer, rounded to bfloat16 first so that every kernel computes with the
scale the file holds.

What a prepared file holds per 4-bit layer (engine.core.prepared; the plain parts, packed at load;
an int8 layer's are engine.core.quantize's):

* ``NAME.weight``: uint8 (out, in / 2), two codes ``q + 8`` a byte, the even input's in the
  low nibble (the layout both kernels take);
* ``NAME.weight_scale``: bfloat16 (out, in / GROUP_SIZE);
* ``NAME.bias``: float32 (out,), where the layer has one.

Three kernels compute it (:func:`choose_int4_kernel`):

* ``avx2``: the engine's own (engine/core/native/int4_avx2.cpp), x86-64 with AVX2 and FMA;
  the activations are quantised to int8 per group of 32 inputs on the fly (w4a8) and meet the
  codes in the same integer products as the engine's int8 kernel. Built by setup.py on x86-64.
* ``kleidiai`` (``aten._dyn_quant_pack_4bit_weight`` / ``_dyn_quant_matmul_4bit``): Arm's
  KleidiAI micro-kernels in torch's aarch64 wheels; the activations are quantised to int8 per
  row on the fly (w4a8). Without KleidiAI or the dot-product instructions (Cortex-A72, the
  Raspberry Pi 4) torch runs a scalar reference of the same maths.
* ``int4pack`` (``aten._convert_weight_to_int4pack_for_cpu`` / ``_weight_int4pack_mm_for_cpu``):
  x86, bfloat16 activations (w4a16), the output rounded to bfloat16. Vectorised for AVX-512
  and AVX2 for bfloat16 activations only (float32 ones take a scalar path, 40-70x slower).

Whether the kernel beats int8 here is :func:`int4_is_fast`: docs/dev/int4.md has the
measurements it rests on.
"""

from __future__ import annotations

import functools
import logging
import platform
from collections.abc import Collection, Mapping
from types import ModuleType

import torch
from torch import nn

from engine.core import int8_avx2, native
from engine.core.cpu import ARM_MACHINES, arm_features, read_cpuinfo
from engine.core.quantize import (
    BIAS,
    SCALE,
    WEIGHT,
    float_layer,
    int8_part_specs,
    int8_parts,
    layer_shape,
    pack_lm_int8,
)

_LOGGER = logging.getLogger(__name__)

GROUP_SIZE = 32  # inputs per scale: docs/dev/int4.md (deviation and bytes per group size)
KLEIDIAI = "kleidiai"
INT4PACK = "int4pack"
AVX2 = "avx2"
KERNELS = (KLEIDIAI, INT4PACK, AVX2)
_INNER_K_TILES = 2  # int4pack's packing parameter (the CPU kernel takes 2, 4 or 8)
_INT4PACK_ROWS = 16  # int4pack packs outputs in blocks of this many
_ARM_DOTPROD = "asimddp"
# Each group's scale is the one of these fractions of "peak over -8" with the least squared
# error: clipping the peak a little rounds the rest finer (Gaussian weights, 32 a group: 4 %
# less relative error than the peak's own scale).
_SHRINKS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# The layers (attribute names) the int4 format keeps in int8: the output head and the attention
# projections. On the full-size random-weight LMs they carry most of int4's deviation for a
# small share of the bytes (docs/dev/int4.md: CosyVoice2's attention 5/6 of its next-token KL,
# the head nearly all of v1's).
KEPT_INT8 = (
    "llm_decoder",
    "linear_qkv",
    "linear_out",
    "qkv_proj",
    "o_proj",
)  # /proc/cpuinfo's name of the Arm dot-product instructions


# --- quantising --------------------------------------------------------------------------------


def quantize_groups(
    weight: torch.Tensor, group: int = GROUP_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of a float (out, in) weight: uint8 (out, in / 2), bfloat16
    (out, in / group), as a prepared file stores them."""
    out, inputs = weight.shape
    if inputs % group or group % 2:
        raise ValueError(f"{inputs} inputs do not split into groups of {group}")
    w = weight.detach().float().reshape(out, inputs // group, group)
    peak = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # signed, largest magnitude
    best_q = best_scale = best_err = None
    for shrink in _SHRINKS:
        scale = (peak * (shrink / -8)).to(torch.bfloat16)
        s = scale.float()
        q = (w / torch.where(s != 0, s, 1)).round().clamp(-8, 7)
        err = (q * s - w).square().sum(-1, keepdim=True)
        if best_err is None or best_q is None or best_scale is None:
            best_q, best_scale, best_err = q, scale, err
            continue
        better = err < best_err
        best_q = torch.where(better, q, best_q)
        best_scale = torch.where(better, scale, best_scale)
        best_err = torch.minimum(err, best_err)
    assert best_q is not None and best_scale is not None
    codes = (best_q + 8).to(torch.uint8).reshape(out, inputs)
    scale = best_scale
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), scale.reshape(out, inputs // group).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """The codes ``q + 8`` (uint8, out x in) of a stored weight."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).reshape(packed.shape[0], -1)


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 (out, in) weight a stored int4 weight stands for."""
    q = unpack_codes(packed).float() - 8
    group = q.shape[1] // scales.shape[1]
    return q * scales.float().repeat_interleave(group, dim=1)


def int4_layer_names(
    model: nn.Module, names: list[str], group: int = GROUP_SIZE, kept: Collection[str] = KEPT_INT8
) -> list[str]:
    """Those of the int8 format's layers ``names`` that the int4 format runs in 4 bits: not
    ``kept`` (by attribute name), and with inputs that split into whole groups (every other
    layer of the full-size LMs)."""
    return [
        name
        for name in names
        if name.rpartition(".")[2] not in kept and layer_shape(model, name)[1] % group == 0
    ]


def int4_format_specs(
    model: nn.Module, names: list[str]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The plain parts of the int4 format's quantised layers ``names`` (the int8 format's):
    4-bit where :func:`int4_layer_names` says, int8 elsewhere."""
    four = int4_layer_names(model, names)
    eight = [name for name in names if name not in four]
    return int4_part_specs(model, four) | int8_part_specs(model, eight)


def int4_format_parts(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The plain parts of :func:`int4_format_specs`, quantised now."""
    four = int4_layer_names(model, names)
    eight = [name for name in names if name not in four]
    return int4_parts(model, four) | int8_parts(model, eight)


def pack_int4_format(parts: Mapping[str, torch.Tensor], name: str) -> nn.Module:
    """Layer ``name`` of an int4 file packed for this CPU: 4-bit codes (uint8) or int8."""
    if parts[f"{name}.{WEIGHT}"].dtype == torch.uint8:
        return pack_int4(parts, name)
    return pack_lm_int8(parts, name)  # the int4 format is the LM's


def int4_part_specs(
    model: nn.Module, names: list[str], group: int = GROUP_SIZE
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every plain part of the int4 layers ``names`` (reads no weight)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name in names:
        out, inputs, has_bias = layer_shape(model, name)
        specs[f"{name}.{WEIGHT}"] = ((out, inputs // 2), torch.uint8)
        specs[f"{name}.{SCALE}"] = ((out, inputs // group), torch.bfloat16)
        if has_bias:
            specs[f"{name}.{BIAS}"] = ((out,), torch.float32)
    return specs


def int4_parts(
    model: nn.Module, names: list[str], group: int = GROUP_SIZE
) -> dict[str, torch.Tensor]:
    """Quantise the float layers behind ``names``: their plain parts, keyed as stored."""
    parts: dict[str, torch.Tensor] = {}
    for name in names:
        weight, bias = float_layer(model, name)
        codes, scales = quantize_groups(weight, group)
        parts[f"{name}.{WEIGHT}"], parts[f"{name}.{SCALE}"] = codes, scales
        if bias is not None:
            parts[f"{name}.{BIAS}"] = bias.detach().float().contiguous()
    return parts


# --- the kernels -------------------------------------------------------------------------------


@functools.cache
def _avx2_kernel() -> ModuleType | None:
    """The engine's compiled int4 kernel if it is built and this CPU can run it, else None."""
    return native.load("int4_avx2")


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with W in int4 groups, packed once for one of the kernels.

    Its buffers are what a decode step reads: the packed weight (``packed``), the bias and
    int4pack's scales (engine.bench counts them).
    """

    def __init__(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        kernel: str,
    ) -> None:
        super().__init__()
        if kernel not in KERNELS:
            raise ValueError(f"int4 kernel {kernel!r} is not one of {KERNELS}")
        self.kernel = kernel
        self.out_features, self.in_features = codes.shape[0], 2 * codes.shape[1]
        self.group = self.in_features // scales.shape[1]
        # Packed copies: the layer keeps nothing of a loaded file's mapping.
        kept_bias: torch.Tensor | None = None
        if kernel == AVX2:
            compiled = _avx2_kernel()
            if compiled is None or self.group % GROUP_SIZE:
                raise RuntimeError("the engine's int4 kernel cannot run this layer here")
            self._avx2 = compiled.linear
            # Many rows (a prefill) on an int8 GEMM where it sums exactly: per-channel
            # int8 weights made from these, per-row int8 activations (int4_avx2.cpp).
            self.matmul_rows = int8_avx2.MATMUL_ROWS if int8_avx2.int8_matmul_works() else 0
            # The kernel takes a scale per 32 inputs: a coarser group repeats its scale.
            fine = scales.repeat_interleave(self.group // GROUP_SIZE, dim=1)
            packed = compiled.pack(codes.contiguous(), fine.contiguous())
            blocks = -(-self.out_features // 8)  # the kernel computes whole blocks of 8 outputs
            kept_bias = None if bias is None else native.padded(bias, 8 * blocks)
        elif kernel == KLEIDIAI:  # the bias is applied by the kernel
            fbias = None if bias is None else bias.detach().float().contiguous()
            packed = torch.ops.aten._dyn_quant_pack_4bit_weight(
                codes.contiguous(),
                scales.contiguous(),
                fbias,
                self.group,
                self.in_features,
                self.out_features,
            )
        else:
            # The kernel packs whole blocks of outputs: rows of code 8 (zero) fill the last.
            rows = -self.out_features % _INT4PACK_ROWS
            codes = nn.functional.pad(unpack_codes(codes), (0, 0, 0, rows), value=8)
            scales = nn.functional.pad(scales, (0, 0, 0, rows))
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                codes.to(torch.int32), _INNER_K_TILES
            )
            # (groups, out, 2): scale and zero point of each; the codes are q + 8 and the
            # kernel computes (code - 8) * scale + zero, so the zero points are 0.
            s = scales.t().to(torch.bfloat16)
            scale_zeros = torch.stack((s, torch.zeros_like(s)), dim=-1).contiguous()
            self.scale_zeros: torch.Tensor
            self.register_buffer("scale_zeros", scale_zeros)
            kept_bias = None if bias is None else bias.detach().float().clone()
        self.packed: torch.Tensor
        self.bias: torch.Tensor | None
        self.register_buffer("packed", packed)
        self.register_buffer("bias", kept_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == AVX2:  # any leading shape, float32, one call
            return self._avx2(
                x.float(), self.packed, self.bias, self.out_features, self.matmul_rows
            )
        rows = x.reshape(-1, self.in_features)
        if self.kernel == KLEIDIAI:
            y = torch.ops.aten._dyn_quant_matmul_4bit(
                rows.float().contiguous(),
                self.packed,
                self.group,
                self.in_features,
                self.out_features,
            )
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                rows.to(torch.bfloat16), self.packed, self.group, self.scale_zeros
            )[:, : self.out_features].float()
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group={self.group}, kernel={self.kernel}"
        )


def _kernel_works(kernel: str) -> bool:
    """Whether ``kernel`` packs and computes a small int4 layer here, close to its maths."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(64, 128, generator=gen), torch.randn(3, 128, generator=gen)
    bias = torch.randn(64, generator=gen)
    codes, scales = quantize_groups(weight, 32)
    try:
        with torch.inference_mode():
            y = Int4Linear(codes, scales, bias, kernel)(x)
    except (RuntimeError, NotImplementedError) as err:
        _LOGGER.debug("int4 kernel %s does not work here: %s", kernel, err)
        return False
    exact = x @ dequantize(codes, scales).T + bias
    # The kernels' own rounding (int8 or bfloat16 activations) is ~1 %; a wrong layout is ~100 %.
    return float((y - exact).norm() / exact.norm()) < 0.05


def _candidates(machine: str) -> tuple[str, ...]:
    return (KLEIDIAI,) if machine.lower() in ARM_MACHINES else (AVX2, INT4PACK)


@functools.cache
def choose_int4_kernel() -> str | None:
    """The int4 kernel that works on this CPU (None: none does)."""
    for kernel in _candidates(platform.machine()):
        if _kernel_works(kernel):
            return kernel
    return None


def int4_is_fast(kernel: str | None, machine: str, cpuinfo: str, capability: str) -> bool:
    """Whether ``kernel`` runs a vectorised path here that reads int4 faster than int8 does.

    The engine's AVX2 kernel reads the LM's 4-bit layers about twice as fast as its int8
    kernel reads them in int8. KleidiAI's micro-kernels need the Arm dot-product instructions
    (Cortex-A76 and later); without them torch runs its scalar reference. torch's x86 bfloat16
    kernel is vectorised for AVX2 and AVX-512, but measured with AVX2 it was 2-6x slower than the
    int8 kernels (docs/dev/int4.md): only AVX-512 counts.
    """
    if kernel == AVX2:
        return True
    if kernel == KLEIDIAI:
        features = arm_features(cpuinfo)
        kleidiai = getattr(torch.backends, "kleidiai", None)
        built = kleidiai is not None and bool(kleidiai.is_available())
        return built and machine.lower() in ARM_MACHINES and _ARM_DOTPROD in (features or ())
    if kernel == INT4PACK:
        return capability.upper().startswith("AVX512")
    return False


def int4_fast_here() -> bool:
    """:func:`int4_is_fast` for this process's CPU and kernel."""
    return int4_is_fast(
        choose_int4_kernel(),
        platform.machine(),
        read_cpuinfo(),
        torch.backends.cpu.get_cpu_capability(),
    )


def pack_int4(parts: Mapping[str, torch.Tensor], name: str, kernel: str | None = None) -> nn.Module:
    """Int4 layer ``name`` packed for ``kernel`` (None: this CPU's) from its plain parts."""
    kernel = kernel or choose_int4_kernel()
    if kernel is None:
        raise RuntimeError("no int4 kernel of this torch build works on this CPU")
    return Int4Linear(
        parts[f"{name}.{WEIGHT}"], parts[f"{name}.{SCALE}"], parts.get(f"{name}.{BIAS}"), kernel
    )


def quantize_lm_int4(
    model: nn.Module,
    names: list[str],
    kernel: str | None = None,
    group: int = GROUP_SIZE,
    kept: Collection[str] = KEPT_INT8,
) -> nn.Module:
    """The int4 format on a float model, in place: of the int8 format's layers ``names``, those
    of :func:`int4_layer_names` in 4 bits, the others int8."""
    from engine.core.quantize import quantize_int8

    four = int4_layer_names(model, names, group, kept)
    quantize_int8(model, [name for name in names if name not in four])
    return quantize_int4(model, four, kernel, group)


def quantize_int4(
    model: nn.Module, names: list[str], kernel: str | None = None, group: int = GROUP_SIZE
) -> nn.Module:
    """Swap the Linear layers ``names`` of ``model`` for int4 ones, in place (a fused name
    replaces the layers it stacks, as the int8 format's)."""
    from engine.core.quantize import install_int8_layers

    for name in names:  # one layer at a time: never two float copies of the whole model
        parts = int4_parts(model, [name], group)
        install_int8_layers(model, {name: pack_int4(parts, name, kernel)})
    _LOGGER.info("%s quantised to int4 (%d Linear layers)", type(model).__name__, len(names))
    return model
