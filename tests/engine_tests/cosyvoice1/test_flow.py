"""Parity of the flow model (MaskedDiffWithXvec) with the official fixtures (tests/data).

Noise is injected exactly as the fixtures were made (README §0.1): the official ``randn_like``
draw for z is ``expand(codes, shape, 1/32)``. Tolerances: four times the official code's own
spread (tests/data/README.md, tolerance table).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import DATA, ONEDNN_OPS_NEEDED

from engine.core.estimator_blocks import TransformerBlock
from engine.core.onednn_layers import (
    onednn_conv_available,
    onednn_linear_available,
    use_onednn_convs,
    use_onednn_linears,
)
from engine.cosyvoice1.flow import FlowModel, empty_flow_cache
from engine.cosyvoice1.hparams import load_model_args

CASES = ("tok40_noprompt", "tok60_noprompt", "tok60_prompt15")
ENC_TOL = {"atol": 1.6e-5, "rtol": 0.0}  # encoder side and the cache: official spread 3.8e-6
MEL_TOL = {"atol": 2.8e-5, "rtol": 0.0}  # estimator steps and mels: official spread 6.9e-6
FLOW_Z_CALLER = "flow_matching.py"


def expand(codes: torch.Tensor, shape: tuple[int, ...], scale: float = 1 / 32) -> torch.Tensor:
    """The fixtures' injected draw: cyclic repetition of the stored codes over ``shape``."""
    n = math.prod(shape)
    reps = -(-n // codes.numel())
    return (codes.to(torch.float32).repeat(reps)[:n] * scale).view(shape)


def _tiny_flow() -> FlowModel:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml").flow
    model = FlowModel(args)
    state = torch.load(DATA / "tiny_model" / "flow.pt", weights_only=True)
    model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def flow() -> FlowModel:
    return _tiny_flow()


@pytest.fixture(scope="module")
def onednn_flow() -> FlowModel:
    """The estimator as the engine serves it: transformer Linears and convolutions on oneDNN
    (engine.load)."""
    if not (onednn_linear_available() and onednn_conv_available()):
        pytest.skip(ONEDNN_OPS_NEEDED)
    model = _tiny_flow()
    assert use_onednn_linears(model.decoder.estimator, TransformerBlock) > 0
    assert use_onednn_convs(model.decoder.estimator) > 0
    return model


@pytest.fixture(scope="module", params=["default", "onednn"])
def any_flow(request: pytest.FixtureRequest) -> FlowModel:
    """Parity tests run on both Linear paths: torch's default and the engine's oneDNN one."""
    return request.getfixturevalue("flow" if request.param == "default" else "onednn_flow")


@pytest.fixture(scope="module")
def fx() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "flow_fixtures.pt", weights_only=True)


@pytest.fixture(scope="module")
def stream_fx() -> tuple[dict, dict]:
    tensors = torch.load(DATA / "stream_fixtures.pt", weights_only=True)
    meta = json.loads((DATA / "stream_fixtures.json").read_text())
    return tensors, meta


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: dict[str, float], what: str) -> None:
    shapes = f"{tuple(actual.shape)} vs {tuple(expected.shape)}"
    assert actual.shape == expected.shape, f"{what}: {shapes}"
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def test_state_dict_keys_match_checkpoint(flow: FlowModel) -> None:
    state = torch.load(DATA / "tiny_model" / "flow.pt", weights_only=True)
    saved = flow.state_dict()
    assert set(saved) == set(state)
    for key, value in state.items():
        assert torch.equal(saved[key], value), key


@pytest.mark.parity
def test_meta_build_and_assign_load(flow: FlowModel, fx: dict[str, torch.Tensor]) -> None:
    """The loader builds on ``meta`` and assigns mmap'd tensors: nothing may stay on meta."""
    args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml").flow
    with torch.device("meta"):
        model = FlowModel(args)
    state = torch.load(DATA / "tiny_model" / "flow.pt", weights_only=True, mmap=True)
    model.load_state_dict(state, strict=True, assign=True)
    for sub in model.modules():
        materialize = getattr(sub, "materialize_derived", None)
        if callable(materialize):
            materialize()
    on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not on_meta
    g = {k.split("/", 1)[1]: v for k, v in fx.items() if k.startswith("estimator_direct/")}
    with torch.no_grad():
        out = model.eval().decoder.estimator(
            g["x"], g["mask"], g["mu"], g["t"], g["spks"], g["cond"]
        )
    _close(out, g["out"], MEL_TOL, "estimator after assign-load")


