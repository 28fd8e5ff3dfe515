"""HiFT vocoder parity against the official fixtures (tests/data/hift_fixtures.pt, README §6).

Random draws are injected exactly as the fixtures were made (README §0.1): stored int8/uint8 codes,
cyclically repeated over the row-major shape and scaled by 1/32 (normals) or 1/256 (uniform).
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DATA
from parity import F0_RTOL, HIFT_AUDIO_ATOL, SOURCE_ATOL
from torch import Tensor

from engine.core.hift import _PHASE_TILE, HiFTGenerator, HiftNoise, _cumulative_phase
from engine.core.weight_norm import normalize_hift_state_dict
from engine.cosyvoice1.hparams import load_model_args

CASES = ("mel100", "cached_mel70")
# Stages fed the stored inputs (4x the official spread, tests/data/README.md): the sine source
# of a stored f0 did not move on any path (8 float32 ulps at its scale of 1), the source's STFT
# by 1.2e-7, conv_post by 2.9e-7.
SINE_ATOL = 1e-6
STFT_ATOL = 4.8e-7
CONV_POST_ATOL = 1.2e-6


def expand(codes: Tensor, shape: tuple[int, ...], scale: float) -> Tensor:
    n = math.prod(shape)
    reps = -(-n // codes.numel())
    return (codes.to(torch.float32).repeat(reps)[:n] * scale).view(shape)


@pytest.fixture(scope="module")
def fixtures() -> dict[str, Tensor]:
    return torch.load(DATA / "hift_fixtures.pt", weights_only=True)


@pytest.fixture(scope="module")
def legacy_sd() -> dict[str, Tensor]:
    return torch.load(DATA / "tiny_model" / "hift.pt", weights_only=True)


def build(sd: dict[str, Tensor]) -> HiFTGenerator:
    args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml").hift
    model = HiFTGenerator(args)
    model.load_state_dict(normalize_hift_state_dict(sd), strict=True)
    return model


@pytest.fixture(scope="module")
def model(legacy_sd: dict[str, Tensor]) -> HiFTGenerator:
    return build(legacy_sd)


def case_noise(fx: dict[str, Tensor], case: str, frames: int | None = None) -> HiftNoise:
    length = 256 * (frames or fx[f"{case}/in_mel"].shape[-1])
    return HiftNoise(
        phase_uniform=expand(fx[f"{case}/rng_phase_uniform_codes"], (1, 9, 1), 1 / 256),
        sine_noise=expand(fx[f"{case}/rng_sine_noise_codes"], (1, 9, length), 1 / 32),
    )


def close(actual: Tensor, expected: Tensor, atol: float, rtol: float = 0.0) -> None:
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


# --- weight-norm folding --------------------------------------------------------------------


def test_fold_matches_definition(legacy_sd: dict[str, Tensor]) -> None:
    folded = normalize_hift_state_dict(legacy_sd)
    for name in ("conv_pre", "ups.0", "resblocks.4.convs1.2"):  # ups.0 is a ConvTranspose1d
        g, v = legacy_sd[f"{name}.weight_g"], legacy_sd[f"{name}.weight_v"].double()
        want = g.double() * v / v.flatten(1).norm(dim=1).view(-1, 1, 1)
        torch.testing.assert_close(folded[f"{name}.weight"].double(), want, rtol=1e-6, atol=1e-7)
    assert not any("weight_g" in k or "weight_v" in k for k in folded)
    assert len(folded) == 227 - 57  # 57 weight-normed convs lose one tensor each


def test_normalize_is_pure(legacy_sd: dict[str, Tensor]) -> None:
    before = dict(legacy_sd)
    normalize_hift_state_dict(legacy_sd)
    assert legacy_sd.keys() == before.keys()
    assert all(legacy_sd[k] is before[k] for k in before)


def test_both_layouts_and_prefix_give_identical_outputs(
    fixtures: dict[str, Tensor], legacy_sd: dict[str, Tensor]
) -> None:
    param_sd = torch.load(DATA / "hift_parametrized_keys.pt", weights_only=True)
    assert any(k.endswith("parametrizations.weight.original0") for k in param_sd)
    prefixed = {f"generator.{k}": v for k, v in legacy_sd.items()}
    models = [build(legacy_sd), build(param_sd), build(prefixed)]
    mel = fixtures["mel100/in_mel"][..., :20]
    outs = []
    for m in models:
        wave, _ = m.inference(mel, noise=case_noise(fixtures, "mel100", 20))
        outs.append(wave)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], outs[2])


@pytest.mark.parametrize(
    ("drop", "needle"),
    [
        ("conv_pre.weight_v", "conv_pre.weight_g"),
        ("ups.1.weight_g", "ups.1.weight_v"),
    ],
)
def test_malformed_pair_names_key(legacy_sd: dict[str, Tensor], drop: str, needle: str) -> None:
    bad = {k: v for k, v in legacy_sd.items() if k != drop}
    with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
        normalize_hift_state_dict(bad)


def test_malformed_mixed_layouts_and_shapes(legacy_sd: dict[str, Tensor]) -> None:
    mixed = dict(legacy_sd)
    mixed["conv_post.parametrizations.weight.original1"] = mixed.pop("conv_post.weight_v")
    with pytest.raises(ValueError, match="conv_post"):
        normalize_hift_state_dict(mixed)
    bad_shape = dict(legacy_sd)
    bad_shape["conv_post.weight_g"] = torch.ones(3, 1, 1)
    with pytest.raises(ValueError, match="conv_post"):
        normalize_hift_state_dict(bad_shape)


# --- parity ---------------------------------------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_f0(model: HiFTGenerator, fixtures: dict[str, Tensor], case: str) -> None:
    with torch.inference_mode():
        f0 = model.predict_f0(fixtures[f"{case}/in_mel"])
    close(f0, fixtures[f"{case}/f0"], atol=0.0, rtol=F0_RTOL)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_source(model: HiFTGenerator, fixtures: dict[str, Tensor], case: str) -> None:
    with torch.inference_mode():
        merged, uv = model.make_source(fixtures[f"{case}/f0"], noise=case_noise(fixtures, case))
    close(merged.transpose(1, 2), fixtures[f"{case}/sine_merge"], SINE_ATOL)
    if case == "mel100":
        assert torch.equal(uv.transpose(1, 2), fixtures["mel100/uv"])


@pytest.mark.parity
def test_stft_and_conv_post(model: HiFTGenerator, fixtures: dict[str, Tensor]) -> None:
    source = fixtures["mel100/source"]
    with torch.inference_mode():
        real, imag = model.stft(source)
        spec = model.decode_spec(fixtures["mel100/in_mel"], source)
    close(real, fixtures["mel100/s_stft_real"], STFT_ATOL)
    close(imag, fixtures["mel100/s_stft_imag"], STFT_ATOL)
    close(spec, fixtures["mel100/conv_post_out"], CONV_POST_ATOL)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_inference_end_to_end(model: HiFTGenerator, fixtures: dict[str, Tensor], case: str) -> None:
    mel = fixtures[f"{case}/in_mel"]
    cache = fixtures[f"{case}/in_cache_source"]
    wave, source = model.inference(mel, cache, noise=case_noise(fixtures, case))
    assert wave.shape == (1, 256 * mel.shape[-1])
    close(source, fixtures[f"{case}/source"], SOURCE_ATOL)
    close(wave, fixtures[f"{case}/out_speech"], HIFT_AUDIO_ATOL)
    if case == "cached_mel70":
        assert torch.equal(source[..., : cache.shape[-1]], cache)  # overwritten, not blended


@pytest.mark.parametrize(
    "tile_frames", [100, 777, pytest.param(4096, marks=pytest.mark.parity)]
)  # one in the kernel-path re-run
def test_time_tiles_match_official_output(
    legacy_sd: dict[str, Tensor], fixtures: dict[str, Tensor], tile_frames: int
) -> None:
    """Tiled stages still match the official audio (tiles far smaller than the chunk included)."""
    model = build(legacy_sd)
    model.tile_frames = tile_frames
    for case in CASES:
        mel = fixtures[f"{case}/in_mel"]
        cache = fixtures[f"{case}/in_cache_source"]
        wave, _ = model.inference(mel, cache, noise=case_noise(fixtures, case))
        close(wave, fixtures[f"{case}/out_speech"], HIFT_AUDIO_ATOL)


@pytest.mark.parametrize("frames", [1, 3, 17, 64, 130])
def test_time_tiles_equal_one_pass(
    legacy_sd: dict[str, Tensor], monkeypatch: pytest.MonkeyPatch, frames: int
) -> None:
    """Every tile size gives the one-pass result up to rounding, and long inputs are tiled."""
    model = build(legacy_sd)
    mel = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(frames))
    source = torch.randn(1, 1, 256 * frames, generator=torch.Generator().manual_seed(7))
    model.tile_frames = 1 << 30
    with torch.inference_mode():
        whole = model.decode_spec(mel, source)
    calls: list[int] = []
    real_stage = HiFTGenerator._stage

    def counting_stage(self: HiFTGenerator, i: int, x: Tensor, s: Tensor, *, pad_left: bool):
        calls.append(i)
        return real_stage(self, i, x, s, pad_left=pad_left)

    monkeypatch.setattr(HiFTGenerator, "_stage", counting_stage)
    for tile_frames in (8, 50, 512, 5000):
        model.tile_frames = tile_frames
        calls.clear()
        with torch.inference_mode():
            tiled = model.decode_spec(mel, source)
        assert tiled.shape == whole.shape
        # Rounding only (≤ 2e-6 seen); a halo 4 frames short is already off by 6e-5.
        torch.testing.assert_close(tiled, whole, atol=1e-5, rtol=0)
        assert (calls.count(1) > 1) == (64 * frames > tile_frames)


@pytest.mark.parametrize("rates, kernels", [((8, 5, 3), (16, 11, 7)), ((4, 4, 4), (8, 8, 8))])
def test_time_tiles_with_other_upsample_rates(
    rates: tuple[int, ...], kernels: tuple[int, ...]
) -> None:
    """Odd rates (odd source strides) and three stages tile like the shipped [8, 8]."""
    import dataclasses

    base = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml").hift
    args = dataclasses.replace(
        base,
        upsample_rates=rates,
        upsample_kernel_sizes=kernels,
        source_resblock_kernel_sizes=(7, 7, 11),
        source_resblock_dilation_sizes=((1, 3, 5),) * 3,
    )
    torch.manual_seed(0)
    model = HiFTGenerator(args)
    upp = math.prod(rates) * args.istft_hop_len
    for frames in (1, 5, 23):
        mel = torch.randn(1, 80, frames)
        source = torch.randn(1, 1, upp * frames)
        with torch.inference_mode():
            model.tile_frames = 1 << 30
            whole = model.decode_spec(mel, source)
            for tile_frames in (4, 16, 64):
                model.tile_frames = tile_frames
                torch.testing.assert_close(model.decode_spec(mel, source), whole, atol=1e-5, rtol=0)


@pytest.mark.parity
def test_cumsum_semantics(fixtures: dict[str, Tensor]) -> None:
    """Guard: torch's CPU float32 cumsum = float64 accumulation rounded per output (README §9.4).

    make_source relies on this; if a torch upgrade changes it the official outputs change too.
    """
    f0 = fixtures["mel100/f0"]
    incr = f0.repeat_interleave(256).view(1, 1, -1) * torch.arange(1, 10).view(1, -1, 1) / 22050
    f64 = torch.cumsum(incr, -1, dtype=torch.float64).float()
    assert torch.equal(f64, torch.cumsum(incr, -1))  # torch CPU semantics we replicate


@pytest.mark.parametrize("tiles", [1, 2, 2.5])
def test_tiled_phase_equals_one_cumsum(tiles: float) -> None:
    """The source's running sum, in float64 tiles, is the one-pass float64 cumsum to the bit."""
    frames = int(tiles * _PHASE_TILE) // 256 + (3 if tiles % 1 else 0)
    f0 = torch.rand(1, frames, generator=torch.Generator().manual_seed(3))
    incr = (f0 * 500).repeat_interleave(256).view(1, 1, -1) * torch.arange(1, 10).view(1, -1, 1)
    incr = incr / 22050
    one_pass = torch.cumsum(incr, -1, dtype=torch.float64).float() % 1  # the reference recipe
    assert torch.equal(_cumulative_phase(incr), one_pass)


