"""The int8 HiFT's Snake + activation quantisation kernel (engine/core/native/snake_avx2.cpp):
built where it should be, the torch path's codes but for its own sin, and the torch path where
it does not run.

Where the Snake values are the same the codes are the same to the bit (fbgemm's rounding, ties
included). The kernel's sin differs from SLEEF's by an ulp on a few values in a hundred; a code
moves only when such a value sits on a rounding boundary. Measured on the shapes below: 0–3 codes
in 400 000–640 000 (≤ 5e-6), each by one; the bound is 1e-4. On the tiny v1/v2/v3 vocoders the
int8 waveform moved 0.0004–0.0017 (relative L2, 1 and 2 threads) against the torch path's, its
distance from float32 unchanged to 1e-5 (test_hift_int8.py); the bound here is 0.005.
"""

from __future__ import annotations

import copy
import platform
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_hift_int8 import tiny_vocoder
from torch import Tensor

from engine.core import hift_int8, native
from engine.core.cpu import read_cpuinfo
from engine.core.hift import CausalCLConv1d, CLConv1d
from engine.core.hift_int8 import Int8Conv, int8_conv_fast, quantize_activation
from engine.core.snake import Snake

X86_64 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_FMA = X86_64 and {"avx2", "fma"} <= set(read_cpuinfo().split())
needs_kernel = pytest.mark.skipif(not AVX2_FMA, reason="the kernel is for x86-64 with AVX2 and FMA")

SHAPES = [  # channels, steps, input scale, largest alpha, causal left padding
    (64, 10007, 3.0, 1.0, 0),
    (13, 101, 5.0, 3.0, 4),
    (512, 800, 1.0, 3.0, 0),
    (7, 1, 100.0, 3.0, 2),
    (130, 4000, 30.0, 20.0, 10),
]


def _kernel():  # type: ignore[no-untyped-def]
    kernel = hift_int8.snake_kernel()
    assert kernel is not None
    return kernel


def _case(channels: int, steps: int, scale: float, alpha_max: float) -> tuple[Tensor, Snake]:
    gen = torch.Generator().manual_seed(channels * 7919 + steps)
    x = torch.randn(1, channels, 1, steps, generator=gen) * scale
    snake = Snake(channels)
    with torch.no_grad():
        snake.alpha.copy_(torch.rand(channels, generator=gen) * alpha_max + 0.05)
    return x.contiguous(memory_format=torch.channels_last), snake


def _torch_codes(x: Tensor, snake: Snake, left: int) -> tuple[Tensor, float, int]:
    with torch.inference_mode():
        return quantize_activation(F.pad(snake(x), (left, 0)))


@needs_kernel
def test_the_kernel_is_built_and_runs_on_this_cpu() -> None:
    # script/setup and the add-on image build it on x86-64: a build that lost it would fall back
    # to the torch path silently, ≈ 20 % slower int8 HiFT.
    assert hift_int8.snake_kernel() is not None


@needs_kernel
@pytest.mark.parametrize(("channels", "steps", "scale", "alpha_max", "left"), SHAPES)
def test_the_snake_is_torchs_but_for_its_sin(
    channels: int, steps: int, scale: float, alpha_max: float, left: int
) -> None:
    x, snake = _case(channels, steps, scale, alpha_max)
    with torch.inference_mode():
        want, got = snake(x), _kernel().snake(x, snake.alpha)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    # Each within about an ulp of the exact Snake of the float32 α·x (measured ≤ 1.6 apart).
    ulp = torch.finfo(torch.float32).eps * torch.maximum(x.abs(), want.abs())
    assert float(((got - want).abs() / ulp).max()) < 4
    # The same operations in the same order: most values equal to the bit (measured 93–100 %;
    # an unfused last multiply-add alone moves ≈ 14 %).
    assert float((got == want).float().mean()) > 0.9


@needs_kernel
@pytest.mark.parametrize(("channels", "steps", "left"), [(64, 1000, 0), (13, 77, 6), (3, 5, 1)])
def test_codes_are_torchs_to_the_bit_where_the_snake_is_exact(
    channels: int, steps: int, left: int
) -> None:
    # α = 0: Snake(x) = x exactly on both paths. Values on a 1/32 grid over [−4, 127/32] make the
    # scale 1/32 exactly and put the odd ones on ties (k + ½ steps): half to even, as fbgemm.
    gen = torch.Generator().manual_seed(steps)
    k = torch.randint(-256, 254, (1, channels, 1, steps), generator=gen)
    x = (k.float() / 64).contiguous(memory_format=torch.channels_last)
    x[0, 0, 0, 0], x[0, -1, 0, -1] = -4.0, 127 / 32
    snake = Snake(channels)
    with torch.no_grad():
        snake.alpha.zero_()
    q, scale, zero_point = _kernel().snake_quantize(x, snake.alpha, left)
    want_q, want_scale, want_zero_point = _torch_codes(x, snake, left)
    assert (scale, zero_point) == (want_scale, want_zero_point) == (1 / 32, 128)
    assert q.dtype == torch.uint8 and q.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(q, want_q)


