"""The engine's AVX2 int8 kernel: built where it should be, and bit-identical to torch's fbgemm
dynamic Linear (the products the int8 LM's tolerances were measured on)."""

from __future__ import annotations

import copy
import os
import platform
import warnings

import pytest
import torch
from conftest import DATA
from teacher_forcing import teacher_forced_logits

from engine.core import int8_avx2
from engine.core.cpu import read_cpuinfo
from engine.core.quantize import (
    Int8Linear,
    int8_layer_names,
    int8_parts,
    pack_int8,
    pack_lm_int8,
    quantize_int8,
    quantize_lm_int8,
)
from engine.cosyvoice1.hparams import load_model_args
from engine.cosyvoice1.llm import TransformerLM

X86_64 = platform.machine().lower() in ("x86_64", "amd64")
AVX2_FMA = X86_64 and {"avx2", "fma"} <= set(read_cpuinfo().split())
needs_kernel = pytest.mark.skipif(not AVX2_FMA, reason="the kernel is for x86-64 with AVX2 and FMA")


@needs_kernel
def test_the_kernel_is_built_and_runs_on_this_cpu() -> None:
    # script/setup and the add-on image build it on x86-64: a build that lost it would fall back
    # to torch's kernel silently, at half the LM's decode speed.
    assert int8_avx2.kernel() is not None


@needs_kernel
def test_the_kernel_runs_on_torchs_threads() -> None:
    # Built without OpenMP, at::parallel_for runs serially: a two-thread product on one core.
    native = int8_avx2.kernel()
    assert native is not None
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert native.threads_in_a_loop() == 2
    finally:
        torch.set_num_threads(before)


def _float_layer(out: int, n_in: int, bias: bool, seed: int) -> torch.nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = torch.nn.Linear(n_in, out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out, n_in, generator=gen) / n_in**0.5)
        if bias:
            layer.bias.copy_(torch.randn(out, generator=gen))
    return layer