def test_random_draws_use_generator(model: HiFTGenerator, fixtures: dict[str, Tensor]) -> None:
    mel = fixtures["mel100/in_mel"][..., :10]
    a, _ = model.inference(mel, generator=torch.Generator().manual_seed(7))
    b, _ = model.inference(mel, generator=torch.Generator().manual_seed(7))
    c, _ = model.inference(mel, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert a.abs().max() <= 0.99


def test_bad_input_shapes(model: HiFTGenerator, fixtures: dict[str, Tensor]) -> None:
    with pytest.raises(ValueError, match="mel"):
        model.inference(torch.zeros(1, 80, 0))
    with pytest.raises(ValueError, match="mel"):
        model.inference(torch.zeros(80, 10))
    with pytest.raises(ValueError, match="HiftNoise"):
        model.inference(fixtures["mel100/in_mel"][..., :10], noise=case_noise(fixtures, "mel100"))


# --- weight layout ------------------------------------------------------------------------------


def _channels_last_convs(model: HiFTGenerator) -> list[torch.nn.Module]:
    convs = [m for m in model.modules() if hasattr(m, "weight4d")]
    assert convs
    return convs


@pytest.mark.parametrize("how", ["copy", "assign"])
def test_conv_kernels_read_the_weights_in_place(legacy_sd: dict[str, Tensor], how: str) -> None:
    # The 4-D channels-last weight the kernels take is a view of the parameter, not a second
    # copy of every weight, whether the state dict was copied in or assigned (the fast loader).
    from engine.core.weights import assign_state_dict

    if how == "copy":
        model = build(legacy_sd)
    else:
        args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml").hift
        with torch.device("meta"):
            model = HiFTGenerator(args)
        assign_state_dict(model, normalize_hift_state_dict(legacy_sd), DATA / "hift.pt")
    for conv in _channels_last_convs(model):
        w4 = conv.weight4d()
        assert w4.data_ptr() == conv.weight.data_ptr()
        assert w4.is_contiguous(memory_format=torch.channels_last)


def test_swapped_weight_still_used(model: HiFTGenerator) -> None:
    # A weight replaced after load (plain contiguous layout) is read correctly, through a copy.
    conv = model.conv_post
    plain = conv.weight.detach().contiguous()
    expected = conv.weight4d().clone()
    original = conv.weight
    try:
        conv.weight = torch.nn.Parameter(plain, requires_grad=False)
        torch.testing.assert_close(conv.weight4d(), expected, rtol=0, atol=0)
    finally:
        conv.weight = original


# --- bfloat16 filter (an opt-in approximation of the fast profiles) --------------------------


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="needs oneDNN bfloat16 convolutions (x86: AVX-512 BW/VL/DQ or later; Arm: the BF16 "
    "extension): torch.ops.mkldnn._is_mkldnn_bf16_supported() is False here",
)
def test_the_bfloat16_filter_stays_close_and_keeps_its_weights_channels_last(
    fixtures: dict[str, Tensor], legacy_sd: dict[str, Tensor]
) -> None:
    exact, approx = build(legacy_sd), build(legacy_sd)
    approx.use_bfloat16()
    assert approx.filter_dtype == torch.bfloat16
    for conv in (approx.conv_pre, approx.ups[0], approx.resblocks[0].convs1[0]):
        assert conv.weight.dtype == torch.bfloat16
        assert conv.weight4d().data_ptr() == conv.weight.data_ptr()  # a view, no copy per call
    # The parts around the filter stay float32.
    assert approx.m_source.l_linear.weight.dtype == torch.float32
    assert next(approx.f0_predictor.parameters()).dtype == torch.float32
    mel = fixtures["mel100/in_mel"]
    want, _ = exact.inference(mel, noise=case_noise(fixtures, "mel100"))
    got, source = approx.inference(mel, noise=case_noise(fixtures, "mel100"))
    assert got.dtype == torch.float32 and source.dtype == torch.float32
    deviation = float((got - want).norm() / want.norm())
    assert 0 < deviation < 0.05, deviation