@pytest.mark.parity
def test_estimator_direct(any_flow: FlowModel, fx: dict[str, torch.Tensor]) -> None:
    """Batch 2, odd T=37 (down/up rounding), row 1 padded from frame 29, different t per row."""
    g = {k.split("/", 1)[1]: v for k, v in fx.items() if k.startswith("estimator_direct/")}
    with torch.no_grad():
        out = any_flow.decoder.estimator(g["x"], g["mask"], g["mu"], g["t"], g["spks"], g["cond"])
    _close(out, g["out"], MEL_TOL, "estimator_direct/out")
    assert torch.all(out[1, :, 29:] == 0)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_conditioning(flow: FlowModel, fx: dict[str, torch.Tensor], case: str) -> None:
    def g(name: str) -> torch.Tensor:
        return fx[f"{case}/{name}"]

    c = flow.encode(g("in_token"), g("in_prompt_token"), g("in_prompt_feat"), g("in_embedding"))
    _close(c.spks, g("spk_proj"), ENC_TOL, "spk_proj")
    _close(c.encoder_out, g("encoder_out"), ENC_TOL, "encoder_out")
    _close(c.h, g("encoder_proj_out"), ENC_TOL, "encoder_proj_out")
    _close(c.interp, g("length_regulator_interp"), ENC_TOL, "length_regulator_interp")
    _close(c.mu, g("mu"), ENC_TOL, "mu")
    _close(c.cond, g("cond"), {"atol": 0.0, "rtol": 0.0}, "cond")
    assert c.mel_len1 == g("in_prompt_feat").shape[1]
    assert c.mel_len1 + c.mel_len2 == g("mask").shape[2]


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_inference(any_flow: FlowModel, fx: dict[str, torch.Tensor], case: str) -> None:
    def g(name: str) -> torch.Tensor:
        return fx[f"{case}/{name}"]

    z = expand(g("noise_z_codes"), tuple(g("noise_z").shape))
    assert torch.equal(z, g("noise_z"))
    steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def capture(step: int, x: torch.Tensor, t: torch.Tensor, dphi: torch.Tensor) -> None:
        assert step == len(steps)
        steps.append((x.clone(), t.clone(), dphi.clone()))

    mel, cache = any_flow.inference(
        g("in_token"),
        g("in_prompt_token"),
        g("in_prompt_feat"),
        g("in_embedding"),
        g("in_flow_cache"),
        noise=z,
        step_callback=capture,
    )
    _close(mel, g("out_feat"), MEL_TOL, "out_feat")
    _close(cache, g("out_flow_cache"), ENC_TOL, "out_flow_cache")
    assert len(steps) == 10
    if case == "tok40_noprompt":
        _close(torch.cat([s[0] for s in steps]), g("step_x_in"), MEL_TOL, "step_x_in")
        _close(
            torch.stack([s[1] for s in steps]), g("step_t"), {"atol": 0.0, "rtol": 0.0}, "step_t"
        )
        _close(torch.cat([s[2][:1] for s in steps]), g("step_dphi_cond"), MEL_TOL, "step_dphi_cond")
        _close(
            torch.cat([s[2][1:] for s in steps]), g("step_dphi_uncond"), MEL_TOL, "step_dphi_uncond"
        )


