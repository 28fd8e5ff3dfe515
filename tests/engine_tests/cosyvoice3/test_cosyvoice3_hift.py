"""CosyVoice3's causal HiFT: strict loading in both weight-norm layouts, the causal structure, the
stream against one whole call, and parity with the official reference cases
(tests/data/cosyvoice3/hift_cases.*, README there)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import TESTS
from torch import Tensor

from engine.core.hift import HiftNoise
from engine.core.hparams import ModelConfigError
from engine.core.types import ModelLoadError
from engine.cosyvoice3.hift import (
    CausalHiFT,
    CausalHiFTArgs,
    CausalHiftStream,
    UniformSourceNoise,
    build_causal_hift,
    causal_hift_args_from_doc,
    load_causal_hift,
)

DATA = TESTS / "data" / "cosyvoice3"
META = json.loads((DATA / "hift_cases.json").read_text(encoding="utf-8"))
UPP = 480

# Tolerances: four times the official code's spread on these cases (1, 2 and 4 threads, ATen's
# default and AVX2 kernels, oneDNN and MKL capped at SSE4, an emulated Arm Cortex-A76 at 1 and 2
# threads; tests/data/cosyvoice3/README.md).
# F0 runs in float64 (spread 5.1e-13 Hz, on Arm) and is rounded to float32: one float32 ulp.
F0_RTOL = 1.2e-7
# The source: 0 on every x86 path, 3.0e-8 on Arm; four float32 ulps at its scale of 1.
SOURCE_ATOL = 4.8e-7
# conv_pre: 3.1e-6 at a scale of 7 on x86, 4.77e-6 on Arm.
CONV_PRE_ATOL = 2.0e-5
# Waveforms, whole or streamed: 2.38e-7 with the Arm runs, 2.31e-7 on x86 alone (the phase is
# exact in float64, so it does not drift with the length as CosyVoice2's does).
WAVE_ATOL = 9.6e-7


@pytest.fixture(scope="module")
def cases() -> dict[str, Tensor]:
    return torch.load(DATA / "hift_cases.pt", weights_only=True)


@pytest.fixture(scope="module")
def args() -> CausalHiFTArgs:
    return causal_hift_args_from_doc({"hift": META["hift_section"]}, "hift_cases.json")


@pytest.fixture(scope="module")
def state(cases: dict[str, Tensor]) -> dict[str, Tensor]:
    prefix = "weights/"
    return {k[len(prefix) :]: v for k, v in cases.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def hift(args: CausalHiFTArgs, state: dict[str, Tensor]) -> CausalHiFT:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_causal_hift(state, args)


def expand(codes: Tensor, shape: tuple[int, ...], scale: float) -> Tensor:
    """An injected draw: the stored codes repeated over the row-major shape, scaled."""
    n = math.prod(shape)
    return (codes.to(torch.float32).repeat(-(-n // codes.numel()))[:n] * scale).view(shape)


class StoredNoise:
    """The official fixed draws as the case file stores them: rand_ini (1, 9) with the
    fundamental's zeroed, and the time-major uniform table (1, L, 9), read in order."""

    def __init__(self, cases: dict[str, Tensor]) -> None:
        samples = META["noise"]["table_samples"]
        phase = expand(cases["noise/rand_ini_codes"], (1, 9), 1 / 256)
        phase[:, 0] = 0.0
        self.phase = phase.view(1, 9, 1)
        self.rows = expand(cases["noise/sine_table_codes"], (1, samples, 9), 1 / 256)
        self.read = 0

    def initial_phase(self, harmonics: int) -> Tensor:
        return self.phase

    def table(self, harmonics: int, n_samples: int) -> Tensor:
        rows = self.rows[:, self.read : self.read + n_samples]
        self.read += n_samples
        return rows.transpose(1, 2)

    def whole(self, n_samples: int) -> HiftNoise:
        return HiftNoise(phase_uniform=self.phase, sine_noise=self.table(9, n_samples))