def _both(out: int, n_in: int, bias: bool, seed: int) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same float layer as torch's int8 layer and as the kernel's."""
    model = torch.nn.Module()
    model.add_module("layer", _float_layer(out, n_in, bias, seed))
    parts = int8_parts(model, ["layer"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return pack_int8(parts, "layer"), pack_lm_int8(parts, "layer")


@needs_kernel
@pytest.mark.parametrize(
    ("out", "n_in", "bias"),
    [(1152, 896, True), (896, 4864, False), (6564, 896, True), (13, 32, True), (100, 64, False)],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 40])
def test_products_are_bit_identical_to_torchs(out: int, n_in: int, bias: bool, rows: int) -> None:
    reference, ours = _both(out, n_in, bias, seed=out + n_in + rows)
    assert isinstance(reference, Int8Linear)
    assert isinstance(ours, int8_avx2.Avx2Int8Linear)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, n_in, generator=gen) * 3
    with torch.inference_mode():
        assert torch.equal(ours(x), reference(x))
        assert torch.equal(ours.forward_relu(x), reference.forward_relu(x))


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_a_decode_row_is_bit_identical_at_any_thread_count(threads: int) -> None:
    reference, ours = _both(9728, 896, True, seed=3)
    x = torch.randn(1, 1, 896, generator=torch.Generator().manual_seed(5))  # (batch, step, in)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            out = ours(x)
            assert out.shape == (1, 1, 9728)
            assert torch.equal(out, reference(x))
    finally:
        torch.set_num_threads(before)


needs_exact_gemm = pytest.mark.skipif(
    not (AVX2_FMA and int8_avx2.int8_matmul_works()),
    reason="oneDNN sums int8 products exactly only with VNNI or AMX",
)


@needs_exact_gemm
@pytest.mark.parametrize(
    ("out", "n_in", "bias"),
    [(1152, 896, True), (896, 4864, False), (9728, 896, False), (13, 36, True), (100, 100, False)],
)
@pytest.mark.parametrize("rows", [32, 33, 222])
def test_many_rows_on_onednn_are_bit_identical_to_the_kernels(
    out: int, n_in: int, bias: bool, rows: int
) -> None:
    # A prompt's rows take oneDNN's GEMM on the weight read back from the blocks (in slabs
    # of output blocks, a last block part padding, inputs not a whole number of 32-byte rows):
    # the same sums and epilogue as the kernel's own many-row loop.
    reference, ours = _both(out, n_in, bias, seed=out + rows)
    assert isinstance(ours, int8_avx2.Avx2Int8Linear)
    assert ours.matmul_rows == int8_avx2.MATMUL_ROWS <= rows
    kernel_only = copy.deepcopy(ours)
    kernel_only.matmul_rows = 0
    x = torch.randn(rows, n_in, generator=torch.Generator().manual_seed(rows)) * 3
    with torch.inference_mode():
        assert torch.equal(ours(x), kernel_only(x))
        assert torch.equal(ours.forward_relu(x), kernel_only.forward_relu(x))
        assert torch.equal(ours(x), reference(x))


needs_amx = pytest.mark.skipif(
    not (AVX2_FMA and int8_avx2.kernel() is not None and int8_avx2.kernel().amx_ready()),
    reason="AMX's int8 tiles (Intel Xeon since Sapphire Rapids) and Linux's leave to use them",
)


@needs_amx
@pytest.mark.parametrize(
    ("rows", "depth", "channels"), [(1, 64, 1), (33, 896, 1152), (222, 4864, 40), (17, 128, 300)]
)
def test_amx_tiles_give_the_exact_integer_sums(rows: int, depth: int, channels: int) -> None:
    # The many-row GEMM's sums on AMX (rows and channels not whole tiles, codes at ±127, where
    # anything narrower than int32 sums would saturate): the same integers oneDNN's give.
    gen = torch.Generator().manual_seed(rows + channels)
    codes = torch.randint(-127, 128, (rows, depth), dtype=torch.int8, generator=gen)
    weight = torch.randint(-127, 128, (channels, depth), dtype=torch.int8, generator=gen)
    codes[::2] = 127
    weight[::3] = -127
    sums = int8_avx2.kernel().amx_matmul(codes, weight)
    assert sums.dtype == torch.int32
    assert torch.equal(sums.long(), codes.long() @ weight.long().T)


def test_onednn_takes_many_rows_only_where_its_sums_are_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def saturating(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        # what 16-bit pair sums without VNNI do to large products
        return (a.long() @ b.long()).clamp(-(2**15), 2**15 - 1).int()

    assert int8_avx2.sums_exact(lambda a, b: (a.long() @ b.long()).int())
    assert not int8_avx2.sums_exact(saturating)
    int8_avx2.int8_matmul_works.cache_clear()
    try:
        monkeypatch.setattr(int8_avx2, "read_cpuinfo", lambda: "flags : avx2 fma avx512f")
        assert not int8_avx2.int8_matmul_works()  # no VNNI: saturating pairs
    finally:
        int8_avx2.int8_matmul_works.cache_clear()


def test_a_cpu_with_vnni_or_amx_reads_prompts_on_onednn() -> None:
    # Where the sums are exact the prompt must not fall back to the slower loop unnoticed; an
    # ONEDNN_MAX_CPU_ISA below VNNI turns it off (the suite is run so on other CPUs' paths).
    flags = set(read_cpuinfo().split())
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    below_vnni = isa in {"SSE41", "AVX", "AVX2", "AVX512_CORE"}
    expected = AVX2_FMA and bool(flags & {"avx_vnni", "avx512_vnni", "amx_int8"}) and not below_vnni
    assert int8_avx2.int8_matmul_works() == expected


@needs_kernel
def test_a_layer_whose_inputs_do_not_fill_its_blocks_keeps_torchs_kernel() -> None:
    reference, ours = _both(16, 30, True, seed=1)  # 30 inputs: not a multiple of 4
    assert isinstance(ours, Int8Linear)


@needs_kernel
@pytest.mark.parametrize("case", ["sft", "zero_shot"])
def test_an_lm_on_the_kernel_gives_torchs_logits_exactly(case: str) -> None:
    args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml")
    fp32 = TransformerLM(args.llm).eval()
    fp32.load_state_dict(torch.load(DATA / "tiny_model" / "llm.pt", weights_only=True))
    names = int8_layer_names(fp32)
    ours = quantize_lm_int8(copy.deepcopy(fp32))
    reference = quantize_int8(copy.deepcopy(fp32), names)  # torch's packing for every layer
    assert all(isinstance(ours.get_submodule(n), int8_avx2.Avx2Int8Linear) for n in names)
    assert all(isinstance(reference.get_submodule(n), Int8Linear) for n in names)
    fx = torch.load(DATA / "llm_fixtures.pt", weights_only=True)
    # Prompt rows and one-row decode steps, the feed-forward's fused ReLU among them.
    expected = teacher_forced_logits(reference, fx, case)
    assert torch.equal(teacher_forced_logits(ours, fx, case), expected)


def test_without_the_kernel_lm_layers_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    # aarch64, or an x86 CPU without AVX2: the LM keeps torch's int8 layer (fbgemm or QNNPACK).
    monkeypatch.setattr(int8_avx2, "kernel", lambda: None)
    _, layer = _both(16, 32, True, seed=2)
    assert isinstance(layer, Int8Linear)
