"""RelPosEncoder parity vs the official fixtures (tiny random-weight model) and the cache."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import DATA

from engine.core import transformer
from engine.core.transformer import (
    ROW_BLOCK,
    STORED_POSITIONS,
    RelPosEncoder,
    rel_pos_table,
    store_position_rows,
)
from engine.cosyvoice1.hparams import load_model_args

CASES = ("sft", "zero_shot", "instruct")
# Against the official outputs: four times its own spread (tests/data/README.md, tolerance table).
LM_ATOL = 4.8e-6  # LM text encoder, hidden states, cache: 1.2e-6
FLOW_ENCODER_ATOL = 1.6e-5  # flow encoder: 3.8e-6


def _sub(sd: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def args():
    return load_model_args(DATA / "tiny_model" / "cosyvoice.yaml")


@pytest.fixture(scope="module")
def llm_sd():
    return torch.load(DATA / "tiny_model" / "llm.pt", weights_only=True)


@pytest.fixture(scope="module")
def llm_fx():
    return torch.load(DATA / "llm_fixtures.pt", weights_only=True)


@pytest.fixture(scope="module")
def lm_encoder(args, llm_sd):
    enc = RelPosEncoder(args.llm.llm).eval()
    enc.load_state_dict(_sub(llm_sd, "llm."), strict=True)
    return enc


def test_rel_pos_table_layout():
    pe = rel_pos_table(8, 3)  # relative positions 2, 1, 0, -1, -2
    assert pe.shape == (5, 8)
    rel = torch.tensor([2.0, 1.0, 0.0, -1.0, -2.0]).unsqueeze(1)
    w = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    expect = torch.zeros(5, 8, dtype=torch.float64)
    expect[:, 0::2] = torch.sin(rel * w)
    expect[:, 1::2] = torch.cos(rel * w)
    torch.testing.assert_close(pe.double(), expect, atol=1e-6, rtol=0)


def test_rel_pos_table_rows_do_not_depend_on_table_length(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Tables start short and double; the official one has 5000 rows. Same float32 ops per row,
    # so every row must be bit-identical to the official table's, +m and -m alike.
    monkeypatch.setattr(transformer, "_tables", {})  # built here, from the shortest size
    d, n = 16, 5000
    position = torch.arange(0, n, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * -(math.log(10000.0) / d))
    pos, neg = torch.zeros(n, d), torch.zeros(n, d)
    pos[:, 0::2] = torch.sin(position * div_term)
    pos[:, 1::2] = torch.cos(position * div_term)
    neg[:, 0::2] = torch.sin(-1 * position * div_term)
    neg[:, 1::2] = torch.cos(-1 * position * div_term)

    def official(length: int) -> torch.Tensor:  # relative positions length-1 … -(length-1)
        return torch.cat([pos[:length].flip(0), neg[1:length]])

    short = rel_pos_table(d, 40)
    assert transformer._tables[d][0].shape[0] == 512
    assert torch.equal(short, official(40))
    long = rel_pos_table(d, 3000)  # grows the cached table past the first size
    assert transformer._tables[d][0].shape[0] == 4096
    assert torch.equal(long, official(3000))
    assert torch.equal(rel_pos_table(d, 40), short)
    rel_pos_table(d, 4500)
    assert transformer._tables[d][0].shape[0] == 5000  # never beyond the official length


def test_state_dict_keys_match_official(args, llm_sd):
    enc = RelPosEncoder(args.llm.text_encoder)
    assert set(enc.state_dict()) == set(_sub(llm_sd, "text_encoder."))
    enc = RelPosEncoder(args.llm.llm)
    assert set(enc.state_dict()) == set(_sub(llm_sd, "llm."))


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_text_encoder_causal(args, llm_sd, llm_fx, case):
    enc = RelPosEncoder(args.llm.text_encoder).eval()
    enc.load_state_dict(_sub(llm_sd, "text_encoder."), strict=True)
    x = llm_fx[f"{case}/text_embedding_out"].unsqueeze(0)
    with torch.inference_mode():
        out = enc(x, torch.tensor([x.shape[1]]))
    torch.testing.assert_close(out[0], llm_fx[f"{case}/text_encoder_out"], atol=LM_ATOL, rtol=0)


def test_causal_pass_uses_the_cached_rows_and_agrees_with_all_positions(args, llm_sd):
    """A causal full pass scores with the cached rows of m >= 0 (linear_pos is then no longer
    read), and equals projecting all 2T-1 relative positions under the same mask."""
    enc = RelPosEncoder(args.llm.text_encoder).eval()
    enc.load_state_dict(_sub(llm_sd, "text_encoder."), strict=True)
    attention = enc.encoders[0].self_attn
    t = 23
    x = torch.randn(
        1, t, args.llm.text_encoder.output_size, generator=torch.Generator().manual_seed(4)
    )
    mask = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
    with torch.inference_mode():
        every_position = attention(x, mask)
        cached = attention(x, mask, causal=True)
    torch.testing.assert_close(cached, every_position, atol=1e-5, rtol=0)
    assert attention._pos_cache is not None and len(attention._pos_cache[1]) == 1  # one block


@pytest.mark.parity
@pytest.mark.parametrize("case", ["tok40_noprompt", "tok60_prompt15"])
def test_flow_encoder_bidirectional(args, case):
    sd = torch.load(DATA / "tiny_model" / "flow.pt", weights_only=True)
    fx = torch.load(DATA / "flow_fixtures.pt", weights_only=True)
    enc = RelPosEncoder(args.flow.encoder).eval()
    enc.load_state_dict(_sub(sd, "encoder."), strict=True)
    tokens = torch.cat([fx[f"{case}/in_prompt_token"], fx[f"{case}/in_token"]], dim=1).long()
    x = torch.nn.functional.embedding(tokens, sd["input_embedding.weight"])
    with torch.inference_mode():
        out = enc(x, torch.tensor([tokens.shape[1]]))
    torch.testing.assert_close(out, fx[f"{case}/encoder_out"], atol=FLOW_ENCODER_ATOL, rtol=0)


def test_padding_lengths_match_unpadded(args, llm_sd):
    """Right-padded batch row == the same row alone (bidirectional and causal)."""
    for enc_args in (args.flow.encoder, args.llm.text_encoder):
        torch.manual_seed(0)
        enc = RelPosEncoder(enc_args).eval()
        x = torch.randn(2, 9, enc_args.input_size)
        with torch.inference_mode():
            both = enc(x, torch.tensor([9, 6]))
            alone = enc(x[1:, :6])
        torch.testing.assert_close(both[1, :6], alone[0], atol=1e-5, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_cached_decode_matches_fixture_and_full(lm_encoder, llm_fx, case):
    lm_input = llm_fx[f"{case}/lm_input"].unsqueeze(0)
    steps = llm_fx[f"{case}/step_inputs"]
    with torch.inference_mode():
        cache = lm_encoder.new_cache(1, lm_input.shape[1] + len(steps) + 3)
        hidden = [lm_encoder.forward_cached(lm_input, cache)[:, -1]]
        for s in steps:
            hidden.append(lm_encoder.forward_cached(s.view(1, 1, -1), cache)[:, -1])
        hidden_t = torch.cat(hidden)
        full = lm_encoder(torch.cat([lm_input[0], steps]).unsqueeze(0))[0, lm_input.shape[1] - 1 :]
    torch.testing.assert_close(hidden_t, llm_fx[f"{case}/llm_last_hidden"], atol=LM_ATOL, rtol=0)
    torch.testing.assert_close(hidden_t, full, atol=1e-5, rtol=0)
    att = cache.att_cache()
    torch.testing.assert_close(att, llm_fx[f"{case}/final_att_cache"], atol=LM_ATOL, rtol=0)


def test_chunked_prefill_and_weight_reload(args):
    """Prefill in two chunks == one chunk; reloading weights invalidates the positional cache."""
    torch.manual_seed(1)
    enc = RelPosEncoder(args.llm.llm).eval()
    x = torch.randn(1, 12, args.llm.llm.input_size)
    with torch.inference_mode():
        c1 = enc.new_cache(1, 16)
        one = enc.forward_cached(x, c1)
        c2 = enc.new_cache(1, 16)
        two = torch.cat([enc.forward_cached(x[:, :5], c2), enc.forward_cached(x[:, 5:], c2)], 1)
    torch.testing.assert_close(one, two, atol=1e-5, rtol=0)
    other = RelPosEncoder(args.llm.llm)
    enc.load_state_dict(other.state_dict())
    with torch.inference_mode():
        got = enc.forward_cached(x, enc.new_cache(1, 16))
        expect = enc(x)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def test_decode_steps_after_a_weight_reload_use_the_new_weights(args):
    """The one-sequence decode step caches the stacked position biases (and the positional
    rows): reloading weights must invalidate them, as it does for the full pass."""
    torch.manual_seed(6)
    enc = RelPosEncoder(args.llm.llm).eval()
    x = torch.randn(1, 9, args.llm.llm.input_size)

    def decode() -> torch.Tensor:
        cache = enc.new_cache(1, 9)
        outs = [enc.forward_cached(x[:, :5], cache)]
        outs += [enc.forward_cached(x[:, i : i + 1], cache) for i in range(5, 9)]
        return torch.cat(outs, 1)

    with torch.inference_mode():
        decode()
    other = RelPosEncoder(args.llm.llm)
    for layer in other.encoders:  # the default init leaves little to tell the biases apart
        torch.nn.init.normal_(layer.self_attn.pos_bias_u)
        torch.nn.init.normal_(layer.self_attn.pos_bias_v)
    enc.load_state_dict(other.state_dict())
    with torch.inference_mode():
        got, expect = decode(), enc(x)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=0)


def test_batched_left_padded_cache(args):
    """Two prompts of different length in one left-padded batch decode like separate runs."""
    torch.manual_seed(2)
    enc = RelPosEncoder(args.llm.llm).eval()
    d = args.llm.llm.input_size
    a, b = torch.randn(1, 7, d), torch.randn(1, 4, d)
    steps = torch.randn(3, 2, 1, d)
    with torch.inference_mode():
        batch = torch.zeros(2, 7, d)
        batch[0], batch[1, 3:] = a[0], b[0]
        cache = enc.new_cache(2, 12)
        outs = [enc.forward_cached(batch, cache, lengths=torch.tensor([7, 4]))[:, -1]]
        outs += [enc.forward_cached(s, cache)[:, -1] for s in steps]
        for row, prompt in enumerate((a, b)):
            solo = enc.new_cache(1, 12)
            ref = [enc.forward_cached(prompt, solo)[:, -1]]
            ref += [enc.forward_cached(s[row : row + 1], solo)[:, -1] for s in steps]
            got = torch.stack([o[row] for o in outs])
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, torch.cat(ref), atol=1e-5, rtol=0)


def test_positional_cache_grows_across_capacity(args):
    """Decoding past the first 256-position block extends the cached rows correctly."""
    torch.manual_seed(3)
    enc = RelPosEncoder(args.llm.llm).eval()
    x = torch.randn(1, 262, args.llm.llm.input_size)
    with torch.inference_mode():
        cache = enc.new_cache(1, 262)
        outs = [enc.forward_cached(x[:, :250], cache)]
        outs += [enc.forward_cached(x[:, i : i + 1], cache) for i in range(250, 262)]
        expect = enc(x)
    assert len(enc.encoders[0].self_attn._pos_cache[1]) == 2  # blocks of 256 positions
    torch.testing.assert_close(torch.cat(outs, 1), expect, atol=1e-5, rtol=0)


@pytest.mark.parametrize("batch", [1, 2], ids=["one-prompt", "left-padded-batch"])
def test_unwritten_cache_positions_are_never_read(args, batch: int):
    """new_cache leaves its memory uninitialised: positions not yet written (here NaN) must not
    reach any output, neither in the one-query decode kernel nor in the masked batch path."""
    torch.manual_seed(4)
    enc = RelPosEncoder(args.llm.llm).eval()
    d = args.llm.llm.input_size
    prompt, steps = torch.randn(batch, 5, d), torch.randn(3, batch, 1, d)
    lengths = torch.tensor([5, 3]) if batch == 2 else None

    def run(poison: bool) -> torch.Tensor:
        cache = enc.new_cache(batch, 12)
        cache.kv.fill_(float("nan") if poison else 0.0)
        outs = [enc.forward_cached(prompt, cache, lengths=lengths)[:, -1]]
        outs += [enc.forward_cached(s, cache)[:, -1] for s in steps]
        return torch.stack(outs)

    with torch.inference_mode():
        clean, poisoned = run(False), run(True)
    assert torch.isfinite(poisoned).all()
    torch.testing.assert_close(poisoned, clean, atol=0, rtol=0)


# --- positional rows held by the layers (what a prepared file stores) -------------------------


def _loaded(args, llm_sd, held_positions: int | None) -> RelPosEncoder:
    """The tiny LM encoder with the checkpoint's weights, holding the positional rows of its
    first ``held_positions`` relative positions (None: none, computed at run time)."""
    enc = RelPosEncoder(args.llm.llm).eval()
    enc.load_state_dict(_sub(llm_sd, "llm."), strict=True)
    if held_positions is not None:
        store_position_rows(enc, held_positions)
    return enc


def test_held_rows_equal_the_rows_computed_at_run_time(args, llm_sd):
    """Bit for bit: a layer's held rows are what a layer without them computes when it needs
    them, and what one F.linear over every position computes (the reversed, pre-scaled rows)."""
    held = _loaded(args, llm_sd, STORED_POSITIONS)
    computing = _loaded(args, llm_sd, None)
    blocks = STORED_POSITIONS // ROW_BLOCK
    for layer, other in zip(held.encoders, computing.encoders, strict=True):
        attention = layer.self_attn
        rows = attention.pos_rows
        assert rows is not None and rows.dtype == attention.linear_pos.weight.dtype
        assert rows.shape == (blocks, attention.h, ROW_BLOCK, attention.d_k)
        with torch.inference_mode():
            at_run_time = torch.stack(other.self_attn._row_blocks(blocks))
        assert torch.equal(rows, at_run_time)
        pos, _ = transformer.rel_pos_tables(attention.linear_pos.in_features, STORED_POSITIONS)
        w = attention.linear_pos.weight
        with torch.no_grad():  # relative positions STORED_POSITIONS-1 … 0
            whole = F.linear(pos[:STORED_POSITIONS].flip(0), w) * (1.0 / math.sqrt(attention.d_k))
        whole = whole.view(STORED_POSITIONS, attention.h, attention.d_k).transpose(0, 1)
        for block in range(blocks):
            end = STORED_POSITIONS - block * ROW_BLOCK
            assert torch.equal(rows[block], whole[:, end - ROW_BLOCK : end]), block


def _decode(enc: RelPosEncoder, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` positions, then one decode step per position of ``x``."""
    cache = enc.new_cache(x.shape[0], x.shape[1])
    outs = [enc.forward_cached(x[:, :prefill], cache)]
    outs += [enc.forward_cached(x[:, i : i + 1], cache) for i in range(prefill, x.shape[1])]
    return torch.cat(outs, 1)