def _legacy(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """The same weights in the layout torch.nn.utils.weight_norm writes (weight_g/weight_v)."""
    names = {".parametrizations.weight.original0": ".weight_g"}
    names[".parametrizations.weight.original1"] = ".weight_v"
    out = {}
    for key, value in state.items():
        suffix = next((s for s in names if key.endswith(s)), None)
        out[key if suffix is None else key[: -len(suffix)] + names[suffix]] = value
    return out


# --- loading and structure --------------------------------------------------------------------


def test_config_reads_the_look_ahead_and_refuses_a_bad_one() -> None:
    section = dict(META["hift_section"])
    assert causal_hift_args_from_doc({"hift": section}).conv_pre_look_right == 4
    with pytest.raises(ModelConfigError, match="conv_pre_look_right"):
        causal_hift_args_from_doc({"hift": {**section, "conv_pre_look_right": 0}})
    with pytest.raises(ModelConfigError, match="missing top-level section 'hift'"):
        causal_hift_args_from_doc({})


@pytest.mark.parametrize("layout", ["parametrizations", "legacy"])
def test_loads_strictly_in_both_weight_norm_layouts(
    args: CausalHiFTArgs, state: dict[str, Tensor], cases: dict[str, Tensor], layout: str
) -> None:
    sd = state if layout == "parametrizations" else _legacy(state)
    assert (layout == "legacy") == any(k.endswith("weight_g") for k in sd)
    model = load_causal_hift(sd, args)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert all(p.dtype == torch.float64 for p in model.f0_predictor.parameters())
    f0 = model.predict_f0(cases["whole/in_mel"][None])
    torch.testing.assert_close(f0[0], cases["whole/f0_final"].float(), rtol=F0_RTOL, atol=0)


def test_bad_keys_are_named(args: CausalHiFTArgs, state: dict[str, Tensor]) -> None:
    bad = dict(state)
    del bad["conv_post.bias"]
    with pytest.raises(ModelLoadError, match=r"hift\.pt does not fit.*conv_post\.bias"):
        load_causal_hift(bad, args)


def test_full_size_has_the_official_key_shapes() -> None:
    """Upstream's CausalHiFTGenerator at full size: conv_pre k5, the upsampling convs as Conv1d
    weights (out, in, k), strided source downsampling k30 / k6, the F0 predictor's k4 first
    conv; 20.8 M parameters with weight norm folded."""
    section = {**META["hift_section"], "base_channels": 512}
    section["f0_predictor"] = {**section["f0_predictor"], "cond_channels": 512}
    model = build_causal_hift(causal_hift_args_from_doc({"hift": section}))
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert shapes["conv_pre.weight"] == (512, 80, 5)
    assert shapes["ups.0.weight"] == (256, 512, 16)
    assert shapes["ups.2.weight"] == (64, 128, 7)
    assert shapes["source_downs.0.weight"] == (256, 18, 30)
    assert shapes["source_downs.1.weight"] == (128, 18, 6)
    assert shapes["source_downs.2.weight"] == (64, 18, 1)
    assert shapes["f0_predictor.condnet.0.weight"] == (512, 80, 4)
    assert shapes["f0_predictor.condnet.8.weight"] == (512, 512, 3)
    assert model.left_context_frames() == 23 and model.settle_frames == 8


def test_audio_never_reads_later_mel_beyond_the_look_ahead(hift: CausalHiFT) -> None:
    """Changing mel frame t changes no sample before frame t − 8 (3 frames for F0, 4 for
    conv_pre, and the iSTFT's blend with the frame before)."""
    gen = torch.Generator().manual_seed(0)
    mel = torch.randn(1, 80, 40, generator=gen) * 2 - 4
    changed = mel.clone()
    changed[..., 30:] += 1.0
    a, _ = hift.inference(mel, generator=torch.Generator().manual_seed(1))
    b, _ = hift.inference(changed, generator=torch.Generator().manual_seed(1))
    diff = (a - b).abs()[0]
    assert diff[: (30 - 8) * UPP].max() == 0
    assert diff[(30 - 8) * UPP :].max() > 1e-3


def test_inference_refuses_a_cached_source_and_short_mel(hift: CausalHiFT) -> None:
    mel = torch.zeros(1, 80, 7)
    with pytest.raises(ValueError, match="no cached source"):
        hift.inference(mel, torch.zeros(1, 1, 480))
    with pytest.raises(ValueError, match="at least 8 mel frames"):
        hift.inference(mel, finalize=False)
    with pytest.raises(ValueError, match=r"expected mel \(1, 80, T\)"):
        hift.inference(torch.zeros(80, 7))


def test_stream_in_any_pieces_gives_one_whole_call(hift: CausalHiFT) -> None:
    """Each frame's audio made once from a bounded window equals one call on the whole mel:
    pieces of 1 to 300 frames, one longer than a filter call (STREAM_PIECE_FRAMES), and a
    final push with no frames."""
    gen = torch.Generator().manual_seed(2)
    mel = torch.randn(1, 80, 420, generator=gen) * 2 - 4
    whole, _ = hift.inference(mel, generator=torch.Generator().manual_seed(3))
    stream = CausalHiftStream(hift, UniformSourceNoise(torch.Generator().manual_seed(3)))
    out, pos = [], 0
    for n in (9, 1, 3, 7, 300, 100):
        out.append(stream.push(mel[..., pos : pos + n]))
        pos += n
        assert sum(o.shape[1] for o in out) == max(0, pos - 8) * UPP
    out.append(stream.push(mel[..., pos:], finalize=True))
    streamed = torch.cat(out, dim=1)
    assert streamed.shape == whole.shape
    torch.testing.assert_close(streamed, whole, atol=1e-6, rtol=0)
    assert stream.mel.shape[-1] <= hift.left_context_frames() + 11  # only the window is kept
    with pytest.raises(RuntimeError, match="finalized"):
        stream.push(mel[..., :1])


# --- parity with the official reference cases ---------------------------------------------------


@pytest.mark.parity
def test_f0_matches_official(hift: CausalHiFT, cases: dict[str, Tensor]) -> None:
    mel = cases["whole/in_mel"][None]
    for finalize, key in ((True, "whole/f0_final"), (False, "whole/f0_stream")):
        f0 = hift.predict_f0(mel, finalize=finalize)[0]
        torch.testing.assert_close(f0, cases[key].float(), rtol=F0_RTOL, atol=0)


@pytest.mark.parity
@pytest.mark.parametrize("finalize", [True, False])
def test_inference_matches_official(
    hift: CausalHiFT, cases: dict[str, Tensor], finalize: bool
) -> None:
    tag = "final" if finalize else "stream"
    mel = cases["whole/in_mel"][None]
    frames = mel.shape[-1] - (0 if finalize else 3)
    seen: dict[str, Tensor] = {}

    def record(module: torch.nn.Module, args: tuple, out: Tensor) -> None:
        seen["conv_pre"] = out.squeeze(2).float()  # (1, C, 1, T) channels-last → (1, C, T)

    hook = hift.conv_pre.register_forward_hook(record)
    try:
        wave, source = hift.inference(
            mel, noise=StoredNoise(cases).whole(frames * UPP), finalize=finalize
        )
    finally:
        hook.remove()
    expected_source = cases["whole/source"][: frames * UPP]
    torch.testing.assert_close(source[0, 0], expected_source, atol=SOURCE_ATOL, rtol=0)
    torch.testing.assert_close(
        seen["conv_pre"][0], cases[f"whole/conv_pre_{tag}"], atol=CONV_PRE_ATOL, rtol=0
    )
    torch.testing.assert_close(wave[0], cases[f"whole/wave_{tag}"], atol=WAVE_ATOL, rtol=0)


@pytest.mark.parity
def test_decode_of_the_official_source_matches(hift: CausalHiFT, cases: dict[str, Tensor]) -> None:
    """The filter alone, fed the official source."""
    mel = cases["whole/in_mel"][None]
    source = cases["whole/source"].view(1, 1, -1)
    wave = hift.decode(mel, source, finalize=True)
    torch.testing.assert_close(wave[0], cases["whole/wave_final"], atol=WAVE_ATOL, rtol=0)


@pytest.mark.parity
def test_stream_matches_official_token2wav_chunks(
    hift: CausalHiFT, cases: dict[str, Tensor]
) -> None:
    """The official runtime's streamed chunks (hops of 25 and 50 tokens, then the rest; its
    mel cache and speech offset) from our stream fed the same new mel frames per chunk."""
    mel = cases["stream/in_mel"][None]
    schedule = [c for c in META["stream"]["schedule"] if "tokens" in c]
    stream = CausalHiftStream(hift, StoredNoise(cases))
    start = 0
    for i, chunk in enumerate(schedule):
        end = 2 * (chunk["tokens"] - (0 if chunk["finalize"] else 3))
        audio = stream.push(mel[..., start:end], finalize=chunk["finalize"])
        start = end
        assert audio.shape[1] == chunk["samples"]
        torch.testing.assert_close(audio[0], cases[f"stream/chunk{i}"], atol=WAVE_ATOL, rtol=0)
