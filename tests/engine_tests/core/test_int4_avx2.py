"""The engine's AVX2 int4 kernel (engine/core/native/int4_avx2.cpp): built where it should be,
the activations quantised as it says, and its integer products and group scales computed
exactly. How close the int4 LM stays to float32 is test_int4.py's, for every kernel."""

from __future__ import annotations

import platform

import pytest
import torch

from engine.core import int4, int8_avx2
from engine.core.cpu import read_cpuinfo
from engine.core.int4 import AVX2, Int4Linear, dequantize, quantize_groups

X86_64 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_FMA = X86_64 and {"avx2", "fma"} <= set(read_cpuinfo().split())
pytestmark = pytest.mark.skipif(not AVX2_FMA, reason="the kernel is for x86-64 with AVX2 and FMA")


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Small layers: a second thread only contends (the thread tests set their own)."""


def _kernel():  # type: ignore[no-untyped-def]
    kernel = int4._avx2_kernel()
    assert kernel is not None
    return kernel


def test_the_kernel_is_built_and_chosen_on_this_cpu() -> None:
    # script/setup and the add-on image build it on x86-64: without it an int4 LM falls back to
    # int8 (torch's int4 kernel is slower than int8 on AVX2).
    assert int4._avx2_kernel() is not None
    assert int4.choose_int4_kernel() == AVX2
    assert int4.int4_fast_here()


def test_activations_are_quantised_per_group_of_32_to_symmetric_int8() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=gen) * torch.tensor([1.0, 1e-3, 50.0]).repeat_interleave(32)
    x[1, 32:64] = 0  # an all-zero group: scale 0, codes 0
    x[2, 0] = 127 * 0.5  # ties round to even: with peak 127, x / scale lands on k + 0.5
    x[2, 1:32] = torch.linspace(-126.5, 30.5, 31)
    codes, scales = _kernel().quantize_activations(x)
    peak = x.reshape(3, 3, 32).abs().amax(-1)
    assert torch.equal(scales, peak / 127)
    inverse = torch.where(peak > 0, 127 / peak, torch.zeros_like(peak))
    expected = torch.round(x * inverse.repeat_interleave(32, 1))  # half to even, as vcvtps2dq
    assert torch.equal(codes, expected.to(torch.int8))
    assert codes[1, 32:64].eq(0).all() and scales[1, 1] == 0


def _exact(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64: the kernel's int8 activations against the stored
    codes, each group's integer sum scaled by both scales."""
    q, sx = _kernel().quantize_activations(x.reshape(-1, x.shape[-1]))
    w = int4.unpack_codes(codes).double() - 8
    out, inputs = w.shape
    groups = inputs // 32
    dots = torch.einsum(
        "rgk,ogk->rog", q.double().reshape(-1, groups, 32), w.reshape(out, groups, 32)
    )
    return (dots * scales.double()[None] * sx.double()[:, None, :]).sum(-1)


