"""CosyVoice2's HiFT (v1's vocoder with v2's config, 24 kHz): the full-size key manifest, strict
loading, the frame-rate sine source, and parity with the official reference cases."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TESTS
from parity import F0_RTOL, HIFT_AUDIO_ATOL, SOURCE_ATOL
from torch import Tensor

from engine.core.hift import HiFTGenerator, HiftNoise
from engine.core.hparams import HiFTArgs
from engine.core.types import ModelLoadError
from engine.cosyvoice2.flow_args import load_hift_args
from engine.cosyvoice2.hift import build_hift, load_hift

DATA = TESTS / "data" / "cosyvoice2"
TINY = DATA / "tiny"
FULL_YAML = DATA / "cosyvoice2_0.5b.yaml"


@pytest.fixture(scope="module")
def args() -> HiFTArgs:
    return load_hift_args(TINY / "cosyvoice2.yaml")


@pytest.fixture(scope="module")
def state() -> dict[str, Tensor]:
    return torch.load(TINY / "hift.pt", weights_only=True)


@pytest.fixture(scope="module")
def hift(args: HiFTArgs, state: dict[str, Tensor]) -> HiFTGenerator:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_hift(state, args)


def _folded(entries: list[dict]) -> dict[str, tuple[int, ...]]:
    """The manifest lists weight norm as original0/1; the vocoder folds them into '.weight'."""
    keys: dict[str, tuple[int, ...]] = {}
    for entry in entries:
        key = entry["key"]
        if key.endswith(".parametrizations.weight.original0"):
            continue
        keys[key.replace(".parametrizations.weight.original1", ".weight")] = tuple(entry["shape"])
    return keys


def test_full_size_config_numbers() -> None:
    args = load_hift_args(FULL_YAML)
    assert args.sampling_rate == 24000 and args.upsample_rates == (8, 5, 3)
    assert args.source_resblock_kernel_sizes == (7, 7, 11)
    hift = build_hift(args)
    assert hift.upp == 480 and not hift.per_sample_phase


def test_full_size_hift_matches_manifest() -> None:
    manifest = json.loads((DATA / "manifest_full.json").read_text(encoding="utf-8"))
    hift = build_hift(load_hift_args(FULL_YAML))
    ours = {k: tuple(v.shape) for k, v in hift.state_dict().items()}
    assert ours == _folded(manifest["modules"]["hift"]["state_dict"])


def _parametrized(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The same weights in the layout current torch writes (original0/1 for g/v)."""
    names = {".weight_g": ".parametrizations.weight.original0"}
    names[".weight_v"] = ".parametrizations.weight.original1"
    out = {}
    for key, value in state.items():
        suffix = next((s for s in names if key.endswith(s)), None)
        out[key if suffix is None else key[: -len(suffix)] + names[suffix]] = value
    return out


@pytest.mark.parametrize("layout", ["legacy", "parametrizations"])
def test_tiny_hift_loads_strictly_in_both_weight_norm_layouts(
    args: HiFTArgs, state: dict[str, Tensor], layout: str
) -> None:
    sd = state if layout == "legacy" else _parametrized(state)
    assert (layout == "legacy") == any(k.endswith("weight_g") for k in sd)
    model = load_hift(sd, args)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert model.window.shape == (16,)


def test_bad_keys_are_named(args: HiFTArgs, state: dict[str, Tensor]) -> None:
    bad = dict(state)
    del bad["conv_post.bias"]
    bad["f0_predictor.extra"] = torch.zeros(1)
    with pytest.raises(
        ModelLoadError, match=r"hift\.pt does not fit.*missing keys: conv_post\.bias"
    ):
        load_hift(bad, args)
    half = {k: v for k, v in state.items() if not k.endswith("conv_pre.weight_g")}
    with pytest.raises(ModelLoadError, match=r"hift\.pt: malformed HiFT weight-norm"):
        load_hift(half, args)


def test_output_length_is_480_samples_a_frame(hift: HiFTGenerator) -> None:
    mel = torch.randn(1, 80, 37, generator=torch.Generator().manual_seed(0))
    wave, source = hift.inference(mel, generator=torch.Generator().manual_seed(1))
    assert wave.shape == (1, 37 * 480) and source.shape == (1, 1, 37 * 480)


