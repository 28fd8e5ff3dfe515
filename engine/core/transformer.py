"""Relative-position Transformer blocks shared by the LM text encoder, the LM and the flow encoder.

One class, :class:`RelPosEncoder`, covers the three official encoders: an input layer
(Linear → LayerNorm(1e-5) [→ ReLU for ``linear_legacy``]) scaled by sqrt(d), pre-LN layers with
ESPnet relative-position self-attention and a position-wise FFN, then ``after_norm``. Attribute
names equal the official state-dict keys so ``load_state_dict(strict=True)`` works.

Relative positions: score bias ``bd[i, j] = (q_i + pos_bias_v) · P[m]`` with ``m = pos(i) - pos(j)``
and ``P = linear_pos(pe)``, ``pe`` the interleaved sin/cos table. Causal encoders (the LM, its text
encoder) only ever attend to m >= 0: their rows of P are computed once per layer, in blocks of
256 positions, and shared (``linear_pos`` has no bias and the table is constant), so a decode step
only reads the rows of its L positions, which removes the O(L·d²) per-step cost of the official
code. A prepared file holds each causal layer's first blocks (:func:`store_position_rows`): a
request then reads the blocks its positions fall in, and ``linear_pos`` is read only when a
sequence grows past them. The bidirectional flow encoder recomputes P over the 2T-1 positions at
every pass.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core import decode_step
from engine.core.decode_attention import attend_one
from engine.core.hparams import EncoderArgs

# The official table has 5000 rows; each row is computed on its own, so a shorter table holds the
# same values. Starting small and doubling keeps ≈ 50 MB of never-read rows out of memory.
_MIN_TABLE_LEN = 512
_OFFICIAL_TABLE_LEN = 5000
_tables: dict[int, tuple[Tensor, Tensor]] = {}
_tables_lock = threading.Lock()

# A causal layer's positional rows come in blocks of this many relative positions: a sequence of
# length L reads ceil(L / ROW_BLOCK) of them (of a prepared file, only those blocks' pages).
ROW_BLOCK = 256
# The relative positions whose rows a prepared file holds per causal layer: the LM's longest
# sequence for a built-in voice (one segment of at most 80 text tokens: up to 20 speech tokens
# each after about 85 input positions) fits. Changing it changes what a prepared file holds.
STORED_POSITIONS = 2048


def rel_pos_tables(d: int, n: int) -> tuple[Tensor, Tensor]:
    """(pos, neg), each (N >= n, d) float32: rows m hold the encodings of +m and -m.

    Even dims sin, odd dims cos, w_i = 10000^(-2i/d); computed with the same float32 ops as the
    official 5000-row table so the values are identical (N: 512 doubled until it holds n, but
    never more than the larger of n and 5000).
    """
    cached = _tables.get(d)
    if cached is not None and cached[0].shape[0] >= n:
        return cached
    with _tables_lock:
        cached = _tables.get(d)
        if cached is not None and cached[0].shape[0] >= n:
            return cached
        size = _MIN_TABLE_LEN
        while size < n:
            size *= 2
        size = min(size, max(n, _OFFICIAL_TABLE_LEN))  # no larger than the official table
        _tables[d] = _encodings(d, size)
        return _tables[d]


def _encodings(d: int, size: int) -> tuple[Tensor, Tensor]:
    """(pos, neg), each (size, d): the tables of :func:`rel_pos_tables`, not kept."""
    position = torch.arange(0, size, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * -(math.log(10000.0) / d))
    pos = torch.zeros(size, d)
    neg = torch.zeros(size, d)
    pos[:, 0::2] = torch.sin(position * div_term)
    pos[:, 1::2] = torch.cos(position * div_term)
    neg[:, 0::2] = torch.sin(-1 * position * div_term)
    neg[:, 1::2] = torch.cos(-1 * position * div_term)
    return pos, neg


def rel_pos_table(d: int, length: int) -> Tensor:
    """(2L-1, d) encodings of relative positions L-1, L-2, …, -(L-1) (official slice order)."""
    pos, neg = rel_pos_tables(d, length)
    return torch.cat([pos[:length].flip(0), neg[1:length]], dim=0)


def _row_block(weight: Tensor, heads: int, block: int, pos: Tensor) -> Tensor:
    """(h, B, d_k) = linear_pos(pe) / sqrt(d_k) of relative positions (block+1)·B-1 … block·B,
    B = ``ROW_BLOCK``, for the ``linear_pos`` weight ``weight`` (d, d), in its dtype; ``pos``
    the encodings of positions 0 … (block+1)·B-1 at least."""
    d_k = weight.shape[0] // heads
    first, end = block * ROW_BLOCK, (block + 1) * ROW_BLOCK
    with torch.no_grad():
        rows = F.linear(pos[first:end].flip(0).to(dtype=weight.dtype, device=weight.device), weight)
        rows = rows * (1.0 / math.sqrt(d_k))  # pre-scaled: saves a per-step multiply
    return rows.view(ROW_BLOCK, heads, d_k).transpose(0, 1).contiguous()


def _joined(scores: list[Tensor], dim: int) -> Tensor:
    """Scores computed block by block, joined along ``dim`` (one block: no copy)."""
    return scores[0] if len(scores) == 1 else torch.cat(scores, dim)


def skew(raw: Tensor, t: int, length: int) -> Tensor:
    """Relative → absolute key index: out[..., i, j] = raw[..., i, t-1-i+j].

    ``raw`` (..., T, W) is contiguous with column c ↔ relative position (L-1) - c and W >= L+T-1;
    queries sit at absolute positions L-T+i. Equivalent to the official pad/reshape rel_shift.
    """
    if t == 1:
        return raw[..., :length]
    w = raw.shape[-1]
    size = (*raw.shape[:-2], t, length)
    stride = (*raw.stride()[:-2], w - 1, 1)
    return raw.as_strided(size, stride, raw.storage_offset() + t - 1)


def weight_key(w: Tensor) -> tuple:
    """Identity of a weight's current values: storage + in-place version (changes on reload)."""
    try:
        version = w._version
    except RuntimeError:  # inference tensors have no version counter
        version = -1
    return (w.data_ptr(), version, w.device, w.dtype)


