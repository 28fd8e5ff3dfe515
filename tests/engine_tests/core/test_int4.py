"""The int4 LM (engine.core.int4): group-wise quantisation, torch's int4 kernels, the prepared file,
the fallback where no kernel works, and the setting that chooses it.

The bound a layer is held to (docs/dev/int4.md): rounding leaves each weight an error e; for an
input x the output error of row j is sum_k e_jk x_k, whose square is on average
sum_k e_jk^2 x_k^2 (the cross terms cancel: the rounding remainders are not aligned with x). The
error over a layer's outputs is the root of a sum of such terms, one per output: with 32 or more
outputs it stays within 1.5x of the prediction's root (a chi-square of >= 32 degrees of freedom
over its mean exceeds 2.25 with probability < 1e-6). The kernel's own rounding comes on top
(bfloat16 activations and output for int4pack, int8 activations for KleidiAI) and is checked
apart, against the stored weights computed exactly.
"""

from __future__ import annotations

import copy
import logging
import platform
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DATA, TESTS
from safetensors import safe_open
from teacher_forcing import teacher_forced_logits
from torch import nn

from engine.core import int4
from engine.core.cpu import read_cpuinfo
from engine.core.int4 import (
    AVX2,
    GROUP_SIZE,
    INT4PACK,
    KLEIDIAI,
    Int4Linear,
    dequantize,
    int4_is_fast,
    int4_layer_names,
    quantize_groups,
    quantize_int4,
    quantize_lm_int4,
)
from engine.core.prepared import PREPARED_DIR
from engine.core.quantize import float_layer, int8_layer_names, next_token_kl
from engine.core.runtime import setup_cpu
from engine.cosyvoice1.engine import CosyVoiceEngine
from engine.cosyvoice1.hparams import load_model_args
from engine.cosyvoice1.llm import TransformerLM