def test_time_tiles_give_the_untiled_waveform(hift: HiFTGenerator) -> None:
    """The stage tiling (halo per stage) holds for v2's 8·5·3 upsampling too."""
    mel = torch.randn(1, 80, 57, generator=torch.Generator().manual_seed(0))
    whole, _ = hift.inference(mel, generator=torch.Generator().manual_seed(1))
    saved = hift.tile_frames
    try:
        hift.tile_frames = 64  # many tiles at every stage
        tiled, _ = hift.inference(mel, generator=torch.Generator().manual_seed(1))
    finally:
        hift.tile_frames = saved
    torch.testing.assert_close(tiled, whole, atol=1e-6, rtol=0)


def test_frame_rate_source_holds_the_last_frame_phase(hift: HiFTGenerator) -> None:
    """At 24 kHz the phase is summed per frame and interpolated back to the samples: past the
    last frame's centre it stays at that frame's phase, 2π · frames · 480 · (k·f0/sr mod 1),
    so the last 240 samples of a noiseless voiced source are all
    tanh(l_linear(0.1 · sin(that phase))). A per-sample phase would keep turning there."""
    frames, f0 = 6, 210.0
    n_harm = hift.n_harm
    noise = HiftNoise(
        phase_uniform=torch.zeros(1, n_harm, 1),
        sine_noise=torch.zeros(1, n_harm, frames * hift.upp),
    )
    source, uv = hift.make_source(torch.full((1, frames), f0), noise=noise)
    assert torch.all(uv == 1)
    k = torch.arange(1, n_harm + 1, dtype=torch.float64)
    phase = 2 * torch.pi * frames * hift.upp * torch.remainder(k * f0 / 24000, 1)
    w, b = hift.m_source.l_linear.weight.double(), hift.m_source.l_linear.bias.double()
    expected = torch.tanh(0.1 * torch.sin(phase) @ w[0] + b[0]).float()
    tail = source[0, 0, -hift.upp // 2 :]
    # float32 phases near 1e3 rad: about 1e-4 of rounding
    torch.testing.assert_close(tail, expected.expand_as(tail), atol=1e-3, rtol=0)


# --- parity with the official reference cases (tests/data/cosyvoice2/hift_cases.*) ----------

# conv_pre on a stored mel: four times the official spread, 2.1e-6 across x86 kernel paths and
# 1.05e-5 on emulated aarch64 (the others: tests/parity.py)
CONV_PRE_ATOL = 4.2e-5


def expand(codes: Tensor, shape: tuple[int, ...], scale: float) -> Tensor:
    """An injected draw: the stored codes repeated over the row-major shape, scaled."""
    n = math.prod(shape)
    return (codes.to(torch.float32).repeat(-(-n // codes.numel()))[:n] * scale).view(shape)


@pytest.fixture(scope="module")
def cases() -> dict[str, Tensor]:
    return torch.load(DATA / "hift_cases.pt", weights_only=True)


def _noise(cases: dict[str, Tensor], case: str, n_samples: int) -> HiftNoise:
    """The official draws: rand(1, 9) initial phases; randn (1, L, 9), time-major."""
    phase = expand(cases[f"{case}/rng_phase_rand_codes"], (1, 9), 1 / 256).view(1, 9, 1)
    sine = expand(cases[f"{case}/rng_sine_noise_codes"], (1, n_samples, 9), 1 / 32)
    return HiftNoise(phase_uniform=phase, sine_noise=sine.transpose(1, 2))


@pytest.mark.parity
@pytest.mark.parametrize("case", ["mel60", "cached_mel48"])
def test_waveform_matches_official(
    hift: HiFTGenerator, cases: dict[str, Tensor], case: str
) -> None:
    mel = cases[f"{case}/in_mel"].unsqueeze(0)
    n_samples = mel.shape[-1] * 480
    seen: dict[str, Tensor] = {}

    def record(module: torch.nn.Module, args: tuple, out: Tensor) -> None:
        seen["conv_pre"] = out.squeeze(2).float()  # (1, C, 1, T) channels-last → (1, C, T)

    hook = hift.conv_pre.register_forward_hook(record)
    try:
        f0 = hift.predict_f0(mel)
        wave, source = hift.inference(
            mel, cases[f"{case}/in_cache_source"], noise=_noise(cases, case, n_samples)
        )
    finally:
        hook.remove()
    torch.testing.assert_close(f0[0], cases[f"{case}/f0"], rtol=F0_RTOL, atol=0)
    torch.testing.assert_close(
        seen["conv_pre"][0], cases[f"{case}/conv_pre_out"], atol=CONV_PRE_ATOL, rtol=0
    )
    torch.testing.assert_close(source[0, 0], cases[f"{case}/source"], atol=SOURCE_ATOL, rtol=0)
    atol = HIFT_AUDIO_ATOL
    torch.testing.assert_close(wave[0], cases[f"{case}/out_speech"], atol=atol, rtol=0)
