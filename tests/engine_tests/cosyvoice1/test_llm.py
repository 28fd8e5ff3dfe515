"""TransformerLM parity vs the official teacher-forced fixtures (tiny random-weight model)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import DATA

from engine.cosyvoice1.hparams import load_model_args
from engine.cosyvoice1.llm import TransformerLM

CASES = ("sft", "zero_shot", "instruct")
# Four times the official code's own spread (tests/data/README.md, tolerance table).
ATOL_LOGITS = 7.6e-6  # logits and log-probs: 1.9e-6
ATOL_ENC = 4.8e-6  # encoder outputs, hidden states, the cache: 1.2e-6


@pytest.fixture(scope="module")
def model() -> TransformerLM:
    args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml")
    lm = TransformerLM(args.llm).eval()
    lm.load_state_dict(torch.load(DATA / "tiny_model" / "llm.pt", weights_only=True), strict=True)
    return lm


@pytest.fixture(scope="module")
def fx() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "llm_fixtures.pt", weights_only=True)


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((DATA / "llm_fixtures.json").read_text())


def _inputs(fx: dict[str, torch.Tensor], case: str) -> tuple:
    return (
        fx[f"{case}/in_text"],
        fx[f"{case}/in_prompt_text"],
        fx[f"{case}/in_prompt_speech_token"],
        fx[f"{case}/in_embedding"],
    )


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_input_assembly(model, fx, case):
    text, prompt_text, _, emb = _inputs(fx, case)
    ids = torch.cat([prompt_text, text], dim=1).long()
    with torch.inference_mode():
        emb_out = model.text_embedding(ids)
        enc = model.text_encoder(emb_out, torch.tensor([ids.shape[1]]))
        aff = model.text_encoder_affine_layer(enc)
        spk = model.speaker_input(emb)
        lm_input = model.build_input(*_inputs(fx, case))
    torch.testing.assert_close(emb_out[0], fx[f"{case}/text_embedding_out"], atol=0, rtol=0)
    torch.testing.assert_close(enc[0], fx[f"{case}/text_encoder_out"], atol=ATOL_ENC, rtol=0)
    torch.testing.assert_close(aff[0], fx[f"{case}/text_encoder_affine_out"], atol=ATOL_ENC, rtol=0)
    if case == "instruct":
        assert spk.shape == (1, 0, 64)
    else:
        torch.testing.assert_close(
            spk[0, 0], fx[f"{case}/spk_embed_affine_out"], atol=ATOL_ENC, rtol=0
        )
    torch.testing.assert_close(lm_input[0], fx[f"{case}/lm_input"], atol=ATOL_ENC, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_teacher_forced_steps(model, fx, meta, case):
    """Per-step logits / hidden / final cache through prefill + decode_step."""
    lm_input = fx[f"{case}/lm_input"].unsqueeze(0)
    tokens = fx[f"{case}/forced_tokens"]
    assert torch.equal(fx[f"{case}/step_inputs"], model.speech_embedding.weight[tokens].detach())
    with torch.inference_mode():
        cache = model.new_cache(lm_input.shape[1] + len(tokens))
        outs = [model.prefill(lm_input, cache)]
        offsets = [0]
        for tok in tokens.tolist():
            offsets.append(cache.length)
            outs.append(model.decode_step(tok, cache))
    assert offsets == fx[f"{case}/offsets"].tolist()
    hidden = torch.cat([o.hidden for o in outs])
    logits = torch.cat([o.logits for o in outs])
    torch.testing.assert_close(hidden, fx[f"{case}/llm_last_hidden"], atol=ATOL_ENC, rtol=0)
    torch.testing.assert_close(logits, fx[f"{case}/logits"], atol=ATOL_LOGITS, rtol=0)
    torch.testing.assert_close(
        cache.att_cache(), fx[f"{case}/final_att_cache"], atol=ATOL_ENC, rtol=0
    )
    info = meta["cases"][case]
    assert [list(s) for s in info["att_cache_out_shapes"]][-1] == list(cache.att_cache().shape)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_generate_teacher_forced(model, fx, meta, case):
    """generate(): EOS masking, log-probs handed to the sampler, and stop at a forced EOS."""
    expected = fx[f"{case}/logits"].log_softmax(dim=-1)
    masked = fx[f"{case}/eos_masked_steps"].tolist()
    forced = fx[f"{case}/forced_tokens"].tolist() + [model.eos]
    info = meta["cases"][case]
    assert model.length_limits(info["text_len"]) == (info["min_len"], info["max_len"])
    seen: list[torch.Tensor] = []
    histories: list[list[int]] = []

    def sampler(logp: torch.Tensor, history) -> int:
        seen.append(logp.clone())
        histories.append(list(history))
        return forced[len(seen) - 1]

    with torch.inference_mode():
        out = list(model.generate(*_inputs(fx, case), sampler=sampler))
    assert out == forced[:-1]
    assert len(seen) == len(forced) == len(masked)
    for step, (got, ref, is_masked) in enumerate(zip(seen, expected, masked, strict=True)):
        assert (got[model.eos] == float("-inf")) == is_masked
        assert is_masked == (step < info["min_len"])
        keep = torch.arange(got.shape[0]) != model.eos
        torch.testing.assert_close(got[keep], ref[keep], atol=ATOL_LOGITS, rtol=0)
    assert histories[-1] == forced[:-1]


def test_forced_tokens_and_cap(model, fx):
    text = fx["sft/in_text"][0].tolist()  # plain lists are accepted too
    emb = fx["sft/in_embedding"]
    forced = fx["sft/forced_tokens"].tolist()
    assert (
        list(model.generate(text, [], [], emb, forced_tokens=forced[:5] + [model.eos]))
        == forced[:5]
    )
    # The cap ends the stream without EOS; max_tokens overrides the 20x cap.
    assert list(model.generate(text, [], [], emb, forced_tokens=forced, max_tokens=7)) == forced[:7]
    assert list(model.generate(text, None, None, emb, max_tokens=0)) == []
    # max_tokens fixes the count: EOS stays masked even past the usual min_len (14 here).
    seen: list[bool] = []

    def sampler(logp, history) -> int:
        seen.append(bool(logp[model.eos] == float("-inf")))
        return 7

    assert len(list(model.generate(text, [], [], emb, max_tokens=20, sampler=sampler))) == 20
    assert all(seen)


def test_generate_is_lazy_and_seeded(model, fx):
    args = _inputs(fx, "zero_shot")
    gen = model.generate(*args, generator=torch.Generator().manual_seed(3), max_tokens=12)
    first = next(gen)  # a streaming consumer gets a token before the rest is computed
    rest = list(gen)
    again = list(model.generate(*args, generator=torch.Generator().manual_seed(3), max_tokens=12))
    assert [first, *rest] == again and len(again) == 12
    assert all(0 <= t < model.eos for t in again)
    assert not torch.is_inference_mode_enabled()


@pytest.mark.parity
def test_batched_decode_matches_single(model, fx):
    """Two requests of different prompt length in one left-padded batch."""
    with torch.inference_mode():
        a = model.build_input(*_inputs(fx, "sft"))
        b = model.build_input(*_inputs(fx, "instruct"))
        width = max(a.shape[1], b.shape[1])
        batch = torch.zeros(2, width, a.shape[2])
        batch[0, width - a.shape[1] :], batch[1, width - b.shape[1] :] = a[0], b[0]
        cache = model.new_cache(width + 4, batch=2)
        lengths = torch.tensor([a.shape[1], b.shape[1]])
        logits = [model.prefill(batch, cache, lengths).logits]
        toks = fx["sft/forced_tokens"][:3]
        logits += [model.decode_step(torch.stack([t, t]), cache).logits for t in toks]
    for row, case in enumerate(("sft", "instruct")):
        got = torch.stack([lg[row] for lg in logits])
        torch.testing.assert_close(got, fx[f"{case}/logits"][:4], atol=ATOL_LOGITS, rtol=0)


def _decoded_from_scratch(lm: TransformerLM, lm_input: torch.Tensor, tokens: list[int]) -> list:
    """Each step's logits with the input layer computed anew at every step."""
    cache = lm.new_cache(lm_input.shape[1] + len(tokens))
    logits = [lm.prefill(lm_input, cache).logits]
    for token in tokens[:-1]:
        x = lm.speech_embedding(torch.tensor([[token]]))
        hidden = lm.llm.forward_cached(x, cache)[:, -1]
        logits.append(lm.llm_decoder(hidden))
    return logits