def _flow_prompt(kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    embedding = kwargs["flow_embedding"]
    tokens = kwargs.get("flow_prompt_speech_token", torch.zeros(1, 0, dtype=torch.int32))
    feat = kwargs.get("prompt_speech_feat", torch.zeros(1, 0, 80))
    return embedding, tokens, feat


# one run in the kernel-path re-run (tests/engine_tests/core/test_kernel_paths.py): the others only
# add length
@pytest.mark.parametrize(
    "run",
    [
        "vc250/stream",
        pytest.param("vc221_prompt/stream", marks=pytest.mark.parity),
        "e2e_sft_llm/stream",
        "vc221_prompt/nonstream",
    ],
)
def test_stream_chunks_with_flow_cache(
    any_flow: FlowModel, stream_fx: tuple[dict, dict], run: str
) -> None:
    """Each chunk's flow mel given its tokens, its injected z and the previous chunk's cache."""
    tensors, meta = stream_fx
    scenario = run.split("/")[0]
    embedding, prompt_tokens, prompt_feat = _flow_prompt(tensors[f"{scenario}/input_kwargs"])
    z_calls = [c for c in meta[run]["rng_calls"] if FLOW_Z_CALLER in c["caller"]]
    chunks = meta[run]["chunks"]
    assert len(z_calls) == len(chunks) == meta[run]["num_chunks"]

    cache = empty_flow_cache()
    for i, (chunk, call) in enumerate(zip(chunks, z_calls, strict=True)):
        assert list(cache.shape) == chunk["flow_cache_in_shape"]
        codes = tensors[f"{run}/rng/{call['idx']:02d}_{call['fn']}"]
        z = expand(codes, tuple(call["shape"]), call["scale"])
        mel, cache = any_flow.inference(
            tensors[f"{run}/chunk{i}/tokens"], prompt_tokens, prompt_feat, embedding, cache, noise=z
        )
        _close(mel, tensors[f"{run}/chunk{i}/flow_mel_out"], MEL_TOL, f"{run} chunk{i}")
        assert list(cache.shape) == chunk["flow_cache_out_shape"]


def test_cache_pins_z_and_mu(flow: FlowModel, fx: dict[str, torch.Tensor]) -> None:
    """A non-empty cache overwrites the first C frames of z and mu; the new cache reflects it."""

    def g(name: str) -> torch.Tensor:
        return fx[f"tok60_noprompt/{name}"]

    z = g("noise_z")
    pinned = torch.randn(1, 80, 34, 2, generator=torch.Generator().manual_seed(0))
    _, cache = flow.inference(
        g("in_token"),
        g("in_prompt_token"),
        g("in_prompt_feat"),
        g("in_embedding"),
        pinned,
        noise=z,
        n_timesteps=1,
    )
    assert cache.shape == (1, 80, 34, 2)  # T = 103 > 68: the tail does not reach the pinned part
    tiny = g("in_token")[:, :15]  # 25 frames < 34: the "tail" is the whole (pinned) call
    _, cache = flow.inference(
        tiny,
        g("in_prompt_token"),
        g("in_prompt_feat"),
        g("in_embedding"),
        pinned[:, :, :20],
        noise=z[:, :, :25],
        n_timesteps=1,
    )
    assert cache.shape == (1, 80, 25, 2)
    assert torch.equal(cache[:, :, :20], pinned[:, :, :20])
    with pytest.raises(ValueError):
        flow.inference(
            tiny,
            g("in_prompt_token"),
            g("in_prompt_feat"),
            g("in_embedding"),
            pinned,
            noise=z[:, :, :25],
            n_timesteps=1,
        )


def test_generator_noise_is_reproducible(flow: FlowModel, fx: dict[str, torch.Tensor]) -> None:
    def g(name: str) -> torch.Tensor:
        return fx[f"tok40_noprompt/{name}"]

    def run(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        mel, _ = flow.inference(
            g("in_token"),
            g("in_prompt_token"),
            g("in_prompt_feat"),
            g("in_embedding"),
            None,
            generator=gen,
            n_timesteps=2,
        )
        return mel

    a, b, c = run(1), run(1), run(2)
    assert a.shape == (1, 80, 68)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    with pytest.raises(ValueError):
        flow.inference(
            g("in_token"),
            g("in_prompt_token"),
            g("in_prompt_feat"),
            g("in_embedding"),
            None,
            noise=torch.zeros(1, 80, 67),
        )


def test_time_biases_computed_ahead_give_the_same_pass(flow: FlowModel) -> None:
    """An ODE solve computes every step's time biases in one batch (one row per step): a pass
    given its step's row must match a pass that computes them from t itself."""
    estimator = flow.decoder.estimator
    gen = torch.Generator().manual_seed(0)
    x, mu, cond = (torch.randn(2, 80, 24, generator=gen) for _ in range(3))
    spks = torch.randn(2, 80, generator=gen)
    mask = torch.ones(2, 1, 24)
    times = torch.tensor([0.0, 0.3, 0.9])
    with torch.inference_mode():
        ahead = estimator.time_biases(times)
        for step, t in enumerate(times):
            alone = estimator(x, mask, mu, t.expand(2), spks, cond)
            given = estimator(
                x,
                mask,
                mu,
                t.expand(2),
                spks,
                cond,
                time_biases=[b[step : step + 1] for b in ahead],
            )
            torch.testing.assert_close(given, alone, atol=1e-6, rtol=1e-5)
        with pytest.raises(ValueError, match="time biases"):
            estimator(x, mask, mu, times[0].expand(2), spks, cond, time_biases=ahead[:-1])


def test_solve_refuses_zero_steps(flow: FlowModel) -> None:
    z = torch.zeros(1, 80, 8)
    with pytest.raises(ValueError, match="n_timesteps"):
        flow.decoder.solve(z, z, torch.zeros(1, 80), z, n_timesteps=0, cfg_rate=0.7)