def test_held_rows_serve_without_reading_linear_pos(args, llm_sd):
    """Within the held positions the layers read their rows, never linear_pos: with linear_pos
    poisoned, full passes and decode steps still equal those of a layer computing its rows."""
    x = torch.randn(1, 40, args.llm.llm.input_size, generator=torch.Generator().manual_seed(7))
    held = _loaded(args, llm_sd, ROW_BLOCK)
    for layer in held.encoders:
        weight = layer.self_attn.linear_pos.weight
        layer.self_attn.linear_pos.weight = torch.nn.Parameter(
            torch.full_like(weight, float("nan")), requires_grad=False
        )
    computing = _loaded(args, llm_sd, None)
    with torch.inference_mode():
        assert torch.equal(held(x), computing(x))
        assert torch.equal(_decode(held, x, 30), _decode(computing, x, 30))
        batch = x.expand(2, -1, -1).contiguous()  # the batched decode step
        assert torch.equal(_decode(held, batch, 30), _decode(computing, batch, 30))


def test_past_the_held_rows_they_are_computed_from_linear_pos(args, llm_sd):
    """A sequence longer than the held rows reads linear_pos for the blocks past them only: the
    held block is used in place, and every output equals that of a layer computing all rows."""
    x = torch.randn(1, 262, args.llm.llm.input_size, generator=torch.Generator().manual_seed(8))
    held = _loaded(args, llm_sd, ROW_BLOCK)
    computing = _loaded(args, llm_sd, None)
    with torch.inference_mode():
        assert torch.equal(_decode(held, x, 250), _decode(computing, x, 250))
        assert torch.equal(held(x), computing(x))
    attention = held.encoders[0].self_attn
    assert attention._pos_cache is not None and attention.pos_rows is not None
    blocks = attention._pos_cache[1]
    assert len(blocks) == 2 and blocks[0].data_ptr() == attention.pos_rows.data_ptr()