@dataclass
class KVCache:
    """Preallocated K/V of every layer: ``kv`` (layers, 2, B, heads, max_len, d_k).

    ``length`` positions are filled. ``key_mask`` (B, max_len) bool, False for left padding of
    batched prompts of different lengths (None = every position valid).
    """

    kv: Tensor
    length: int = 0
    key_mask: Tensor | None = None

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def att_cache(self, batch_index: int = 0) -> Tensor:
        """The official layout: (layers, heads, length, [K | V]) for one batch row."""
        kv = self.kv[:, :, batch_index, :, : self.length]  # (layers, 2, h, T, d_k)
        return torch.cat([kv[:, 0], kv[:, 1]], dim=-1)


class InputLayer(nn.Module):
    """``embed.out``: Linear → LayerNorm(1e-5) → (Dropout) [→ ReLU for linear_legacy]."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        mods: list[nn.Module] = [
            nn.Linear(args.input_size, args.output_size),
            nn.LayerNorm(args.output_size, eps=1e-5),
            nn.Identity(),  # dropout slot, keeps the official indices
        ]
        if args.input_layer == "linear_legacy":
            mods.append(nn.ReLU())
        self.out = nn.Sequential(*mods)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(x)


class _FeedForward(nn.Module):
    def __init__(self, d: int, units: int, activation: str) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d, units)
        self.w_2 = nn.Linear(units, d)
        self.act = F.relu if activation == "relu" else F.silu

    def forward(self, x: Tensor) -> Tensor:
        # An int8 w_1 applies the ReLU in its kernel's epilogue: one op less per call, same values.
        fused = getattr(self.w_1, "forward_relu", None) if self.act is F.relu else None
        return self.w_2(fused(x) if fused is not None else self.act(self.w_1(x)))


class RelPosAttention(nn.Module):
    """ESPnet relative-position multi-head self-attention (``self_attn``)."""

    # The positional rows this layer holds (a prepared file's: store_position_rows), or None:
    # (blocks, h, ROW_BLOCK, d_k), block j those of relative positions (j+1)·B-1 … j·B. A buffer:
    # saved and loaded with the linear_pos weight it comes from.
    pos_rows: Tensor | None

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h, self.d_k = heads, d // heads
        self.linear_q = nn.Linear(d, d)
        self.linear_k = nn.Linear(d, d)
        self.linear_v = nn.Linear(d, d)
        self.linear_out = nn.Linear(d, d)
        self.linear_pos = nn.Linear(d, d, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(heads, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.empty(heads, self.d_k))
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)
        # The int8 LM puts q, k and v in one layer here (engine.core.quantize) and drops the three.
        self.linear_qkv: nn.Module | None = None
        self.register_buffer("pos_rows", None)
        # (weight keys, blocks of rows in position order, each (h, B, d_k)): see _row_blocks
        self._pos_cache: tuple[tuple, list[Tensor]] | None = None
        # (weight keys, (2, h, d_k) stack of pos_bias_u and pos_bias_v): see _uv_biases
        self._uv_cache: tuple[tuple, Tensor] | None = None

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.h, self.d_k).transpose(1, 2)  # (B, h, T, d_k)

    def _project_qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v (B, h, T, d_k) from the three projections or the fused int8 one."""
        if self.linear_qkv is not None:
            q, k, v = self.linear_qkv(x).chunk(3, dim=-1)
            return self._heads(q), self._heads(k), self._heads(v)
        return (
            self._heads(self.linear_q(x)),
            self._heads(self.linear_k(x)),
            self._heads(self.linear_v(x)),
        )

    def forward(self, x: Tensor, mask: Tensor | None, *, causal: bool = False) -> Tensor:
        """Full pass. x (B, T, d); mask bool broadcastable to (B, 1, T, T), True = attend.

        ``causal``: every query sees earlier keys only (whatever ``mask`` says), so only
        relative positions >= 0 count and the cached rows serve (``linear_pos`` is then read
        only when the rows grow).
        """
        t = x.shape[1]
        q, k, v = self._project_qkv(x)
        qv = q + self.pos_bias_v.unsqueeze(1)
        if causal:
            bias = self._causal_pos_bias(qv, t, t)
        else:
            pe = rel_pos_table(x.shape[-1], t).to(dtype=x.dtype, device=x.device)
            p = self.linear_pos(pe).view(2 * t - 1, self.h, self.d_k).permute(1, 2, 0)
            bias = skew(torch.matmul(qv, p), t, t) * (1.0 / math.sqrt(self.d_k))
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(q + self.pos_bias_u.unsqueeze(1), k, v, attn_mask=bias)
        return self.linear_out(out.transpose(1, 2).flatten(2))

    def _row_blocks(self, count: int) -> list[Tensor]:
        """At least ``count`` blocks of positional rows, in position order; shared by all
        requests.

        The held rows (``pos_rows``) serve as they are; blocks past them are computed from
        ``linear_pos`` and cached. Rebuilt when the weight or the held rows change
        (load_state_dict copies in place and bumps the version counter; assign=True swaps the
        storage).
        """
        w, held = self.linear_pos.weight, self.pos_rows
        key = (weight_key(w), None if held is None else weight_key(held))
        cached = self._pos_cache
        if cached is None or cached[0] != key:
            cached = (key, [] if held is None else list(held.unbind(0)))
        have = len(cached[1])
        if have < count:
            pos, _ = rel_pos_tables(w.shape[1], count * ROW_BLOCK)
            new = [_row_block(w, self.h, block, pos) for block in range(have, count)]
            cached = (key, cached[1] + new)
        if cached is not self._pos_cache:
            self._pos_cache = cached  # one assignment: concurrent readers see old or new
        return cached[1]

    def _pos_rows(self, length: int) -> list[Tensor]:
        """The rows of relative positions L-1 … 0 in consecutive pieces, highest first: the
        blocks they fall in, the first cut to the positions used; each (h, n, d_k)."""
        count = -(-length // ROW_BLOCK)
        pieces = self._row_blocks(count)[:count][::-1]
        pieces[0] = pieces[0][:, count * ROW_BLOCK - length :]
        return pieces

    def forward_cached(
        self, x: Tensor, cache: KVCache, layer: int, start: int, mask: Tensor | None
    ) -> Tensor:
        """x (B, T, d) at positions start…start+T-1; appends its K/V to the cache."""
        t = x.shape[1]
        length = start + t
        q, k, v = self._project_qkv(x)
        kc, vc = cache.kv[layer, 0], cache.kv[layer, 1]  # (B, h, max_len, d_k)
        kc[:, :, start:length] = k
        vc[:, :, start:length] = v
        qv = q + self.pos_bias_v.unsqueeze(1)
        if t == 1:  # batched decode: (h, L, d_k) @ (h, d_k, B) streams the rows contiguously
            b = x.shape[0]
            queries = qv.view(b, self.h, self.d_k).permute(1, 2, 0)  # (h, d_k, B)
            raw = _joined([torch.bmm(rows, queries) for rows in self._pos_rows(length)], 1)
            raw = raw.permute(2, 0, 1).unsqueeze(2)  # (h, L, B) -> (B, h, 1, L)
            bias = skew(raw, t, length)  # already scaled by 1/sqrt(d_k) through the rows
        else:
            bias = self._causal_pos_bias(qv, t, length)
        if mask is not None:
            bias = bias.masked_fill(~mask, float("-inf"))
        out = F.scaled_dot_product_attention(
            q + self.pos_bias_u.unsqueeze(1), kc[:, :, :length], vc[:, :, :length], attn_mask=bias
        )
        return self.linear_out(out.transpose(1, 2).flatten(2))

    def _causal_pos_bias(self, qv: Tensor, t: int, length: int) -> Tensor:
        """(B, h, T, L) scaled position scores of T queries at L-T … L-1 under a causal mask."""
        # (B, h, T, L): columns for relative positions L-1 … 0
        raw = _joined(
            [torch.matmul(qv, rows.transpose(1, 2)) for rows in self._pos_rows(length)], -1
        )
        # Negative relative positions (later keys) get -inf columns: causal even without a mask,
        # and they keep the skew in range.
        raw = F.pad(raw, (0, t - 1), value=float("-inf"))
        return skew(raw, t, length)  # already scaled by 1/sqrt(d_k) through the rows

    def _uv_biases(self) -> Tensor:
        """(2, h, d_k): pos_bias_u and pos_bias_v stacked, rebuilt when either changes."""
        u, v = self.pos_bias_u, self.pos_bias_v
        key = (weight_key(u), weight_key(v))
        cached = self._uv_cache
        if cached is None or cached[0] != key:
            with torch.no_grad():
                cached = (key, torch.stack([u, v]).detach())
            self._uv_cache = cached
        return cached[1]

    def decode_position(
        self, x: Tensor, new_kv: Tensor, keys: Tensor, values: Tensor, length: int
    ) -> Tensor:
        """Attention of one new position of one sequence (no mask), in as few ops as possible.

        x (1, 1, d) at position ``length - 1``; its K and V are written to ``new_kv`` (2, h,
        d_k), the cache's slot for that position; ``keys`` and ``values`` (h, L, d_k) are the
        cache up to and including it. Same maths as the SDPA path: softmax((q+u)·K / sqrt(d_k)
        + (q+v)·P) · V; for a single query the fused SDPA kernel costs more in set-up than it
        computes, and every op saved here is saved 14 times a token.
        """
        h, d_k = self.h, self.d_k
        if self.linear_qkv is not None:
            qkv = self.linear_qkv(x).view(3, h, d_k)
            new_kv.copy_(qkv[1:])
            q = qkv[0]
        else:
            q = self.linear_q(x).view(h, d_k)
            new_kv[0].copy_(self.linear_k(x).view(h, d_k))
            new_kv[1].copy_(self.linear_v(x).view(h, d_k))
        qu, qv = (q + self._uv_biases()).view(2, h, 1, d_k).unbind(0)  # (h, 1, d_k) each
        # The positional rows are pre-scaled by 1/sqrt(d_k).
        rows = self._pos_rows(length)
        out = attend_one(qu, keys, values, 1.0 / math.sqrt(d_k), qv, rows)  # (h, 1, d_k)
        return self.linear_out(out.view(1, 1, h * d_k))


class EncoderLayer(nn.Module):
    """Pre-LN block: x + MHA(LN_a(x)), then x + FFN(LN_b(x)); LayerNorm eps 1e-12."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        d = args.output_size
        self.self_attn = RelPosAttention(d, args.attention_heads)
        self.feed_forward = _FeedForward(d, args.linear_units, args.activation)
        ln_a, ln_b = nn.LayerNorm(d, eps=1e-12), nn.LayerNorm(d, eps=1e-12)
        if args.conformer:
            self.norm_mha, self.norm_ff = ln_a, ln_b
        else:
            self.norm1, self.norm2 = ln_a, ln_b
        self._norms = (ln_a, ln_b)  # plain tuple: not registered twice
        self.causal = args.causal

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        ln_a, ln_b = self._norms
        x = x + self.self_attn(ln_a(x), mask, causal=self.causal)
        return x + self.feed_forward(ln_b(x))

    def forward_cached(
        self, x: Tensor, cache: KVCache, layer: int, start: int, mask: Tensor | None
    ) -> Tensor:
        ln_a, ln_b = self._norms
        x = x + self.self_attn.forward_cached(ln_a(x), cache, layer, start, mask)
        return x + self.feed_forward(ln_b(x))

    def decode_position(
        self, x: Tensor, new_kv: Tensor, keys: Tensor, values: Tensor, length: int
    ) -> Tensor:
        """One new position of one sequence: see RelPosAttention.decode_position."""
        ln_a, ln_b = self._norms
        x = x + self.self_attn.decode_position(ln_a(x), new_kv, keys, values, length)
        return x + self.feed_forward(ln_b(x))


class RelPosEncoder(nn.Module):
    """Official ConformerEncoder (no conv/macaron) / TransformerEncoder with rel-pos attention."""

    def __init__(self, args: EncoderArgs) -> None:
        super().__init__()
        self.args = args
        self.embed = InputLayer(args)
        self.encoders = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_blocks))
        self.after_norm = nn.LayerNorm(args.output_size, eps=1e-5)
        self.xscale = math.sqrt(args.output_size)
        # The decode step in one native call (engine.core.decode_step), built from the layers
        # at each prefill: (the layers it was built from, the step or None where it cannot run).
        self._native_step: tuple[tuple[nn.Module, ...], Any] | None = None

    def _layers(self) -> Iterable[EncoderLayer]:
        """The layers of ``encoders``, typed (a ModuleList yields plain modules)."""
        return cast(Iterable[EncoderLayer], self.encoders)

    def _input(self, x: Tensor) -> Tensor:
        """The input layer, scaled by sqrt(d) as upstream."""
        return self.embed(x) * self.xscale

    def _mask(self, b: int, t: int, lengths: Tensor | None, device: torch.device) -> Tensor | None:
        """(B|1, 1, T, T) bool, True = attend: causal AND key-not-padding."""
        mask = None
        if self.args.causal:
            mask = torch.ones(t, t, dtype=torch.bool, device=device).tril().view(1, 1, t, t)
        if lengths is not None:
            keys = torch.arange(t, device=device).unsqueeze(0) < lengths.to(device).unsqueeze(1)
            keys = keys.view(b, 1, 1, t)
            mask = keys if mask is None else mask & keys
        return mask

    def forward(self, x: Tensor, lengths: Tensor | None = None) -> Tensor:
        """x (B, T, input_size) → (B, T, output_size). Rows past ``lengths`` are don't-care."""
        b, t, _ = x.shape
        mask = self._mask(b, t, lengths, x.device)
        x = self._input(x)
        for layer in self.encoders:
            x = layer(x, mask)
        return self.after_norm(x)

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> KVCache:
        """An empty KV cache with room for ``max_len`` positions.

        Left uninitialised: only positions already written are ever read. A request reserves
        room for its longest possible reply (20 speech tokens per text token, ~70-100 MB for a
        sentence) and most replies use a fraction of it; zero-filling would make every page
        resident and cost 15-30 ms before the first token.
        """
        w = self.after_norm.weight  # a LayerNorm: stays float even when Linears are int8
        a = self.args
        kv = torch.empty(
            a.num_blocks,
            2,
            batch,
            a.attention_heads,
            max_len,
            a.output_size // a.attention_heads,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )
        return KVCache(kv=kv)

    def forward_cached(self, x: Tensor, cache: KVCache, lengths: Tensor | None = None) -> Tensor:
        """Append T positions (prefill T > 1 with a causal mask, decode T = 1); (B, T, out).

        ``lengths`` (prefill only): true lengths of left-padded rows; the padded keys are masked
        for the rest of the sequence (relative distances between real tokens are unchanged).
        """
        b, t, _ = x.shape
        if t == 1 and b == 1 and cache.key_mask is None and lengths is None:
            return self.decode_input_row(self.input_row(x), cache)  # checks the room itself
        start = cache.length
        length = start + t
        if length > cache.max_len:
            raise ValueError(f"KV cache full: {length} > {cache.max_len} positions")
        self._native_step = None  # a prefill starts each answer: the step is built anew
        if lengths is not None:
            if start != 0:
                raise ValueError("lengths is only accepted by the first prefill")
            pad = t - lengths.to(device=x.device).view(b, 1)
            cache.key_mask = torch.arange(cache.max_len, device=x.device).view(1, -1) >= pad
        mask = None
        if t > 1:  # causal over the new chunk; every cached key is visible
            mask = torch.ones(t, length, dtype=torch.bool, device=x.device).tril(start)
            mask = mask.view(1, 1, t, length)
        if cache.key_mask is not None:
            keys = cache.key_mask[:, :length].view(b, 1, 1, length)
            if t > 1:  # padded queries see themselves, so no row is empty (SDPA would give NaN)
                pos = torch.arange(length, device=x.device)
                keys = keys | (pos.view(1, -1) == (pos[start:].view(-1, 1)))
            mask = keys if mask is None else mask & keys
        x = self._input(x)
        for i, layer in enumerate(self._layers()):
            x = layer.forward_cached(x, cache, i, start, mask)
        cache.length = length
        return self.after_norm(x)

    def input_row(self, x: Tensor) -> Tensor:
        """The input layer's output for one position, x (1, 1, input_size) → (1, 1, d): a
        decode step's first operation, for callers that keep it per input (it depends on
        nothing else)."""
        return self._input(x)

    def decode_input_row(self, x: Tensor, cache: KVCache) -> Tensor:
        """The decode step of one sequence from its input row (1, 1, d) as :meth:`input_row`
        gives it, without a key mask → (1, 1, output_size)."""
        start = cache.length
        length = start + 1
        if length > cache.max_len:
            raise ValueError(f"KV cache full: {length} > {cache.max_len} positions")
        if cache.key_mask is not None or x.shape[:2] != (1, 1):
            raise ValueError("a decode step from an input row is one position of one sequence")
        step = self._native_layers(x, cache, length)
        if step is not None:
            x = step.step(x, cache.kv, start)
        else:
            kv = cache.kv[:, :, 0]  # (layers, 2, h, max_len, d_k)
            slots = kv[:, :, :, start].unbind(0)  # per layer (2, h, d_k): this position's K/V
            keys = kv[:, 0, :, :length].unbind(0)  # per layer (h, L, d_k)
            values = kv[:, 1, :, :length].unbind(0)
            for layer, slot, k, v in zip(self._layers(), slots, keys, values, strict=True):
                x = layer.decode_position(x, slot, k, v, length)
        cache.length = length
        return self.after_norm(x)

    def _native_layers(self, x: Tensor, cache: KVCache, length: int) -> Any | None:
        """The native decode step over these layers, holding the positional rows of ``length``
        positions, where every layer runs natively."""
        if not decode_step.runs(x, cache.kv, self.args.output_size // self.args.attention_heads):
            return None
        layers = tuple(self._layers())
        built = self._native_step
        if built is None or built[0] != layers:
            built = self._native_step = (layers, _native_rel_pos_layers(layers))
        step = built[1]
        if step is not None and step.positions_held() < length:
            blocks = -(-length // ROW_BLOCK)
            rows = [layer.self_attn._row_blocks(blocks) for layer in layers]  # noqa: SLF001
            step.hold_position_blocks(rows, ROW_BLOCK)
        return step


def _native_rel_pos_layers(layers: tuple[EncoderLayer, ...]) -> Any | None:
    """The native step's copy of ``layers`` (the same tensors), or None unless each layer's
    q/k/v (fused), output and feed-forward products are the engine's kernels, its activation
    ReLU and its norms float32."""
    step = decode_step.kernel()
    assert step is not None
    native_layers = []
    eps = layers[0]._norms[0].eps  # noqa: SLF001
    for layer in layers:
        attn, ff = layer.self_attn, layer.feed_forward
        ln_a, ln_b = layer._norms  # noqa: SLF001
        norms = (ln_a.weight, ln_a.bias, ln_b.weight, ln_b.bias)
        if attn.linear_qkv is None or ff.act is not F.relu or not ln_a.eps == ln_b.eps == eps:
            return None
        if any(w is None or w.dtype != torch.float32 for w in norms):
            return None
        relu = decode_step.native_linear(ff.w_1, relu=True)
        w_1 = relu if relu is not None else decode_step.native_linear(ff.w_1)
        linears = [decode_step.native_linear(m) for m in (attn.linear_qkv, attn.linear_out, ff.w_2)]
        if w_1 is None or any(linear is None for linear in linears):
            return None
        qkv, out, w_2 = linears
        native_layers.append(
            step.RelPosLayer(
                *(w.detach() for w in norms),
                attn._uv_biases(),  # noqa: SLF001
                qkv,
                out,
                w_1,
                w_2,
                relu is not None,
            )
        )
    first = layers[0].self_attn
    return step.RelPosLayers(native_layers, first.h, first.d_k, eps)


def store_position_rows(module: nn.Module, positions: int = STORED_POSITIONS) -> None:
    """Give each causal layer under ``module`` the positional rows of its first ``positions``
    relative positions (a multiple of ``ROW_BLOCK``) as its ``pos_rows`` buffer, computed as at
    run time: from then on they are part of its state dict (on the meta device, their shapes)."""
    blocks = positions // ROW_BLOCK
    tables: dict[int, Tensor] = {}  # not the shared tables: run time needs far fewer positions
    for encoder in module.modules():
        if not isinstance(encoder, RelPosEncoder) or not encoder.args.causal:
            continue
        for layer in encoder._layers():
            attention = layer.self_attn
            weight = attention.linear_pos.weight
            if weight.is_meta:
                shape = (blocks, attention.h, ROW_BLOCK, attention.d_k)
                attention.pos_rows = torch.empty(shape, dtype=weight.dtype, device="meta")
                continue
            d = weight.shape[1]
            if d not in tables:
                tables[d] = _encodings(d, positions)[0]
            rows = [_row_block(weight, attention.h, block, tables[d]) for block in range(blocks)]
            attention.pos_rows = torch.stack(rows)
