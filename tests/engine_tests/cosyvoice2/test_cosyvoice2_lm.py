"""CosyVoice2 speech LM parity vs the official teacher-forced cases (tiny random-weight model)."""

from __future__ import annotations

import copy
import json
import threading
from pathlib import Path

import pytest
import torch
from conftest import TESTS
from torch.utils._python_dispatch import TorchDispatchMode

from engine.core.hparams import ModelConfigError, TaggedNode, read_model_yaml
from engine.core.quantize import INT8_LINEAR_TYPES, int8_linear, next_token_kl
from engine.core.sampling import argmax_draw, nucleus_candidates, ras_sampling
from engine.core.types import ModelLoadError, SynthesisCancelled
from engine.cosyvoice2.lm import (
    CosyVoice2LM,
    build_speech_lm,
    load_speech_lm,
    load_speech_lm_args,
    speech_lm_args,
)
from engine.cosyvoice2.qwen2 import Qwen2Config

DATA = TESTS / "data" / "cosyvoice2"
TINY = DATA / "tiny"
CASES = ("zero_shot", "instruct2", "cross_lingual")
# Four times the official code's own spread (tests/data/cosyvoice2/README.md, tolerance table).
ATOL_LOGITS = 5.6e-5  # logits (|22| at most) and log-probs: 1.4e-5
ATOL_HIDDEN = 1.2e-5  # hidden states and the cache: 2.9e-6
NUCLEUS_PROBS_ATOL = 3.1e-6  # softmax of stored logits: 7.7e-7
# KL(fp32 || int8) of the next-token distribution over the teacher-forced steps. The tiny model
# measures mean 8e-3 / max 5.6e-2 nats: its 32-wide layers quantise coarsely and its rescaled
# decoder makes sharp distributions (the MLPs account for most of it, the decoder for 1e-3).
MAX_MEAN_KL = 2e-2
MAX_STEP_KL = 1e-1


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return torch.load(TINY / "llm.pt", weights_only=True)


@pytest.fixture(scope="module")
def model(state) -> CosyVoice2LM:
    return load_speech_lm(state, load_speech_lm_args(TINY))


@pytest.fixture(scope="module")
def fx() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "llm_cases.pt", weights_only=True)


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((DATA / "llm_cases.json").read_text())


def _inputs(fx: dict[str, torch.Tensor], case: str) -> tuple[torch.Tensor, ...]:
    return (
        fx[f"{case}/in_text"],
        fx[f"{case}/in_prompt_text"],
        fx[f"{case}/in_prompt_speech_token"],
    )


def _forced(fx: dict[str, torch.Tensor], case: str) -> list[int]:
    """The tokens fed back at steps 1…20 (the last forced token, EOS, is never fed)."""
    return fx[f"{case}/forced_tokens"][:-1].tolist()


def _teacher_forced(model: CosyVoice2LM, fx: dict, case: str) -> tuple[list, list[int], object]:
    lm_input = model.build_input(*_inputs(fx, case))
    tokens = _forced(fx, case)
    with torch.inference_mode():
        cache = model.new_cache(lm_input.shape[1] + len(tokens))
        starts = [cache.length]
        outs = [model.prefill(lm_input, cache)]
        for token in tokens:
            starts.append(cache.length)
            outs.append(model.decode_step(token, cache))
    return outs, starts, cache


