"""The int8 LM fast path: how far its next-token distributions move from the float32 LM."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import DATA
from teacher_forcing import teacher_forced_logits

from engine.core.quantize import next_token_kl, quantize_lm_int8
from engine.cosyvoice1.hparams import load_model_args
from engine.cosyvoice1.llm import TransformerLM

# Mean KL(fp32 || int8) of the next-token distribution over teacher-forced steps. The tiny
# random model measures ~1e-4 nats; the full-size figure is printed by `python -m engine.bench`.
MAX_MEAN_KL = 2e-3
MAX_STEP_KL = 1e-2


@pytest.fixture(scope="module")
def models() -> tuple[TransformerLM, TransformerLM]:
    args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml")
    fp32 = TransformerLM(args.llm).eval()
    fp32.load_state_dict(torch.load(DATA / "tiny_model" / "llm.pt", weights_only=True))
    return fp32, quantize_lm_int8(copy.deepcopy(fp32))


@pytest.mark.parametrize("case", ["sft", "zero_shot", "instruct"])
def test_int8_lm_stays_close(models, case: str) -> None:
    fx = torch.load(DATA / "llm_fixtures.pt", weights_only=True)
    fp32, int8 = models
    reference = teacher_forced_logits(fp32, fx, case)
    torch.testing.assert_close(reference, fx[f"{case}/logits"], atol=1e-4, rtol=0)
    kl = next_token_kl(reference, teacher_forced_logits(int8, fx, case))
    assert kl.mean() <= MAX_MEAN_KL, kl
    assert kl.max() <= MAX_STEP_KL, kl
    assert kl.max() > 0  # the int8 path really ran


def test_the_decoder_and_text_encoder_blocks_are_quantised(models) -> None:
    from engine.core.quantize import INT8_LINEAR_TYPES

    _, int8 = models
    assert isinstance(int8.llm_decoder, INT8_LINEAR_TYPES)
    for layer in int8.llm.encoders:
        # q, k and v are one int8 layer; the three float projections are gone.
        assert isinstance(layer.self_attn.linear_qkv, INT8_LINEAR_TYPES)
        assert not hasattr(layer.self_attn, "linear_q")
        assert isinstance(layer.feed_forward.w_1, INT8_LINEAR_TYPES)
        assert type(layer.self_attn.linear_pos) is torch.nn.Linear  # folded into a float table
    # The text encoder's blocks too (memory), but not its input layer or the affine after it.
    for layer in int8.text_encoder.encoders:
        assert isinstance(layer.self_attn.linear_qkv, INT8_LINEAR_TYPES)
        assert isinstance(layer.feed_forward.w_2, INT8_LINEAR_TYPES)
    assert type(int8.text_encoder.embed.out[0]) is torch.nn.Linear
    assert type(int8.text_encoder_affine_layer) is torch.nn.Linear


def test_prepared_int8_weights_are_packed_from_a_view_not_a_copy() -> None:
    """A prepared file's int8 bytes are wrapped as a per-channel qint8 tensor in place, and the
    packed layer computes exactly what a layer packed from torch's (copying) constructor does."""
    import warnings

    from engine.core.quantize import _per_channel_view

    torch.manual_seed(0)
    weight = torch.randint(-127, 128, (48, 32), dtype=torch.int8)
    scales = torch.rand(48, dtype=torch.float64) * 0.01 + 1e-4
    zero_points = torch.zeros(48, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's deprecation notice for quantised tensors
        view = _per_channel_view(weight, scales, zero_points)
        copied = torch._make_per_channel_quantized_tensor(weight, scales, zero_points, 0)
    assert view.data_ptr() == weight.data_ptr()
    assert view.qscheme() == copied.qscheme() and view.q_per_channel_axis() == 0
    assert torch.equal(view.int_repr(), copied.int_repr())
    assert torch.equal(view.q_per_channel_scales(), copied.q_per_channel_scales())
    x = torch.randn(3, 32)
    packed = [torch.ops.quantized.linear_prepack(q, None) for q in (view, copied)]
    outs = [torch.ops.quantized.linear_dynamic(x, p, True) for p in packed]
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows", [1, 7])
def test_the_fused_relu_layer_equals_relu_after_the_layer(rows: int) -> None:
    """forward_relu (the ReLU in the kernel's epilogue) is bit-identical to relu(forward)."""
    from engine.core.quantize import int8_linear

    torch.manual_seed(5)
    layer = int8_linear(torch.randn(64, 32), torch.randn(64))
    x = torch.randn(1, rows, 32)
    with torch.inference_mode():
        fused, plain = layer.forward_relu(x), torch.relu(layer(x))
    assert (plain == 0).any() and (plain > 0).any()
    assert torch.equal(fused, plain)


def test_a_qnnpack_layer_is_packed_at_once_and_computes_as_one_packed_at_its_first_call() -> None:
    """Under QNNPACK (aarch64's kernels) the engine makes a layer pack when it is built, so that
    it lets go of the weight it was given; the layer computes bit for bit what a layer packed
    by torch at its first call does, and still unpacks to its weight."""
    import warnings

    from engine.core.quantize import SCALE, WEIGHT, _per_channel_view, pack_int8

    if "qnnpack" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no QNNPACK kernels")
    torch.manual_seed(3)
    weight = torch.randint(-127, 128, (48, 32), dtype=torch.int8)
    scales = torch.rand(48, dtype=torch.float64) * 0.01 + 1e-4

    def references() -> int:  # to the weight's bytes
        return torch._C._storage_Use_Count(weight.untyped_storage()._cdata)

    unpacked_references = references()
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "qnnpack"
    try:
        layer = pack_int8({f"x.{WEIGHT}": weight, f"x.{SCALE}": scales}, "x")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation notice for quantised tensors
            zero_points = torch.zeros(48, dtype=torch.int64)
            lazy = torch.ops.quantized.linear_prepack(
                _per_channel_view(weight.clone(), scales, zero_points), None
            )
        assert references() == unpacked_references  # the layer holds none
        for rows in (1, 5):
            x = torch.randn(rows, 32)
            expected = torch.ops.quantized.linear_dynamic(x, lazy, False)
            with torch.inference_mode():
                assert torch.equal(layer(x), expected)
        unpacked, _ = torch.ops.quantized.linear_unpack(layer._packed_params._packed_params)
        assert torch.equal(unpacked.int_repr(), weight)
    finally:
        torch.backends.quantized.engine = before
