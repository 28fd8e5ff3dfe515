"""CosyVoice3 speech LM parity vs the official teacher-forced cases (tiny random-weight model)."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TESTS

from engine.core.hparams import ModelConfigError, read_model_yaml
from engine.core.quantize import INT8_LINEAR_TYPES, next_token_kl
from engine.core.sampling import argmax_draw, nucleus_candidates, ras_sampling
from engine.core.types import ModelLoadError
from engine.cosyvoice2.qwen2 import Qwen2Config
from engine.cosyvoice3.lm import (
    CosyVoice3LM,
    build_cosyvoice3_lm,
    cosyvoice3_lm_args,
    load_cosyvoice3_lm,
    load_cosyvoice3_lm_args,
)
from engine.cosyvoice3.model_dir import (
    RL_LM_FILE,
    is_cosyvoice3_dir,
    load_lm,
    missing_model_files,
)
from engine.family import model_family
from engine.family_facts import COSYVOICE3

DATA = TESTS / "data" / "cosyvoice3"
TINY = DATA / "tiny"
V2_TINY = TESTS / "data" / "cosyvoice2" / "tiny"
CASES = ("zero_shot", "cross_lingual", "instruct2")
SEEDS = (11, 12, 13)
# Four times the official code's own spread (tests/data/cosyvoice3/README.md, tolerance table).
ATOL_LOGITS = 5.4e-5  # logits and log-probs: 1.34e-5 (emulated Arm; x86 7.6e-6)
ATOL_HIDDEN = 1.1e-5  # hidden states and the cache: 2.53e-6 (emulated Arm; x86 2.1e-6)
NUCLEUS_PROBS_ATOL = 7.9e-6  # softmax of the stored logits: 1.97e-6 (emulated Arm; x86 8.3e-7)
# KL(fp32 || int8) of the next-token distribution over the teacher-forced steps; the tiny model
# measures mean 6e-3…7.6e-3 / max 3.5e-2 nats per case (its 32-wide layers quantise coarsely);
# the bounds are CosyVoice2's, whose tiny model measures about the same.
MAX_MEAN_KL = 2e-2
MAX_STEP_KL = 1e-1


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return torch.load(TINY / "llm.pt", weights_only=True)


@pytest.fixture(scope="module")
def model(state) -> CosyVoice3LM:
    return load_cosyvoice3_lm(state, load_cosyvoice3_lm_args(TINY))


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


def _fed(fx: dict[str, torch.Tensor], case: str) -> list[int]:
    """The tokens fed back at steps 1…20 (the last forced token stops and is never fed)."""
    return fx[f"{case}/forced_tokens"][:-1].tolist()


def _teacher_forced(model: CosyVoice3LM, fx: dict, case: str) -> tuple[list, list[int], object]:
    lm_input = model.build_input(*_inputs(fx, case))
    tokens = _fed(fx, case)
    with torch.inference_mode():
        cache = model.new_cache(lm_input.shape[1] + len(tokens))
        starts = [cache.length]
        outs = [model.prefill(lm_input, cache)]
        for token in tokens:
            starts.append(cache.length)
            outs.append(model.decode_step(token, cache))
    return outs, starts, cache


def test_args_from_model_folder() -> None:
    args = load_cosyvoice3_lm_args(TINY)
    assert (args.speech_token_size, args.llm_input_size, args.mix_ratio) == (6561, 32, (5, 15))
    assert (args.sampling.top_p, args.sampling.top_k) == (0.8, 25)
    assert (args.sampling.win_size, args.sampling.tau_r) == (10, 0.1)
    assert args.backbone.vocab_size == 1288  # the tiny vocabulary's 1281 tokens, rounded up


def test_a_cosyvoice2_llm_section_is_refused() -> None:
    v2_llm = read_model_yaml(V2_TINY / "cosyvoice2.yaml")["llm"]
    backbone = Qwen2Config.read(TINY / "CosyVoice-BlankEN")
    with pytest.raises(ModelConfigError, match="expected CosyVoice3LM"):
        cosyvoice3_lm_args(v2_llm, backbone, "x.yaml")


def test_special_ids_and_stop_tokens(model: CosyVoice3LM, meta: dict) -> None:
    ids = meta["special_ids"]
    assert (model.SOS, model.end_of_speech) == (ids["sos"], ids["eos"])
    assert (model.TASK_ID, model.fill_token) == (ids["task_id"], ids["fill"])
    assert sorted(model.stop_tokens) == list(range(ids["stop_ids"][0], ids["stop_ids"][1] + 1))
    assert model.eos == ids["sos"]  # the index the official sampler masks before min_len
    assert not hasattr(model, "llm_embedding") and model.llm_decoder.bias is None
    assert model.llm_decoder.out_features == model.speech_embedding.num_embeddings == 6761


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_input_layout(model: CosyVoice3LM, fx: dict, meta: dict, case: str) -> None:
    """SOS and TASK_ID are rows of the speech embedding; text, then prompt speech."""
    with torch.inference_mode():
        lm_input = model.build_input(*_inputs(fx, case))
    torch.testing.assert_close(lm_input[0], fx[f"{case}/lm_input"], atol=0, rtol=0)
    assert lm_input.shape[1] == meta["cases"][case]["layout"]["prompt_speech"][1]
    assert meta["cases"][case]["sos_row_is_speech_embedding"]
    assert meta["cases"][case]["task_row_is_speech_embedding"]
    step_inputs = model.speech_embedding.weight[_fed(fx, case)]
    torch.testing.assert_close(step_inputs, fx[f"{case}/step_inputs"], atol=0, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_teacher_forced_steps(model: CosyVoice3LM, fx: dict, case: str) -> None:
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
def test_generate_teacher_forced(model: CosyVoice3LM, fx: dict, meta: dict, case: str) -> None:
    """generate(): what is masked per step, the log-probs the sampler gets, the stop."""
    info = meta["cases"][case]
    n_text = fx[f"{case}/in_text"].shape[1]
    assert model.length_limits(n_text) == (info["min_len"], info["max_len"])
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
    assert forced[-1] == info["stop_token"]
    assert len(seen) == len(forced)
    for got, ref, masked in zip(seen, expected, info["masked_indices_per_step"], strict=True):
        got_masked = torch.nonzero(torch.isinf(got) & (got < 0)).flatten().tolist()
        assert got_masked == masked  # only SOS (6561): EOS and the rest stay drawable
        keep = torch.isfinite(got)
        torch.testing.assert_close(got[keep], ref[keep], atol=ATOL_LOGITS, rtol=0)
    assert histories[-1] == forced[:-1]


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_sampling_candidates_match_official(
    model: CosyVoice3LM, fx: dict, meta: dict, case: str
) -> None:
    """The nucleus and the repetition fallback of engine.core.sampling on the official scores."""
    info = meta["cases"][case]
    logp = fx[f"{case}/logits"].log_softmax(dim=-1)
    for step, masked in enumerate(info["masked_indices_per_step"]):
        logp[step, masked] = float("-inf")
    forced = fx[f"{case}/forced_tokens"].tolist()
    fallbacks = []
    for step in range(logp.shape[0]):
        probs, indices = nucleus_candidates(logp[step], 0.8, 25)
        n = info["nucleus_sizes"][step]
        assert indices.tolist() == fx[f"{case}/nucleus_indices"][step, :n].tolist()
        want = fx[f"{case}/nucleus_probs"][step, :n]
        torch.testing.assert_close(probs, want, atol=NUCLEUS_PROBS_ATOL, rtol=0)
        pick = ras_sampling(logp[step], forced[:step], model.args.sampling, draw=argmax_draw)
        assert pick == fx[f"{case}/ras_argmax_mock_pick"][step]
        fallbacks.append(pick != int(indices[0]))
    assert fallbacks == fx[f"{case}/ras_argmax_mock_fallback"].tolist()
    assert [i for i, f in enumerate(fallbacks) if f] == info["ras_fallback_steps"]


@pytest.mark.parity
@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_sampling_draws_the_official_tokens(
    model: CosyVoice3LM, fx: dict, meta: dict, seed: int
) -> None:
    """Real draws: the official run after torch.manual_seed(seed) and ours from a generator so
    seeded take the same tokens and stop at the same step (on an id >= 6561 before min_len)."""
    got = list(
        model.generate(*_inputs(fx, "zero_shot"), generator=torch.Generator().manual_seed(seed))
    )
    assert got == fx[f"sampled_seed{seed}/tokens"].tolist()
    sampled = meta["sampled"][f"seed{seed}"]
    assert sampled["last_draw"] >= model.speech_token_size
    assert len(got) < meta["cases"]["zero_shot"]["min_len"]


@pytest.mark.parametrize("stop", [6561, 6562, 6563, 6564, 6700, 6760])
def test_every_id_past_the_speech_tokens_ends_the_answer(
    model: CosyVoice3LM, fx: dict, stop: int
) -> None:
    out = list(model.generate(*_inputs(fx, "instruct2"), forced_tokens=[5, 6560, stop, 9]))
    assert out == [5, 6560]


# --- int8 ---------------------------------------------------------------------------------------


def test_int8_lm_stays_close(model: CosyVoice3LM, fx: dict) -> None:
    int8 = copy.deepcopy(model).quantize_int8()
    names = model.int8_layer_names()
    assert len(names) == 4 * model.args.backbone.num_hidden_layers + 1
    for name in names:
        assert isinstance(int8.get_submodule(name), INT8_LINEAR_TYPES), name
    for case in CASES:
        reference = torch.cat([o.logits for o in _teacher_forced(model, fx, case)[0]])
        candidate = torch.cat([o.logits for o in _teacher_forced(int8, fx, case)[0]])
        kl = next_token_kl(reference, candidate)
        assert kl.mean() <= MAX_MEAN_KL, (case, kl)
        assert kl.max() <= MAX_STEP_KL, (case, kl)
        assert kl.max() > 0  # the int8 path really ran


def test_int8_load_option(state: dict) -> None:
    int8 = load_cosyvoice3_lm(state, load_cosyvoice3_lm_args(TINY), int8=True)
    assert isinstance(int8.llm_decoder, INT8_LINEAR_TYPES)


# --- loading ------------------------------------------------------------------------------------


def test_full_size_manifest_matches() -> None:
    """The released llm.pt's keys and shapes are exactly those of the module built full size."""
    manifest = json.loads((DATA / "manifest_full.json").read_text())
    backbone = Qwen2Config.from_dict(manifest["qwen2_config"])
    llm = read_model_yaml(DATA / "cosyvoice3_0.5b.yaml")["llm"]
    args = cosyvoice3_lm_args(llm, backbone, "cosyvoice3_0.5b.yaml")
    assert (args.backbone.hidden_size, args.backbone.num_hidden_layers) == (896, 24)
    model = build_cosyvoice3_lm(args)  # meta: no memory
    expected = {e["key"]: e["shape"] for e in manifest["modules"]["llm"]["state_dict"]}
    got = {k: list(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    assert got == expected
    n_params = sum(p.numel() for p in model.parameters())  # tied: the embedding counted once
    assert n_params == manifest["modules"]["llm"]["parameters"]
    assert len(model.int8_layer_names()) == 24 * 4 + 1


def test_strict_loading_names_the_keys() -> None:
    """A CosyVoice2 llm.pt does not fit: its extra table, bias and narrower tables are named."""
    v2_state = torch.load(V2_TINY / "llm.pt", weights_only=True)
    with pytest.raises(ModelLoadError) as err:
        load_cosyvoice3_lm(v2_state, load_cosyvoice3_lm_args(TINY), source="llm.pt")
    message = str(err.value)
    assert message.startswith("llm.pt does not fit the CosyVoice3 LM")
    assert "llm_embedding.weight" in message and "llm_decoder.bias" in message
    assert "speech_embedding.weight (6564, 32) != (6761, 32)" in message


def _copy_model_dir(tmp_path: Path) -> Path:
    target = tmp_path / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, target)
    return target


def test_model_dir_files_and_the_rl_lm(tmp_path: Path, fx: dict) -> None:
    model_dir = _copy_model_dir(tmp_path)
    assert is_cosyvoice3_dir(model_dir) and not is_cosyvoice3_dir(V2_TINY)
    assert missing_model_files(model_dir) == []
    assert missing_model_files(model_dir, rl_lm=True) == [RL_LM_FILE]
    with pytest.raises(ModelLoadError, match=f"missing {RL_LM_FILE}"):
        load_lm(model_dir, rl_lm=True)
    # the RL LM has llm.pt's keys and shapes; a changed weight shows it is the one read
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    state["llm_decoder.weight"] = state["llm_decoder.weight"] * 2
    torch.save(state, model_dir / RL_LM_FILE)
    plain, rl = load_lm(model_dir), load_lm(model_dir, rl_lm=True)
    torch.testing.assert_close(rl.llm_decoder.weight, plain.llm_decoder.weight * 2)
    (model_dir / "CosyVoice-BlankEN" / "merges.txt").unlink()
    (model_dir / "flow.pt").unlink()
    assert missing_model_files(model_dir) == ["flow.pt", "CosyVoice-BlankEN/merges.txt"]


def test_a_cosyvoice3_directory_is_the_cosyvoice3_family() -> None:
    assert COSYVOICE3.config_file == "cosyvoice3.yaml" and COSYVOICE3.sample_rate == 24000
    assert model_family(TINY) is COSYVOICE3