def test_a_token_decoded_again_reuses_its_input_row(fx, monkeypatch):
    """A speech token's input row is computed once: later steps with it give what computing
    it anew gives, bit for bit; changed input-layer weights start the rows afresh."""
    args = load_model_args(DATA / "tiny_model" / "cosyvoice.yaml")
    lm = TransformerLM(args.llm).eval()
    lm.load_state_dict(torch.load(DATA / "tiny_model" / "llm.pt", weights_only=True), strict=True)
    tokens = [3, 7, 3, 3, 9, 7, 3, 1]
    distinct = len(set(tokens[:-1]))
    calls: list[int] = []
    real_input_row = lm.llm.input_row
    monkeypatch.setattr(lm.llm, "input_row", lambda x: calls.append(1) or real_input_row(x))

    def decoded() -> tuple[list, int]:
        """The answer's logits and how many input rows its decode steps computed."""
        before = len(calls)
        with torch.inference_mode():
            lm_input = lm.build_input(*_inputs(fx, "sft"))
            cache = lm.new_cache(lm_input.shape[1] + len(tokens))
            logits = [lm.prefill(lm_input, cache).logits]
            logits += [lm.decode_step(token, cache).logits for token in tokens[:-1]]
            computed = len(calls) - before
            expected = _decoded_from_scratch(lm, lm_input, tokens)
        for got, want in zip(logits, expected, strict=True):
            assert torch.equal(got, want)
        return logits, computed

    first, computed = decoded()
    assert computed == distinct
    assert decoded()[1] == 0  # a second answer computes none
    with torch.no_grad():
        lm.llm.embed.out[0].weight.mul_(1.5)
    changed, computed = decoded()
    assert computed == distinct
    assert not torch.equal(first[1], changed[1])