def test_args_from_model_folder() -> None:
    args = load_speech_lm_args(TINY)
    assert (args.speech_token_size, args.llm_input_size, args.mix_ratio) == (6561, 32, (5, 15))
    assert (args.sampling.top_p, args.sampling.top_k) == (0.8, 25)
    assert (args.sampling.win_size, args.sampling.tau_r) == (10, 0.1)
    cfg = args.backbone
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert (cfg.head_dim, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == (
        8,
        1024,
        1e6,
        True,
    )


def test_special_rows_and_stop_tokens(model: CosyVoice2LM, meta: dict) -> None:
    ids = meta["special_ids"]
    assert (model.SOS, model.TASK_ID) == (ids["sos_row"], ids["task_id_row"])
    assert model.eos == ids["eos"] and model.fill_token == ids["fill"]
    assert sorted(model.stop_tokens) == ids["stop_tokens"]


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_input_layout(model: CosyVoice2LM, fx: dict, meta: dict, case: str) -> None:
    with torch.inference_mode():
        lm_input = model.build_input(*_inputs(fx, case))
    torch.testing.assert_close(lm_input[0], fx[f"{case}/lm_input"], atol=0, rtol=0)
    assert lm_input.shape[1] == meta[case]["layout"]["prefill_length"]
    step_inputs = model.speech_embedding.weight[fx[f"{case}/forced_tokens"][:-1]]
    torch.testing.assert_close(step_inputs, fx[f"{case}/step_inputs"], atol=0, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_teacher_forced_steps(model: CosyVoice2LM, fx: dict, case: str) -> None:
    """Hidden state, logits and rotary positions of every step; the K/V cache at the end."""
    outs, starts, cache = _teacher_forced(model, fx, case)
    assert starts == fx[f"{case}/positions_start"].tolist()
    hidden = torch.cat([o.hidden for o in outs])
    logits = torch.cat([o.logits for o in outs])
    torch.testing.assert_close(hidden, fx[f"{case}/last_hidden"], atol=ATOL_HIDDEN, rtol=0)
    torch.testing.assert_close(logits, fx[f"{case}/logits"], atol=ATOL_LOGITS, rtol=0)
    kv = cache.kv[:, :, 0, :, : cache.length]  # (layers, 2, kv_heads, T, head_dim)
    torch.testing.assert_close(kv[:, 0], fx[f"{case}/final_k"], atol=ATOL_HIDDEN, rtol=0)
    torch.testing.assert_close(kv[:, 1], fx[f"{case}/final_v"], atol=ATOL_HIDDEN, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_generate_teacher_forced(model: CosyVoice2LM, fx: dict, meta: dict, case: str) -> None:
    """generate(): EOS masking per step, the log-probs the sampler gets, stop at EOS."""
    info = meta[case]
    assert model.length_limits(info["text_len"]) == (info["min_len"], info["max_len"])
    forced = fx[f"{case}/forced_tokens"].tolist()
    expected = fx[f"{case}/logits"].log_softmax(dim=-1)
    seen: list[torch.Tensor] = []
    histories: list[list[int]] = []

    def sampler(logp: torch.Tensor, history) -> int:
        seen.append(logp.clone())
        histories.append(list(history))
        return forced[len(seen) - 1]

    out = list(model.generate(*_inputs(fx, case), sampler=sampler))
    assert out == info["yielded_tokens"] == forced[:-1]
    assert len(seen) == len(forced)
    for step, (got, ref, masked) in enumerate(
        zip(seen, expected, fx[f"{case}/eos_masked"].tolist(), strict=True)
    ):
        assert bool(got[model.eos] == float("-inf")) == masked == (step < info["min_len"])
        assert torch.isfinite(got[model.eos + 1 :]).all()  # the other stop tokens stay drawable
        keep = torch.arange(got.shape[0]) != model.eos
        torch.testing.assert_close(got[keep], ref[keep], atol=ATOL_LOGITS, rtol=0)
    assert histories[-1] == forced[:-1]


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_sampling_candidates_match_official(
    model: CosyVoice2LM, fx: dict, meta: dict, case: str
) -> None:
    """The nucleus and the repetition fallback of engine.core.sampling on the official scores."""
    logp = fx[f"{case}/logits"].log_softmax(dim=-1)
    logp[fx[f"{case}/eos_masked"], model.eos] = float("-inf")
    forced = fx[f"{case}/forced_tokens"].tolist()
    fallbacks = []
    for step in range(logp.shape[0]):
        probs, indices = nucleus_candidates(logp[step], 0.8, 25)
        n = meta[case]["nucleus_sizes"][step]
        assert indices.tolist() == fx[f"{case}/nucleus_indices"][step, :n].tolist()
        want = fx[f"{case}/nucleus_probs"][step, :n]
        torch.testing.assert_close(probs, want, atol=NUCLEUS_PROBS_ATOL, rtol=0)
        pick = ras_sampling(logp[step], forced[:step], model.args.sampling, draw=argmax_draw)
        assert pick == fx[f"{case}/ras_argmax_mock_pick"][step]
        # the fallback redraws with the nucleus pick at -inf, so it picks another token
        fallbacks.append(pick != int(indices[0]))
    assert fallbacks == fx[f"{case}/ras_argmax_mock_fallback"].tolist()
    assert [i for i, f in enumerate(fallbacks) if f] == meta[case]["ras_fallback_steps"]


@pytest.mark.parametrize("stop", [6561, 6562, 6563])
def test_every_stop_token_ends_the_answer(model: CosyVoice2LM, fx: dict, stop: int) -> None:
    """EOS is masked before min_len, so the sampler cannot pick it then; 6562/6563 end it."""
    forced = [5, 7, stop, 9]
    out = list(model.generate(*_inputs(fx, "instruct2"), forced_tokens=forced))
    assert out == [5, 7]


def test_max_tokens_and_forced_tokens(model: CosyVoice2LM, fx: dict) -> None:
    text = fx["cross_lingual/in_text"][0].tolist()  # plain lists are accepted too
    forced = _forced(fx, "cross_lingual")
    assert list(model.generate(text, forced_tokens=forced[:5] + [model.eos])) == forced[:5]
    assert list(model.generate(text, [], [], forced_tokens=forced, max_tokens=7)) == forced[:7]
    assert list(model.generate(text, max_tokens=0)) == []
    assert list(model.generate([], forced_tokens=forced)) == []  # no text: max_len 0
    # max_tokens fixes the count: EOS stays masked past the usual min_len (32 here).
    masked: list[bool] = []

    def sampler(logp: torch.Tensor, history) -> int:
        masked.append(bool(logp[model.eos] == float("-inf")))
        return 7

    assert len(list(model.generate(text, max_tokens=40, sampler=sampler))) == 40
    assert all(masked)


def test_generate_is_lazy_and_seeded(model: CosyVoice2LM, fx: dict) -> None:
    args = _inputs(fx, "zero_shot")
    gen = model.generate(*args, generator=torch.Generator().manual_seed(3), max_tokens=12)
    first = next(gen)  # a streaming consumer gets a token before the rest is computed
    rest = list(gen)
    again = list(model.generate(*args, generator=torch.Generator().manual_seed(3), max_tokens=12))
    assert [first, *rest] == again and len(again) == 12
    assert all(0 <= t < model.speech_token_size for t in again)
    assert not torch.is_inference_mode_enabled()


def test_cancel_is_checked_per_token(model: CosyVoice2LM, fx: dict) -> None:
    cancel = threading.Event()
    gen = model.generate(*_inputs(fx, "zero_shot"), max_tokens=10, cancel=cancel)
    next(gen)
    next(gen)
    cancel.set()
    with pytest.raises(SynthesisCancelled):
        next(gen)
    with pytest.raises(SynthesisCancelled):  # set before the start: no prefill at all
        next(model.generate(*_inputs(fx, "zero_shot"), cancel=cancel))


@pytest.mark.parity
def test_batched_decode_matches_single(model: CosyVoice2LM, fx: dict) -> None:
    """Two copies of a sequence in one batch run the batched path and give the same logits."""
    lm_input = model.build_input(*_inputs(fx, "instruct2"))
    tokens = torch.tensor(_forced(fx, "instruct2")[:4])
    with torch.inference_mode():
        cache = model.new_cache(lm_input.shape[1] + 4, batch=2)
        logits = [model.prefill(lm_input.expand(2, -1, -1), cache).logits]
        logits += [model.decode_step(torch.stack([t, t]), cache).logits for t in tokens]
    got = torch.stack(logits)  # (steps, 2, V)
    for row in range(2):
        torch.testing.assert_close(
            got[:, row], fx["instruct2/logits"][:5], atol=ATOL_LOGITS, rtol=0
        )


@pytest.mark.parity
def test_prefill_in_pieces_equals_one_prefill(model: CosyVoice2LM, fx: dict) -> None:
    """Positions continue from the cache: the layout appended in two parts gives the same."""
    lm_input = model.build_input(*_inputs(fx, "zero_shot"))
    with torch.inference_mode():
        cache = model.new_cache(lm_input.shape[1])
        model.prefill(lm_input[:, :20], cache)
        out = model.prefill(lm_input[:, 20:], cache)
    torch.testing.assert_close(out.logits[0], fx["zero_shot/logits"][0], atol=ATOL_LOGITS, rtol=0)


def test_cache_overflow_is_an_error(model: CosyVoice2LM, fx: dict) -> None:
    lm_input = model.build_input(*_inputs(fx, "instruct2"))
    with torch.inference_mode(), pytest.raises(ValueError, match="KV cache full"):
        model.prefill(lm_input, model.new_cache(lm_input.shape[1] - 1))


# --- int8 ---------------------------------------------------------------------------------------


def test_int8_lm_stays_close(model: CosyVoice2LM, fx: dict) -> None:
    int8 = copy.deepcopy(model).quantize_int8()
    names = model.int8_layer_names()
    assert len(names) == 4 * model.args.backbone.num_hidden_layers + 1
    for name in names:
        assert isinstance(int8.get_submodule(name), INT8_LINEAR_TYPES), name
    block = int8.backbone.layers[0]
    for float_layer in ("q_proj", "k_proj", "v_proj"):
        assert not hasattr(block.self_attn, float_layer)
    assert not hasattr(block.mlp, "gate_proj") and not hasattr(block.mlp, "up_proj")
    for case in CASES:
        reference = torch.cat([o.logits for o in _teacher_forced(model, fx, case)[0]])
        candidate = torch.cat([o.logits for o in _teacher_forced(int8, fx, case)[0]])
        kl = next_token_kl(reference, candidate)
        assert kl.mean() <= MAX_MEAN_KL, (case, kl)
        assert kl.max() <= MAX_STEP_KL, (case, kl)
        assert kl.max() > 0  # the int8 path really ran


def test_fused_int8_layers_equal_separate_ones(model: CosyVoice2LM) -> None:
    """Stacking q/k/v (gate/up) rows in one int8 layer changes no value: per-row scales."""
    attn = model.backbone.layers[0].self_attn
    x = torch.randn(1, 3, model.args.llm_input_size, generator=torch.Generator().manual_seed(0))
    int8 = copy.deepcopy(model).quantize_int8()
    fused = int8.backbone.layers[0].self_attn.qkv_proj
    separate = [int8_linear(p.weight, p.bias) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    torch.testing.assert_close(fused(x), torch.cat([s(x) for s in separate], -1), atol=0, rtol=0)


# --- loading ------------------------------------------------------------------------------------


def _full_size_args():
    manifest = json.loads((DATA / "manifest_full.json").read_text())
    backbone = Qwen2Config.from_dict(manifest["qwen2_config"])
    llm = read_model_yaml(DATA / "cosyvoice2_0.5b.yaml")["llm"]
    return manifest, speech_lm_args(llm, backbone, "cosyvoice2_0.5b.yaml")


def test_full_size_manifest_matches() -> None:
    """The released llm.pt's keys and shapes are exactly those of the module built full size."""
    manifest, args = _full_size_args()
    assert (args.backbone.hidden_size, args.backbone.num_hidden_layers) == (896, 24)
    model = build_speech_lm(args)  # meta: no memory
    expected = {e["key"]: e["shape"] for e in manifest["modules"]["llm"]["state_dict"]}
    got = {k: list(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    assert got == expected
    n_params = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    assert n_params == manifest["modules"]["llm"]["parameters"]
    assert len(model.int8_layer_names()) == 24 * 4 + 1


def test_strict_loading_names_the_keys(state: dict) -> None:
    args = load_speech_lm_args(TINY)
    bad = dict(state)
    del bad["llm.model.model.layers.1.mlp.up_proj.weight"]
    bad["llm.model.model.layers.9.extra"] = torch.zeros(1)
    bad["llm_decoder.bias"] = torch.zeros(7)
    with pytest.raises(ModelLoadError) as err:
        load_speech_lm(bad, args, source="llm.pt")
    message = str(err.value)
    assert "missing keys: llm.model.model.layers.1.mlp.up_proj.weight" in message
    assert "unexpected keys: llm.model.model.layers.9.extra" in message
    assert "llm_decoder.bias (7,) != (6564,)" in message
    assert message.startswith("llm.pt")


def test_tied_head_may_be_left_out(state: dict, fx: dict) -> None:
    """A file without the (tied, unused) text head loads; the head is the embedding."""
    without_head = {k: v for k, v in state.items() if k != "llm.model.lm_head.weight"}
    model = load_speech_lm(without_head, load_speech_lm_args(TINY))
    head = model.llm.model.lm_head.weight
    assert head is model.backbone.embed_tokens.weight
    outs = _teacher_forced(model, fx, "instruct2")[0]
    torch.testing.assert_close(
        outs[3].logits[0], fx["instruct2/logits"][3], atol=ATOL_LOGITS, rtol=0
    )


def test_untied_head_is_required(state: dict) -> None:
    args = load_speech_lm_args(TINY)
    untied = args.__class__(
        **{
            **args.__dict__,
            "backbone": Qwen2Config(**{**args.backbone.__dict__, "tie_word_embeddings": False}),
        }
    )
    without_head = {k: v for k, v in state.items() if k != "llm.model.lm_head.weight"}
    with pytest.raises(ModelLoadError, match="missing keys: llm.model.lm_head.weight"):
        load_speech_lm(without_head, untied)


def test_config_errors_are_clear(tmp_path: Path) -> None:
    config = json.loads((TINY / "CosyVoice-BlankEN" / "config.json").read_text())
    with pytest.raises(ModelConfigError, match="rope_scaling"):
        Qwen2Config.from_dict({**config, "rope_scaling": {"type": "yarn", "factor": 4.0}})
    with pytest.raises(ModelConfigError, match="'hidden_size' must be a number"):
        Qwen2Config.from_dict({**config, "hidden_size": "32"})
    with pytest.raises(ModelConfigError, match="multiple of num_key_value_heads"):
        Qwen2Config.from_dict({**config, "num_key_value_heads": 3})
    backbone = Qwen2Config.from_dict(config)
    llm = read_model_yaml(TINY / "cosyvoice2.yaml")["llm"]
    with pytest.raises(ModelConfigError, match="must equal the backbone's hidden_size"):
        speech_lm_args(llm, Qwen2Config.from_dict({**config, "hidden_size": 64}), "x.yaml")
    v3 = TaggedNode(llm.kind, "cosyvoice.llm.llm.CosyVoice3LM", llm.args)
    with pytest.raises(ModelConfigError, match="expected Qwen2LM"):
        speech_lm_args(v3, backbone, "x.yaml")
    (tmp_path / "CosyVoice-BlankEN").mkdir()
    (tmp_path / "cosyvoice2.yaml").write_text((TINY / "cosyvoice2.yaml").read_text())
    with pytest.raises(ModelConfigError, match="config.json"):
        load_speech_lm_args(tmp_path)


class _OpCount(TorchDispatchMode):
    """Counts the torch operators dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops += 1
        return func(*args, **(kwargs or {}))


# Operators of one decode step of the tiny two-layer model (float32 / int8). Every one costs
# dispatch time on the CPU, 24 layers a token at full size: a change that adds some shows here.
DECODE_STEP_OPS = {False: 87, True: 81}


@pytest.mark.parametrize("int8", [False, True])
def test_decode_step_keeps_to_its_operator_budget(state: dict, int8: bool) -> None:
    model = load_speech_lm(state, load_speech_lm_args(TINY), int8=int8)
    with torch.inference_mode():
        cache = model.new_cache(8)
        model.prefill(model.build_input([1, 2, 3]), cache)
        with _OpCount() as count:
            model.decode_step(5, cache)
    assert count.ops <= DECODE_STEP_OPS[int8]


def test_decode_step_leaves_its_input_row_alone(model: CosyVoice2LM) -> None:
    """The single-position path adds to its running row in place: never to the caller's row
    (here a view of the special-token embedding, as the bistream session feeds it)."""
    before = model.llm_embedding.weight.clone()
    with torch.inference_mode():
        cache = model.new_cache(8)
        model.prefill(model.build_input([1, 2, 3]), cache)
        model.backbone.forward_cached(model.special_input(model.TASK_ID), cache)
    assert torch.equal(model.llm_embedding.weight, before)