TINY_MODEL = DATA / "tiny_model"
CPUINFO = TESTS / "aarch64"
ON_ARM = platform.machine().lower() in ("aarch64", "arm64")
AVX2_FMA = not ON_ARM and {"avx2", "fma"} <= set(read_cpuinfo().split())
# The kernels that must work on this machine: KleidiAI's op (its reference where the wheel has
# no KleidiAI) everywhere, int4pack on x86, the engine's own on x86 with AVX2 and FMA.
KERNELS_HERE = (
    (KLEIDIAI,) if ON_ARM else (KLEIDIAI, INT4PACK, AVX2) if AVX2_FMA else (KLEIDIAI, INT4PACK)
)
# Relative error of a kernel against the stored weights computed exactly in float32: bfloat16
# activations and output (int4pack: 2 x 2^-9 each, rounded up) or int8 activations, one scale a
# row (KleidiAI: half a step of 1/255 of the row's range, ~0.7 % for Gaussian rows) or a group
# of 32 (avx2: half a step of 1/127 of the group's peak, ~0.5 % for Gaussian rows).
KERNEL_ROUNDING = {INT4PACK: 2**-7, KLEIDIAI: 0.02, AVX2: 0.02}
MARGIN = 1.5  # see the module docstring
# Next-token KL(fp32 || int4 format) of the tiny v1 LM over the fixtures' teacher-forced steps:
# it measures 2.8e-5 to 3.0e-5 nats on average, 4e-5 at most (both kernels; int8: 2.2e-5),
# bounded with a margin like the int8 test's (engine.bench.lm_int4 prints the full-size figures).
MAX_MEAN_KL = 1e-3
MAX_STEP_KL = 5e-3


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Tiny tensors: a second thread only contends."""


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def predicted_error(weight: torch.Tensor, stored: torch.Tensor, x: torch.Tensor) -> float:
    """The root of sum_j sum_k e_jk^2 x_k^2 over every row of ``x`` (module docstring)."""
    e2 = (stored - weight).square()
    return float((x.square() @ e2.T).sum().sqrt())


# --- quantising --------------------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64, 128])
def test_each_group_rounds_at_least_as_close_as_its_peak_scale(group: int) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 512, generator=gen) * torch.rand(64, 1, generator=gen)
    weight[3, :group] = 0  # an all-zero group: scale 0, exact
    codes, scales = quantize_groups(weight, group)
    assert codes.dtype == torch.uint8 and codes.shape == (64, 256)
    assert scales.dtype == torch.bfloat16 and scales.shape == (64, 512 // group)
    stored = dequantize(codes, scales)
    err = (stored - weight).reshape(64, -1, group).square().sum(-1)
    peak = weight.reshape(64, -1, group).abs().amax(-1)
    # Rounding to the nearest step of peak / 8 (its bfloat16 rounding: 2^-8 more) errs by at
    # most half a step a weight; the chosen scale errs no more in total.
    half_step = peak / 8 * (1 + 2**-8) / 2
    assert (err <= group * half_step.square() * (1 + 1e-5)).all()
    assert stored[3, :group].eq(0).all()
    # Gaussian weights: 32 a group round to 8 % of the weights' norm (docs/dev/int4.md).
    gaussian = torch.randn(256, 1024, generator=gen)
    rel = _relative(dequantize(*quantize_groups(gaussian, group)), gaussian)
    assert 0.05 < rel < {32: 0.09, 64: 0.10, 128: 0.11}[group]


def test_a_layer_whose_inputs_do_not_split_into_groups_is_refused() -> None:
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_groups(torch.randn(4, 48), 32)


# --- the kernels -------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", KERNELS_HERE)
@pytest.mark.parametrize(("out", "inputs", "bias"), [(96, 256, True), (4097, 64, False)])
def test_a_kernel_computes_the_stored_weights(
    kernel: str, out: int, inputs: int, bias: bool
) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(out, inputs, generator=gen)
    b = torch.randn(out, generator=gen) if bias else None
    x = torch.randn(5, 2, inputs, generator=gen)  # any leading shape
    codes, scales = quantize_groups(weight)
    with torch.inference_mode():
        y = Int4Linear(codes, scales, b, kernel)(x)
    exact = x @ dequantize(codes, scales).T + (0 if b is None else b)
    assert y.shape == (5, 2, out) and y.dtype == torch.float32
    rel = _relative(y, exact)
    assert 0 < rel <= KERNEL_ROUNDING[kernel]


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_an_int4_matvec_is_within_its_derived_bound(kernel: str) -> None:
    gen = torch.Generator().manual_seed(2)
    weight, x = torch.randn(256, 1024, generator=gen), torch.randn(1, 1024, generator=gen)
    codes, scales = quantize_groups(weight)
    stored = dequantize(codes, scales)
    exact = x @ weight.T
    bound = MARGIN * predicted_error(weight, stored, x) / float(exact.norm())
    assert 0.05 < _relative(x @ stored.T, exact) <= bound
    with torch.inference_mode():
        y = Int4Linear(codes, scales, None, kernel)(x)
    assert _relative(y, exact) <= bound + KERNEL_ROUNDING[kernel]


def test_int4_is_fast_where_torch_has_a_vectorised_kernel() -> None:
    pi5 = (CPUINFO / "cpuinfo-pi5.txt").read_text()
    pi4 = (CPUINFO / "cpuinfo-pi4.txt").read_text()
    kleidiai_built = bool(getattr(torch.backends, "kleidiai", None)) and bool(
        torch.backends.kleidiai.is_available()
    )
    assert int4_is_fast(KLEIDIAI, "aarch64", pi5, "DEFAULT") == kleidiai_built
    assert not int4_is_fast(KLEIDIAI, "aarch64", pi4, "DEFAULT")  # no dot product: reference
    assert int4_is_fast(AVX2, "x86_64", "", "AVX2")  # the engine's own kernel
    assert int4_is_fast(INT4PACK, "x86_64", "", "AVX512")
    assert not int4_is_fast(INT4PACK, "x86_64", "", "AVX2")
    assert not int4_is_fast(None, "x86_64", "", "AVX512")


# --- the tiny LM -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp32_lm() -> TransformerLM:
    args = load_model_args(TINY_MODEL / "cosyvoice.yaml")
    model = TransformerLM(args.llm).eval()
    model.load_state_dict(torch.load(TINY_MODEL / "llm.pt", weights_only=True))
    return model


def _layer_inputs(model: nn.Module, names: list[str], run: object) -> dict[str, torch.Tensor]:
    """The rows each layer ``names`` (float sources: the first of a fused one) reads in a run."""
    from engine.core.quantize import FUSED_SOURCES

    seen: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    hooks = []
    for name in names:
        parent, _, attr = name.rpartition(".")
        source = FUSED_SOURCES.get(attr, (attr,))[0]
        layer = model.get_submodule(f"{parent}.{source}" if parent else source)
        hooks.append(
            layer.register_forward_hook(
                lambda _m, args, _out, n=name: seen[n].append(
                    args[0].reshape(-1, args[0].shape[-1])
                )
            )
        )
    try:
        run()  # type: ignore[operator]
    finally:
        for hook in hooks:
            hook.remove()
    return {name: torch.cat(rows) for name, rows in seen.items()}


@pytest.mark.parametrize("kernel", KERNELS_HERE)
def test_every_int4_layer_of_the_tiny_lm_is_within_its_derived_bound(
    fp32_lm: TransformerLM, kernel: str
) -> None:
    fx = torch.load(DATA / "llm_fixtures.pt", weights_only=True)
    names = int4_layer_names(fp32_lm, int8_layer_names(fp32_lm))
    inputs = _layer_inputs(fp32_lm, names, lambda: teacher_forced_logits(fp32_lm, fx, "sft"))
    int4_lm = quantize_int4(copy.deepcopy(fp32_lm), names, kernel)
    for name in names:
        weight, bias = float_layer(fp32_lm, name)
        x = inputs[name]
        exact = x @ weight.T + (0 if bias is None else bias)
        layer = int4_lm.get_submodule(name)
        assert isinstance(layer, Int4Linear) and layer.group == GROUP_SIZE
        stored = dequantize(*quantize_groups(weight))
        bound = MARGIN * predicted_error(weight, stored, x) / float(exact.norm())
        with torch.inference_mode():
            rel = _relative(layer(x), exact)
        assert rel <= bound + KERNEL_ROUNDING[kernel], name


def test_the_int4_format_keeps_the_head_and_attention_in_int8(fp32_lm: TransformerLM) -> None:
    from engine.core.quantize import INT8_LINEAR_TYPES

    names = int8_layer_names(fp32_lm)
    int4_lm = quantize_lm_int4(copy.deepcopy(fp32_lm), names)
    assert isinstance(int4_lm.llm_decoder, INT8_LINEAR_TYPES)
    for layer in int4_lm.llm.encoders:
        assert isinstance(layer.self_attn.linear_qkv, INT8_LINEAR_TYPES)
        assert isinstance(layer.self_attn.linear_out, INT8_LINEAR_TYPES)
        assert isinstance(layer.feed_forward.w_1, Int4Linear)  # 64 inputs: whole groups
    # 48 inputs do not split into groups of 32: int8 too
    assert isinstance(int4_lm.text_encoder.encoders[0].feed_forward.w_1, INT8_LINEAR_TYPES)


@pytest.mark.parametrize("kernel", KERNELS_HERE)
@pytest.mark.parametrize("case", ["sft", "zero_shot", "instruct"])
def test_the_tiny_int4_lm_stays_close(fp32_lm: TransformerLM, kernel: str, case: str) -> None:
    fx = torch.load(DATA / "llm_fixtures.pt", weights_only=True)
    int4_lm = quantize_lm_int4(copy.deepcopy(fp32_lm), int8_layer_names(fp32_lm), kernel)
    kl = next_token_kl(
        teacher_forced_logits(fp32_lm, fx, case), teacher_forced_logits(int4_lm, fx, case)
    )
    assert kl.mean() <= MAX_MEAN_KL, kl
    assert kl.max() <= MAX_STEP_KL, kl
    assert kl.max() > 0  # the int4 path really ran


# --- the prepared file, the fallback, the setting ----------------------------------------------


@pytest.fixture
def model(tmp_path: Path) -> Path:
    target = tmp_path / "CosyVoice-300M-SFT"
    shutil.copytree(TINY_MODEL, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    return target


def _load(model: Path, **weights: bool) -> CosyVoiceEngine:
    return CosyVoiceEngine.load(model, threads=1, cache_dir=model.parent / "cache", **weights)


def test_the_prepared_int4_file_round_trips(
    model: Path, fp32_lm: TransformerLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Whether int4 beats int8 on this CPU is another test's: here the file and the layers.
    monkeypatch.setattr(int4, "int4_fast_here", lambda: True)
    engine = _load(model, lm_int4=True)
    assert "llm.int4" in engine.prepared_at_load
    path = model / PREPARED_DIR / "llm.int4.safetensors"
    names = int8_layer_names(fp32_lm)
    four = int4_layer_names(fp32_lm, names)
    with safe_open(path, framework="pt") as stored:
        assert stored.metadata()["group_size"] == str(GROUP_SIZE)
        for name in four:
            weight, _ = float_layer(fp32_lm, name)
            codes, scales = quantize_groups(weight)
            assert torch.equal(stored.get_tensor(f"{name}.weight"), codes)
            assert torch.equal(stored.get_tensor(f"{name}.weight_scale"), scales)
        assert stored.get_tensor("llm_decoder.weight").dtype == torch.int8
        assert not any(k.endswith("linear_q.weight") and "llm.encoders" in k for k in stored.keys())
    # Loaded again from the file: the same layers as quantising the float model now.
    again = _load(model, lm_int4=True)
    assert not again.prepared_at_load
    direct = quantize_lm_int4(copy.deepcopy(fp32_lm), names)
    with torch.inference_mode():
        for name in names:
            loaded = again.models.llm.get_submodule(name)
            assert isinstance(loaded, Int4Linear) == (name in four)
            layer_in = torch.randn(3, loaded.in_features)
            assert torch.equal(loaded(layer_in), direct.get_submodule(name)(layer_in))


def test_without_an_int4_kernel_the_lm_runs_int8_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(int4, "choose_int4_kernel", lambda: None)
    with caplog.at_level(logging.WARNING, logger="engine.core.runtime"):
        setup = setup_cpu(1, lm_int8=False, flow_int8=False, hift_bf16=False, lm_int4=True)
    assert setup.formats.llm == "int8"
    assert "No int4 kernel" in caplog.text


def test_where_int4_is_slower_than_int8_the_lm_runs_int8_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(int4, "int4_fast_here", lambda: False)
    with caplog.at_level(logging.WARNING, logger="engine.core.runtime"):
        setup = setup_cpu(1, lm_int8=False, flow_int8=False, hift_bf16=False, lm_int4=True)
    assert setup.formats.llm == "int8"
    assert "slower than int8" in caplog.text


def test_where_int4_is_fast_the_lm_runs_int4(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(int4, "int4_fast_here", lambda: True)
    setup = setup_cpu(1, lm_int8=False, flow_int8=False, hift_bf16=False, lm_int4=True)
    assert setup.formats.llm == "int4"


def test_the_lm_weights_setting_chooses_the_int4_lm() -> None:
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.model import load_options

    config = load_config(None, [("server.lm_weights", "int4")])
    options = load_options(config)
    assert (options["lm_int4"], options["lm_int8"]) == (True, False)
    assert load_options(load_config(None))["lm_int4"] is False


def test_the_cosyvoice2_lm_loads_in_int4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.core.quantize import INT8_LINEAR_TYPES
    from engine.cosyvoice2.engine import CosyVoice2Engine
    from engine.cosyvoice2.model_dir import load_model_dir

    monkeypatch.setattr(int4, "int4_fast_here", lambda: True)
    target = tmp_path / "CosyVoice2-0.5B"
    shutil.copytree(DATA / "cosyvoice2" / "tiny", target, ignore=shutil.ignore_patterns("prepared"))
    engine = CosyVoice2Engine.load(target, threads=1, lm_int4=True, cache_dir=tmp_path / "cache")
    lm = engine.models.llm
    block = lm.backbone.layers[0]
    assert isinstance(block.mlp.gate_up_proj, Int4Linear)  # 32 inputs: whole groups
    assert isinstance(block.mlp.down_proj, INT8_LINEAR_TYPES)  # 72 inputs: int8
    assert isinstance(block.self_attn.qkv_proj, INT8_LINEAR_TYPES)
    assert isinstance(lm.llm_decoder, INT8_LINEAR_TYPES)
    # Next-token distributions of a teacher-forced prompt close to the float32 LM's.
    reference = load_model_dir(DATA / "cosyvoice2" / "tiny").llm
    ids = list(range(5, 25))

    def logits(model: nn.Module) -> torch.Tensor:
        with torch.inference_mode():
            lm_input = model.build_input(ids)
            cache = model.new_cache(lm_input.shape[1] + 8)
            outs = [model.prefill(lm_input, cache).logits]
            outs += [model.decode_step(t, cache).logits for t in range(100, 107)]
        return torch.cat(outs)

    # The tiny CosyVoice2's distributions are peaked (entropy 2.8 nats) and its int4 layers have
    # one group a row: KL measures 0.02-0.28 nats a step (int8: 0.003-0.04); a layer computed
    # wrongly (a nibble order, a scale) gives several nats.
    kl = next_token_kl(logits(reference), logits(lm))
    assert 0 < kl.max() <= 0.6, kl