def test_held_rows_are_part_of_the_state_dict(args, llm_sd):
    """Rows and the weight they come from travel together: the state dict of a layer holding
    rows has them (an official one does not), and a reload replaces both."""
    plain = _loaded(args, llm_sd, None)
    assert set(plain.state_dict()) == set(_sub(llm_sd, "llm."))
    held = _loaded(args, llm_sd, ROW_BLOCK)
    extra = set(held.state_dict()) - set(plain.state_dict())
    assert extra == {f"encoders.{i}.self_attn.pos_rows" for i in range(len(held.encoders))}
    with pytest.raises(RuntimeError, match="pos_rows"):  # a state dict without them
        held.load_state_dict(plain.state_dict(), strict=True)
    torch.manual_seed(9)
    other = RelPosEncoder(args.llm.llm).eval()
    store_position_rows(other, ROW_BLOCK)
    x = torch.randn(1, 12, args.llm.llm.input_size)
    with torch.inference_mode():
        _decode(held, x, 5)  # rows of the first weights in use
        held.load_state_dict(other.state_dict())
        assert torch.equal(_decode(held, x, 5), _decode(other, x, 5))


def test_storing_rows_keeps_no_table_of_the_stored_positions(
    args, llm_sd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the meta device (what a load builds) the rows are shapes only; computing them for a
    prepared file does not keep a sin/cos table of all stored positions for the process."""
    monkeypatch.setattr(transformer, "_tables", {})
    with torch.device("meta"):
        on_meta = RelPosEncoder(args.llm.llm)
    store_position_rows(on_meta)
    attention = on_meta.encoders[0].self_attn
    rows = attention.pos_rows
    assert rows is not None and rows.is_meta
    assert rows.shape == (STORED_POSITIONS // ROW_BLOCK, attention.h, ROW_BLOCK, attention.d_k)
    _loaded(args, llm_sd, STORED_POSITIONS)
    assert transformer._tables == {}
