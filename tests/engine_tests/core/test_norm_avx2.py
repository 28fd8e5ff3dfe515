"""The engine's one-operator RMS norm (engine/core/native/norm_avx2.cpp), which the Qwen2 LM's
RMSNorm runs without autograd: built where it should be, and torch's rms_norm but for the last
bits of the mean of squares (summed in another order)."""

from __future__ import annotations

import platform

import pytest
import torch
import torch.nn.functional as F

from engine.core.cpu import read_cpuinfo
from engine.cosyvoice2 import qwen2

X86_64 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_FMA = X86_64 and {"avx2", "fma"} <= set(read_cpuinfo().split())
pytestmark = pytest.mark.skipif(not AVX2_FMA, reason="the kernel is for x86-64 with AVX2 and FMA")


def test_the_kernel_is_built_on_this_cpu() -> None:
    # script/setup and the add-on image build it on x86-64: without it every decode step of a
    # Qwen2 LM spends milliseconds more on torch's composite rms_norm.
    assert qwen2._norm_kernel() is not None


@pytest.mark.parametrize("shape", [(1, 1, 896), (345, 896), (2, 3, 1024), (4, 13), (1, 0, 8)])
def test_it_computes_torchs_rms_norm(shape: tuple[int, ...]) -> None:
    kernel = qwen2._norm_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=gen) * 5
    weight = torch.randn(shape[-1], generator=gen)
    y = kernel.rms_norm(x, weight, 1e-6)
    expected = F.rms_norm(x, (shape[-1],), weight, 1e-6)
    assert y.shape == x.shape
    # The mean of squares in another summation order: a few float32 ulps of the result.
    torch.testing.assert_close(y, expected, rtol=2e-6, atol=1e-6)


def test_a_non_contiguous_row_and_a_zero_row() -> None:
    kernel = qwen2._norm_kernel()
    assert kernel is not None
    x = torch.randn(8, 64).t()  # (64, 8), not contiguous
    x[3] = 0
    weight = torch.rand(8)
    y = kernel.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (8,), weight, 1e-5), rtol=2e-6, atol=1e-6)
    assert y[3].eq(0).all()


def test_the_lm_norm_runs_it_without_autograd_and_torchs_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = qwen2._norm_kernel()
    assert real is not None
    calls: list[torch.Tensor] = []

    class Counting:
        def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            calls.append(x)
            return real.rms_norm(x, weight, eps)

    monkeypatch.setattr(qwen2, "_norm_kernel", Counting)
    norm = qwen2.RMSNorm(16, 1e-6)
    x = torch.randn(2, 16)
    with torch.inference_mode():
        norm(x)
    assert len(calls) == 1
    y = norm(x.clone().requires_grad_())  # autograd: torch's, differentiable
    assert y.requires_grad and len(calls) == 1
