"""The CosyVoice2 flow (CausalMaskedDiffWithXvec): config, strict loading, the full-size key
manifest, the chunk-causal invariants of the encoder and estimator, and parity with the official
reference cases (tests/data/cosyvoice2)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import TESTS

from engine.core.hparams import ModelConfigError, read_model_yaml
from engine.core.types import ModelLoadError
from engine.cosyvoice2.flow import (
    CausalFlow,
    FlowStream,
    build_flow,
    int8_layer_names,
    load_flow,
)
from engine.cosyvoice2.flow_args import (
    NOISE_FRAMES,
    CausalFlowArgs,
    flow_args_from_doc,
    load_flow_args,
)
from engine.cosyvoice2.flow_cache import KVBuffer

DATA = TESTS / "data" / "cosyvoice2"
TINY = DATA / "tiny"
FULL_YAML = DATA / "cosyvoice2_0.5b.yaml"


@pytest.fixture(scope="module")
def args() -> CausalFlowArgs:
    return load_flow_args(TINY / "cosyvoice2.yaml")


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return torch.load(TINY / "flow.pt", weights_only=True)


@pytest.fixture(scope="module")
def flow(args: CausalFlowArgs, state: dict[str, torch.Tensor]) -> CausalFlow:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return load_flow(state, args)


def _prompt(n_tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 6561, (1, n_tokens), generator=g)
    feat = torch.randn(1, 2 * n_tokens, 80, generator=g)
    return tokens, feat, torch.randn(1, 192, generator=g)


# --- config and loading ----------------------------------------------------------------------


def test_full_size_config_numbers() -> None:
    args = load_flow_args(FULL_YAML)
    assert (args.input_frame_rate, args.token_mel_ratio, args.pre_lookahead_len) == (25, 2, 3)
    assert args.encoder.static_chunk_size == 25 and args.encoder.num_blocks == 6
    # ``!ref <chunk_size> * <token_mel_ratio>``: an expression, evaluated
    assert args.estimator.static_chunk_size == 50
    assert args.estimator.channels == (256,) and args.estimator.num_mid_blocks == 12
    assert args.estimator.num_decoding_left_chunks == -1
    assert args.inference_cfg_rate == pytest.approx(0.7) and args.t_scheduler == "cosine"


def test_full_size_flow_matches_manifest() -> None:
    manifest = json.loads((DATA / "manifest_full.json").read_text(encoding="utf-8"))
    flow = build_flow(load_flow_args(FULL_YAML))  # on meta: no 450 MB allocation
    ours = {k: tuple(v.shape) for k, v in flow.state_dict().items()}
    expected = {e["key"]: tuple(e["shape"]) for e in manifest["modules"]["flow"]["state_dict"]}
    assert ours == expected
    assert (
        sum(v.numel() for v in flow.state_dict().values())
        == (manifest["modules"]["flow"]["parameters"])
    )


def test_int8_layer_names_are_linear_layers_of_the_manifest() -> None:
    flow = build_flow(load_flow_args(FULL_YAML))
    names = int8_layer_names(flow)
    assert names and not any(n.endswith("linear_pos") for n in names)
    assert all(isinstance(flow.get_submodule(n), torch.nn.Linear) for n in names)
    assert "decoder.estimator.mid_blocks.11.1.3.attn1.to_q" in names
    assert "encoder.up_encoders.3.self_attn.linear_q" in names


def _doc_with(path: Path, **estimator: object) -> dict:
    doc = read_model_yaml(path)
    doc["flow"].args["decoder"].args["estimator"].args.update(estimator)
    return doc


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"channels": [48, 48]}, "channels' must have one entry"),
        ({"num_decoding_left_chunks": 2}, "num_decoding_left_chunks' must be negative"),
        ({"static_chunk_size": 40}, "static_chunk_size times token_mel_ratio"),
        ({"act_fn": "snake"}, "act_fn' must be 'gelu'"),
    ],
)
def test_config_the_causal_design_cannot_run_is_refused(change: dict, message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        flow_args_from_doc(_doc_with(TINY / "cosyvoice2.yaml", **change))


def test_tiny_flow_loads_strictly(flow: CausalFlow, state: dict[str, torch.Tensor]) -> None:
    assert set(flow.state_dict()) == set(state)
    assert not any(p.is_meta for p in flow.parameters())
    assert all(torch.equal(flow.state_dict()[k], v) for k, v in state.items())


def test_missing_unexpected_and_misshapen_keys_are_named(
    args: CausalFlowArgs, state: dict[str, torch.Tensor]
) -> None:
    bad = dict(state)
    del bad["encoder.pre_lookahead_layer.conv1.weight"]
    bad["decoder.estimator.extra.weight"] = torch.zeros(1)
    bad["encoder_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ModelLoadError) as err:
        load_flow(bad, args, "flow.pt")
    text = str(err.value)
    assert "flow.pt" in text
    assert "missing keys: encoder.pre_lookahead_layer.conv1.weight" in text
    assert "unexpected keys: decoder.estimator.extra.weight" in text
    assert "encoder_proj.weight (3, 3) !=" in text


# --- invariants of the causal design ---------------------------------------------------------


@pytest.mark.parity
def test_fixed_noise_is_the_seed_zero_draw(flow: CausalFlow) -> None:
    torch.manual_seed(0)
    expected = torch.randn(1, 80, NOISE_FRAMES)
    assert torch.equal(flow.decoder.noise(0, NOISE_FRAMES), expected)
    with pytest.raises(ValueError, match="exceed the flow's fixed noise"):
        flow.decoder.noise(0, NOISE_FRAMES + 1)


def test_encoder_frames_do_not_depend_on_later_chunks(flow: CausalFlow) -> None:
    """Chunk attention and the 3-token look-ahead: the frames of the first 50 tokens are the
    same whatever follows the look-ahead."""
    tokens = torch.randint(0, 6561, (1, 120), generator=torch.Generator().manual_seed(1))
    other = tokens.clone()
    other[:, 53:] = torch.randint(0, 6561, (1, 67), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        a = flow.encode(tokens[:, :100], tokens[:, 100:103], streaming=True)
        b = flow.encode(other[:, :100], other[:, 100:103], streaming=True)
        full = flow.encode(tokens[:, :100], tokens[:, 100:103], streaming=False)
        changed = flow.encode(other[:, :100], other[:, 100:103], streaming=False)
    torch.testing.assert_close(a[:, :, :100], b[:, :, :100], atol=1e-6, rtol=0)
    assert (a[:, :, 100:] - b[:, :, 100:]).abs().max() > 1e-3  # later frames did change
    # Full attention sees the future: the same frames change.
    assert (full[:, :, :100] - changed[:, :, :100]).abs().max() > 1e-3


@pytest.mark.parametrize(("solver", "steps"), [("euler", 10), ("ab2", 4), ("heun", 2)])
def test_streamed_mel_equals_the_official_streaming_calls(
    flow: CausalFlow, solver: str, steps: int
) -> None:
    """FlowStream chunk by chunk = the official call over the growing prefix (which recomputes
    everything), chunk for chunk; with every solver (one estimator state per evaluation)."""
    prompt_tokens, prompt_feat, embedding = _prompt(30)
    tokens = torch.randint(0, 6561, (1, 160), generator=torch.Generator().manual_seed(3))
    settings = {"n_timesteps": steps, "solver": solver}
    stream = flow.stream(prompt_tokens, prompt_feat, embedding, **settings)
    offset, sent = 0, 0
    for hop in (45, 50, 50):  # the first hop brings the 30 prompt tokens to three chunks
        end = offset + hop + 3
        got = stream.push(tokens[:, sent:end])
        sent = end
        want = flow.inference(
            tokens[:, :end],
            prompt_tokens,
            prompt_feat,
            embedding,
            streaming=True,
            finalize=False,
            **settings,
        )[:, :, 2 * offset :]
        assert got.shape == want.shape == (1, 80, 2 * hop)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        offset += hop
    got = stream.push(tokens[:, sent:], finalize=True)
    want = flow.inference(
        tokens, prompt_tokens, prompt_feat, embedding, streaming=True, finalize=True, **settings
    )[:, :, 2 * offset :]
    assert got.shape == want.shape == (1, 80, 2 * (160 - offset))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_stream_waits_for_whole_chunks_and_look_ahead(flow: CausalFlow) -> None:
    prompt_tokens, prompt_feat, embedding = _prompt(10)
    stream = flow.stream(prompt_tokens, prompt_feat, embedding)
    assert stream.push(list(range(17))).shape == (1, 80, 0)  # 10 + 17 - 3 < 25
    assert stream.push([5]).shape == (1, 80, 2 * 15)  # 10 + 18 - 3 = 25: one chunk
    assert stream.push(list(range(10))).shape == (1, 80, 0)
    assert stream.push([], finalize=True).shape == (1, 80, 2 * 13)
    with pytest.raises(ValueError, match="finalized"):
        stream.push([1])


def test_prompt_mel_must_be_two_frames_a_token(flow: CausalFlow) -> None:
    prompt_tokens, prompt_feat, embedding = _prompt(10)
    with pytest.raises(ValueError, match=r"prompt mel must be \(1, 20, 80\)"):
        flow.stream(prompt_tokens, prompt_feat[:, :19], embedding)


# --- parity with the official reference cases (tests/data/cosyvoice2/flow_cases.*) ----------

# Four times the official code's own spread (tests/data/cosyvoice2/README.md, tolerance table).
ENC_TOL = {"atol": 2.3e-5, "rtol": 0.0}  # encoder stages and mu: 5.7e-6 (aarch64)
MEL_TOL = {"atol": 8.7e-5, "rtol": 0.0}  # estimator steps and mels: 2.17e-5 (aarch64)
# (case, tokens passed to the official call, streaming, finalize)
ONE_SHOT_CASES = {
    "nonstream_prompt": (90, False, True),
    "stream_chunk0": (33, True, False),
    "stream_chunk1": (83, True, False),
    "stream_chunk2": (90, False, True),
    "stream_final_chunk_causal_variant": (90, True, True),
}


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "flow_cases.pt", weights_only=True)


@pytest.fixture(scope="module")
def schedule() -> list[dict]:
    return json.loads((DATA / "flow_cases.json").read_text(encoding="utf-8"))["stream_schedule"]


def _inputs(cases: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return tuple(
        cases[f"inputs/{name}"] for name in ("tokens", "prompt_token", "prompt_feat", "embedding")
    )


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: dict, what: str) -> None:
    assert actual.shape == expected.shape, (
        f"{what}: {tuple(actual.shape)} vs {tuple(expected.shape)}"
    )
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parity
def test_fixed_noise_equals_the_official_prefix(
    flow: CausalFlow, cases: dict[str, torch.Tensor]
) -> None:
    # torch.randn's vectorised and scalar kernels round apart: 2.3e-6 with ATen's default ones
    got = flow.decoder.noise(0, 220)[0]
    torch.testing.assert_close(got, cases["fixed_noise_prefix"], atol=9.2e-6, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(ONE_SHOT_CASES))
def test_encoder_stages_match(flow: CausalFlow, cases: dict[str, torch.Tensor], case: str) -> None:
    n_tokens, streaming, finalize = ONE_SHOT_CASES[case]
    tokens, prompt_tokens, _, embedding = _inputs(cases)
    ids = torch.cat([prompt_tokens, tokens[:, :n_tokens]], dim=1)
    ahead = None
    if not finalize:
        ids, ahead = ids[:, :-3], ids[:, -3:]
    enc = flow.encoder
    seen: dict[str, torch.Tensor] = {}

    def record(name: str, take_input: bool = False) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            seen.setdefault(name, args[0] if take_input else out)  # the first call's

        return hook

    hooks = [
        enc.embed.register_forward_hook(record("embed")),
        enc.pre_lookahead_layer.register_forward_hook(record("pre")),
        enc.up_layer.register_forward_hook(record("layers", take_input=True)),
        enc.up_layer.register_forward_hook(record("up")),
    ]
    try:
        with torch.inference_mode():
            mu = flow.encode(ids, ahead, streaming=streaming)
            h = enc(
                flow.embed(ids), None if ahead is None else flow.embed(ahead), streaming=streaming
            )
            spks = flow.speaker(embedding)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(flow.embed(ids)[0], cases[f"{case}/enc_in"])
    _close(seen["embed"][0] * enc.xscale, cases[f"{case}/embed_out"], ENC_TOL, "embed_out")
    _close(seen["pre"][0], cases[f"{case}/pre_lookahead_out"], ENC_TOL, "pre_lookahead_out")
    _close(seen["layers"][0], cases[f"{case}/encoders_out"], ENC_TOL, "encoders_out")
    _close(seen["up"][0].T, cases[f"{case}/up_layer_out"], ENC_TOL, "up_layer_out")
    _close(h[0], cases[f"{case}/encoder_out"], ENC_TOL, "encoder_out")
    _close(mu[0].T, cases[f"{case}/mu"], ENC_TOL, "mu")
    _close(spks[0], cases[f"{case}/spk_proj"], ENC_TOL, "spk_proj")


@pytest.mark.parity
@pytest.mark.parametrize("case", sorted(ONE_SHOT_CASES))
def test_one_call_mel_matches(flow: CausalFlow, cases: dict[str, torch.Tensor], case: str) -> None:
    n_tokens, streaming, finalize = ONE_SHOT_CASES[case]
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(cases)
    mel = flow.inference(
        tokens[:, :n_tokens],
        prompt_tokens,
        prompt_feat,
        embedding,
        streaming=streaming,
        finalize=finalize,
    )
    _close(mel[0], cases[f"{case}/out_mel"], MEL_TOL, f"{case}/out_mel")


@pytest.mark.parity
def test_no_prompt_steps_match(flow: CausalFlow, cases: dict[str, torch.Tensor]) -> None:
    """Every Euler step: the x the estimator gets, its time, both guidance rows."""
    c = "nonstream_noprompt_short"
    tokens = cases[f"{c}/in_token"]
    steps: list[tuple[torch.Tensor, ...]] = []

    def record(step: int, x: torch.Tensor, t: torch.Tensor, dphi: torch.Tensor) -> None:
        steps.append((x[0].clone(), t.clone(), dphi[0].clone(), dphi[1].clone()))

    empty = torch.zeros(1, 0, dtype=torch.int32), torch.zeros(1, 0, 80)
    mel = flow.inference(
        tokens, *empty, cases["inputs/embedding"], streaming=False, finalize=True,
        step_callback=record,
    )  # fmt: skip
    assert len(steps) == 10
    for k, (x, t, cond, uncond) in enumerate(steps):
        _close(x, cases[f"{c}/step_x"][k], MEL_TOL, f"step {k} x")
        assert t.item() == cases[f"{c}/step_t"][k].item(), f"step {k} t"
        _close(cond, cases[f"{c}/step_v_cond"][k], MEL_TOL, f"step {k} v_cond")
        _close(uncond, cases[f"{c}/step_v_uncond"][k], MEL_TOL, f"step {k} v_uncond")
    _close(mel[0], cases[f"{c}/out_mel"], MEL_TOL, "out_mel")


@pytest.mark.parity
@pytest.mark.parametrize("streaming", [False, True])
def test_estimator_direct(
    flow: CausalFlow, cases: dict[str, torch.Tensor], streaming: bool
) -> None:
    """Batch 2, T = 67 (a partial last chunk), row 1 padded from frame 55, a time per row."""
    g = {k.split("/", 1)[1]: v for k, v in cases.items() if k.startswith("estimator_direct/")}
    with torch.inference_mode():
        out = flow.decoder.estimator(
            g["in_x"], g["in_mu"], g["in_t"], g["in_spks"], g["in_cond"],
            streaming=streaming, mask=g["in_mask"],
        )  # fmt: skip
    _close(out, g[f"out_streaming_{streaming}"], MEL_TOL, "estimator_direct")
    assert torch.all(out[1, :, 55:] == 0)


@pytest.mark.parity
def test_incremental_stream_matches_the_official_chunks(
    flow: CausalFlow, cases: dict[str, torch.Tensor], schedule: list[dict]
) -> None:
    """FlowStream, each chunk computed once on its own frames, gives the mel the official
    orchestration keeps of each (re-run) call; its last chunk is the chunk-attention variant
    of the official last call (which runs in full attention: see the streaming tests)."""
    tokens, prompt_tokens, prompt_feat, embedding = _inputs(cases)
    stream = flow.stream(prompt_tokens, prompt_feat, embedding)
    sent = 0
    for k, call in enumerate(schedule):
        end = call["tokens_passed"]
        mel = stream.push(tokens[:, sent:end], finalize=call["finalize"])
        sent = end
        assert mel.shape[2] == call["kept_mel_frames"]
        if call["streaming"]:
            _close(mel[0], cases[f"stream_chunk{k}/kept_mel"], MEL_TOL, f"chunk {k}")
        else:
            want = cases["stream_final_chunk_causal_variant/kept_mel"]
            _close(mel[0], want, MEL_TOL, "last chunk (chunk attention)")
    # Each estimator pass covered only its chunk's new frames (the prompt's in the first).
    assert stream.frames_per_step() == [40 + 60, 100, 20]


# --- prompt reuse and the narrower cache -----------------------------------------------------


def _push_all(stream: FlowStream, tokens: torch.Tensor, ends: list[int]) -> list[torch.Tensor]:
    out, sent = [], 0
    for end in ends:
        out.append(stream.push(tokens[:, sent:end]))
        sent = end
    out.append(stream.push(tokens[:, sent:], finalize=True))
    return out


def test_fork_of_a_primed_prompt_continues_like_a_fresh_stream(flow: CausalFlow) -> None:
    prompt = _prompt(50)
    tokens = torch.randint(0, 6561, (1, 60), generator=torch.Generator().manual_seed(4))
    ends = [28, 53]  # hops of 25, each with its 3 look-ahead tokens
    fresh = _push_all(flow.stream(*prompt), tokens, ends)

    base = flow.stream(*prompt)
    assert base.push([]).shape == (1, 80, 0)  # the prompt's first chunk: its look-ahead is known
    assert base.frames_per_step() == [50]
    first = base.fork()
    forked = _push_all(first, tokens, ends)
    # The fork's first chunk: the prompt's last chunk and the answer's first, nothing before.
    assert first.frames_per_step() == [50, 50 + 50, 50, 2 * 10]
    for got, want in zip(forked, fresh, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    other = base.fork()  # the base is untouched by its first fork
    again = _push_all(other, tokens, ends)
    for got, want in zip(again, forked, strict=True):
        assert torch.equal(got, want)
    with pytest.raises(ValueError, match="finalized"):
        other.fork()


def test_float16_cache_halves_the_estimator_memory(flow: CausalFlow) -> None:
    prompt = _prompt(25)
    tokens = torch.randint(0, 6561, (1, 80), generator=torch.Generator().manual_seed(5))
    exact_stream = flow.stream(*prompt)
    narrow_stream = flow.stream(*prompt, cache_dtype=torch.float16)
    exact = _push_all(exact_stream, tokens, [28, 78])
    narrow = _push_all(narrow_stream, tokens, [28, 78])

    def estimator_bytes(stream: FlowStream) -> int:
        return stream.cache_bytes - stream.encoder_state.kv_bytes

    assert 2 * estimator_bytes(narrow_stream) == estimator_bytes(exact_stream)
    assert torch.equal(narrow[0], exact[0])  # the first chunk attends only to itself
    # The bound the engine's default is chosen by (measured 2.7e-4 at a peak of 5.7).
    for got, want in zip(narrow[1:], exact[1:], strict=True):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=0)


def test_a_token_outside_the_speech_vocabulary_is_refused(flow: CausalFlow) -> None:
    stream = flow.stream(*_prompt(0))
    with pytest.raises(ValueError, match="speech token 6561 is not below the flow's 6561"):
        stream.push([1, 2, 6561], finalize=True)


def test_kv_pages_are_read_in_place_and_attend_like_one_sequence() -> None:
    g = torch.Generator().manual_seed(6)

    def heads(frames: int) -> torch.Tensor:  # (rows, heads, t, d) as a strided view, as made
        return torch.randn(2, frames, 4, 8, generator=g).transpose(1, 2)

    buffer = KVBuffer()
    keys, values, outs = [], [], []
    for frames in (10, 5, 7):
        q, k, v = heads(frames), heads(frames), heads(frames)
        outs.append(buffer.attend(q, k, v))
        keys.append(k)
        values.append(v)
        whole_k, whole_v = torch.cat(keys, dim=2), torch.cat(values, dim=2)
        want = torch.nn.functional.scaled_dot_product_attention(q, whole_k, whole_v)
        torch.testing.assert_close(outs[-1], want, atol=1e-6, rtol=1e-5)
    # Stored contiguous (keys transposed): no page is copied again when it is read.
    assert all(pk.is_contiguous() and pv.is_contiguous() for pk, pv in buffer.pages)
    assert buffer.length == 22