@needs_kernel
@pytest.mark.parametrize(("channels", "steps", "scale", "alpha_max", "left"), SHAPES)
def test_codes_move_by_one_only_where_the_sin_moves_a_rounding(
    channels: int, steps: int, scale: float, alpha_max: float, left: int
) -> None:
    x, snake = _case(channels, steps, scale, alpha_max)
    q, got_scale, zero_point = _kernel().snake_quantize(x, snake.alpha, left)
    want_q, want_scale, want_zero_point = _torch_codes(x, snake, left)
    assert q.shape == want_q.shape == (1, channels, 1, left + steps)
    assert zero_point == want_zero_point
    assert got_scale == pytest.approx(want_scale, rel=1e-6)
    moved = (q.int() - want_q.int()).abs()
    assert int(moved.max()) <= 1
    assert int((moved > 0).sum()) <= 1e-4 * q.numel()
    assert torch.equal(q[..., :left], want_q[..., :left])  # the left padding: the zero point


@needs_kernel
def test_one_and_two_threads_give_the_same_codes() -> None:
    x, snake = _case(256, 3000, 3.0, 3.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernel().snake_quantize(x, snake.alpha, 3)
        torch.set_num_threads(2)
        two = _kernel().snake_quantize(x, snake.alpha, 3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one[0], two[0]) and one[1:] == two[1:]


@needs_kernel
def test_a_bad_activation_is_refused() -> None:
    x, snake = _case(8, 10, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="one alpha per channel"):
        _kernel().snake_quantize(x, snake.alpha[:7], 0)
    with pytest.raises(RuntimeError, match=r"\(1, C, 1, L\)"):
        _kernel().snake(x.squeeze(2), snake.alpha)


needs_int8_and_kernel = pytest.mark.skipif(
    not (AVX2_FMA and int8_conv_fast()), reason="the int8 HiFT runs on the kernel only here"
)


@needs_int8_and_kernel
@pytest.mark.parametrize("family", ["v1", "v2", "v3"])
def test_the_int8_hift_runs_every_residual_snake_on_the_kernel(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    exact, mel, _ = tiny_vocoder(family)
    model = copy.deepcopy(exact)
    model.use_int8()

    def wave() -> Tensor:
        with torch.inference_mode():
            return model.inference(mel, generator=torch.Generator().manual_seed(0))[0]

    kernel, quantize = _kernel(), hift_int8.quantize_activation
    fused_calls, torch_calls = [], []

    def on_kernel(*args: object) -> object:
        fused_calls.append(args)
        return kernel.snake_quantize(*args)

    def on_torch(x: Tensor) -> tuple[Tensor, float, int]:
        torch_calls.append(x)
        return quantize(x)

    monkeypatch.setattr(hift_int8, "quantize_activation", on_torch)
    counting = SimpleNamespace(snake_quantize=on_kernel)
    monkeypatch.setattr(hift_int8, "snake_kernel", lambda: counting)
    fused = wave()
    assert fused_calls and not torch_calls  # every residual convolution took its Snake in
    monkeypatch.setattr(hift_int8, "snake_kernel", lambda: None)
    torch_path = wave()
    assert len(torch_calls) == len(fused_calls)
    # A few codes apart (the kernel's own sin), amplified by the vocoder: 0.0004-0.0032 with
    # oneDNN on AMX, up to 0.0062 on AVX-512 VNNI or AVX-VNNI (where the int8 HiFT caps it, a
    # Zen 4, an N100), at 1 and 2 threads and either ATen path; a wrong Snake is ~100 %.
    assert float((fused - torch_path).norm() / torch_path.norm()) < 0.01


def test_without_the_kernel_an_int8_conv_takes_the_torch_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(hift_int8, "snake_kernel", lambda: None)
    for conv in (CLConv1d(16, 16, 5, dilation=3, padding=6), CausalCLConv1d(16, 16, 5, dilation=3)):
        x, snake = _case(16, 200, 2.0, 2.0)
        int8 = Int8Conv(conv)
        with torch.inference_mode():
            assert torch.equal(int8.after_snake(snake, x), int8(snake(x)))


def test_a_kernel_that_is_not_built_or_cannot_run_is_not_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert native.load("no_such_kernel") is None
    if AVX2_FMA:
        module = native.load("snake_avx2")
        assert module is not None
        monkeypatch.setattr(module, "supported", lambda: False)
        assert native.load("snake_avx2") is None