@pytest.mark.parametrize(
    ("out", "inputs", "rows"),
    [
        (8, 32, 1),  # one block, one group
        (13, 64, 1),  # a part block
        (200, 96, 1),  # 25 blocks: four streams and a tail
        (4097, 64, 1),  # the v1 head's width
        (96, 256, 2),
        (37, 128, 5),  # a row group of 4 and one of 1
        (300, 896, 37),  # tiles, every row group size
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_the_products_are_the_integer_sums_scaled(
    out: int, inputs: int, rows: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(out + inputs + rows)
    weight = torch.randn(out, inputs, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    x = torch.randn(rows, inputs, generator=gen)
    codes, scales = quantize_groups(weight)
    layer = Int4Linear(codes, scales, b, AVX2)
    layer.matmul_rows = 0  # the kernel's own loops at every row count (oneDNN's: below)
    with torch.inference_mode():
        y = layer(x)
    expected = _exact(x, codes, scales) + (0 if b is None else b.double())
    # float32 sums of a few group products: rounding only (a wrong nibble or scale is ~100 %)
    assert y.shape == (rows, out)
    torch.testing.assert_close(
        y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
    )


def test_the_extremes_stay_inside_the_integer_sums() -> None:
    # Codes 0 and 15 against activations at +-127 in every pattern: the largest partial sums the
    # int16 lanes hold; a saturation or overflow would be far from the exact products.
    inputs = 256
    codes_full = torch.zeros(16, inputs, dtype=torch.uint8)
    codes_full[0::4] = 0
    codes_full[1::4] = 15
    codes_full[2::4, 0::2] = 15
    codes_full[3::4, : inputs // 2] = 15
    packed = codes_full[:, 0::2] | (codes_full[:, 1::2] << 4)
    scales = torch.ones(16, inputs // 32, dtype=torch.bfloat16)
    x = torch.ones(4, inputs) * 127.0  # activation scale 1: every product an exact integer
    x[1] = -127.0
    x[2, 0::2] = -127.0
    x[3, : inputs // 2] = -127.0
    with torch.inference_mode():
        y = Int4Linear(packed, scales, None, AVX2)(x)
    exact = x.double() @ dequantize(packed, scales).double().T
    assert torch.equal(y.double(), exact)  # integers: exact in float32


def test_a_coarser_group_repeats_its_scale() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(24, 256, generator=gen), torch.randn(3, 256, generator=gen)
    codes, scales = quantize_groups(weight, 128)
    with torch.inference_mode():
        y = Int4Linear(codes, scales, None, AVX2)(x)
    fine = scales.repeat_interleave(4, dim=1)
    torch.testing.assert_close(y.double(), _exact(x, codes, fine), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 6])
def test_two_threads_compute_the_same_outputs(rows: int) -> None:
    gen = torch.Generator().manual_seed(4)
    weight, x = torch.randn(1000, 128, generator=gen), torch.randn(rows, 128, generator=gen)
    layer = Int4Linear(*quantize_groups(weight), None, AVX2)
    before = torch.get_num_threads()
    try:
        with torch.inference_mode():
            torch.set_num_threads(1)
            one = layer(x)
            torch.set_num_threads(2)
            two = layer(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)  # each output is one thread's, in one order


def _requantised(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel int8 weights (as float) and channel scales the many-row path computes
    from a layer's codes and group scales, in the kernel's float32 operations."""
    s = scales.float()
    peak = s.abs().amax(1)
    channel = peak * torch.tensor(8.0 / 127.0)
    inverse = torch.where(peak > 0, 1.0 / channel, torch.zeros_like(channel))
    ratio = (s * inverse[:, None]).repeat_interleave(32, dim=1)
    return torch.round((int4.unpack_codes(codes).float() - 8) * ratio), channel


@pytest.mark.skipif(
    not int8_avx2.int8_matmul_works(), reason="oneDNN sums int8 exactly only with VNNI or AMX"
)
@pytest.mark.parametrize(
    ("out", "inputs", "rows"), [(300, 896, 37), (13, 4864, 32), (9, 96, 222), (1300, 896, 40)]
)
def test_many_rows_take_per_channel_int8_weights_and_per_row_activations(
    out: int, inputs: int, rows: int
) -> None:
    # A prefill on oneDNN's int8 GEMM: the 4-bit weights requantised per channel, each
    # activation row quantised symmetrically; integer sums, scaled by both scales.
    gen = torch.Generator().manual_seed(out + rows)
    weight = torch.randn(out, inputs, generator=gen)
    weight[0] = 0  # a channel of zeros: scale 0
    b = torch.randn(out, generator=gen)
    x = torch.randn(rows, inputs, generator=gen) * 3
    x[1] = 0  # a row of zeros
    codes, scales = quantize_groups(weight)
    layer = Int4Linear(codes, scales, b, AVX2)
    assert layer.matmul_rows == int8_avx2.MATMUL_ROWS <= rows
    with torch.inference_mode():
        y = layer(x)
    w8, channel = _requantised(codes, scales)
    assert w8.abs().max() <= 127
    peak = x.abs().amax(1)
    qx = torch.round(x * torch.where(peak > 0, 127 / peak, torch.zeros_like(peak))[:, None])
    both = (channel[None, :] * (peak / 127)[:, None]).double()
    expected = (qx.double() @ w8.double().T) * both + b.double()
    torch.testing.assert_close(
        y.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max())
    )
    # What the path rounds beside int4 itself: at most a few times the kernel's own rounding
    # (≈ 1 % of the products against 0.5 %), far inside int4's ≈ 8 % from the float weights.
    layer.matmul_rows = 0
    exact = x.double() @ dequantize(codes, scales).double().T + b.double()
    with torch.inference_mode():
        own = layer(x)
    assert float((y - exact).norm()) < 3 * float((own - exact).norm())
