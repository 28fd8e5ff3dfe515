"""The CosyVoice2 flow encoder: 25 Hz speech-token embeddings → 50 Hz frames, chunk by chunk.

``UpsampleConformerEncoder`` in the official ``flow.pt`` (keys under ``encoder.``):

* ``embed``: Linear → LayerNorm, scaled by sqrt(d);
* ``pre_lookahead_layer``: a residual pair of convolutions; ``conv1`` (kernel L+1) reads each
  token and the L tokens after it (the look-ahead, zeros past the end), ``conv2`` (kernel 3)
  the two before it — a token's output waits for L more tokens, and no longer;
* ``encoders``: rel-pos Conformer layers (v1's blocks) with chunk attention in streaming mode;
* ``up_layer``: each frame repeated ``stride`` times, then a causal conv (kernel 2·stride+1);
* ``up_embed`` and ``up_encoders``: as above, at the frame rate with chunks ``stride`` times
  longer; then ``after_norm``.

Every part looks left, or ahead by the look-ahead only, or within whole chunks, so a stream is
encoded chunk by chunk with an :class:`EncoderState` holding the convolutions' last inputs and
the attention layers' keys and values; a chunk is never recomputed. One pass over a whole
utterance is the same code from an empty state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.hparams import EncoderArgs
from engine.core.transformer import (
    EncoderLayer,
    InputLayer,
    RelPosAttention,
    rel_pos_tables,
    skew,
)
from engine.cosyvoice2.flow_args import UpsampleEncoderArgs
from engine.cosyvoice2.flow_cache import ConvTail, KVBuffer, chunk_visible


class PreLookahead(nn.Module):
    """``pre_lookahead_layer``: x + conv2(pad_left(leaky_relu(conv1(x ‖ look-ahead)))).

    ``hidden``: the width between the two convolutions (CosyVoice3 widens it; v2 keeps
    ``channels``)."""

    def __init__(self, channels: int, lookahead: int, hidden: int | None = None) -> None:
        super().__init__()
        self.lookahead = lookahead
        inner = channels if hidden is None else hidden
        self.conv1 = nn.Conv1d(channels, inner, lookahead + 1)
        self.conv2 = nn.Conv1d(inner, channels, 3)

    def forward(self, x: Tensor, ahead: Tensor | None, tail: ConvTail) -> Tensor:
        """x (1, t, C) embedded tokens; ``ahead`` (1, ≤L, C) the tokens after them (None or
        short: zeros past the end of the utterance) → (1, t, C)."""
        h = x.transpose(1, 2)
        if ahead is not None and ahead.shape[1]:
            h = torch.cat([h, ahead.transpose(1, 2)], dim=2)
        h = F.pad(h, (0, x.shape[1] + self.lookahead - h.shape[2]))
        h = F.leaky_relu(self.conv1(h))
        return tail.conv(self.conv2, h).transpose(1, 2) + x


class Upsample(nn.Module):
    """``up_layer``: repeat each frame ``stride`` times, then a causal conv (kernel 2s+1)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(channels, channels, 2 * stride + 1)

    def forward(self, x: Tensor, tail: ConvTail) -> Tensor:
        """x (1, t, C) → (1, stride·t, C)."""
        repeated = x.transpose(1, 2).repeat_interleave(self.stride, dim=2)
        return tail.conv(self.conv, repeated).transpose(1, 2)


class _PositionRows:
    """One layer's ``linear_pos`` projections of relative positions, kept for a stream.

    Positions ≥ 0 (a query and the keys before it) are projected once each and kept; the few
    negative ones (keys later in the query's own chunk) are projected per call.
    """

    def __init__(self) -> None:
        self.ahead: Tensor | None = None  # (M, d): projections of positions 0 … M-1

    def copy(self) -> _PositionRows:
        twin = _PositionRows()
        twin.ahead = self.ahead  # replaced, never written, when it grows
        return twin

    def rows(self, linear_pos: nn.Linear, length: int, queries: int) -> Tensor:
        """(length + queries − 1, d): positions length−1 … −(queries−1), in that order."""
        w = linear_pos.weight
        d = w.shape[1]
        pos, neg = rel_pos_tables(d, max(length, queries))
        have = 0 if self.ahead is None else self.ahead.shape[0]
        if have < length:
            new = F.linear(pos[have:length].to(w), w)
            self.ahead = new if self.ahead is None else torch.cat([self.ahead, new])
        assert self.ahead is not None
        behind = F.linear(neg[1:queries].to(w), w)  # positions −1 … −(queries−1)
        return torch.cat([self.ahead[:length].flip(0), behind])


def _attend(
    attn: RelPosAttention,
    x: Tensor,
    kv: KVBuffer,
    positions: _PositionRows,
    start: int,
    visible: Tensor | None,
) -> Tensor:
    """Rel-pos self-attention of t new positions start … start+t−1 over every key so far."""
    b, t, _ = x.shape
    h, d_k = attn.h, attn.d_k

    def heads(y: Tensor) -> Tensor:
        return y.view(b, t, h, d_k).transpose(1, 2)  # (B, h, t, d_k)

    q, k, v = heads(attn.linear_q(x)), heads(attn.linear_k(x)), heads(attn.linear_v(x))
    length = start + t
    rows = positions.rows(attn.linear_pos, length, t)  # (length + t − 1, d)
    rows = rows.view(-1, h, d_k).permute(1, 2, 0)  # (h, d_k, W)
    raw = torch.matmul(q + attn.pos_bias_v.unsqueeze(1), rows)  # (B, h, t, W)
    bias = skew(raw, t, length) * (1.0 / math.sqrt(d_k))
    if visible is not None:
        bias = bias.masked_fill(~visible, float("-inf"))
    out = kv.attend(q + attn.pos_bias_u.unsqueeze(1), k, v, bias)
    return attn.linear_out(out.transpose(1, 2).flatten(2))


@dataclass
class _Stack:
    """The stream state of one stack of Conformer layers."""

    kv: list[KVBuffer]
    positions: list[_PositionRows]
    length: int = 0  # positions encoded so far

    @classmethod
    def empty(cls, layers: int) -> _Stack:
        return cls([KVBuffer() for _ in range(layers)], [_PositionRows() for _ in range(layers)])

    def copy(self) -> _Stack:
        return _Stack(
            [kv.copy() for kv in self.kv], [p.copy() for p in self.positions], self.length
        )


@dataclass
class EncoderState:
    """What the encoder keeps between the chunks of one utterance."""

    tokens: _Stack
    frames: _Stack
    lookahead_tail: ConvTail = field(default_factory=ConvTail)
    upsample_tail: ConvTail = field(default_factory=ConvTail)

    @property
    def kv_bytes(self) -> int:
        return sum(kv.nbytes for stack in (self.tokens, self.frames) for kv in stack.kv)

    def copy(self) -> EncoderState:
        """A state that goes on from here on its own (what it holds so far is shared)."""
        return EncoderState(
            self.tokens.copy(),
            self.frames.copy(),
            self.lookahead_tail.copy(),
            self.upsample_tail.copy(),
        )


class UpsampleConformerEncoder(nn.Module):
    """The v2 flow encoder (``encoder.*`` keys of ``flow.pt``)."""

    def __init__(self, args: UpsampleEncoderArgs) -> None:
        super().__init__()
        self.args = args
        layer_args = EncoderArgs(
            input_size=args.input_size,
            output_size=args.output_size,
            attention_heads=args.attention_heads,
            linear_units=args.linear_units,
            num_blocks=args.num_blocks,
            input_layer="linear",
            activation="silu",
            conformer=True,
            causal=False,
        )
        d = args.output_size
        self.embed = InputLayer(layer_args)
        self.pre_lookahead_layer = PreLookahead(d, args.pre_lookahead_len)
        self.encoders = nn.ModuleList(EncoderLayer(layer_args) for _ in range(args.num_blocks))
        self.up_layer = Upsample(d, args.upsample_stride)
        self.up_embed = InputLayer(layer_args)
        self.up_encoders = nn.ModuleList(
            EncoderLayer(layer_args) for _ in range(args.num_up_blocks)
        )
        self.after_norm = nn.LayerNorm(d, eps=1e-5)
        self.xscale = math.sqrt(d)

    def new_state(self) -> EncoderState:
        return EncoderState(
            tokens=_Stack.empty(self.args.num_blocks),
            frames=_Stack.empty(self.args.num_up_blocks),
        )

    def forward(
        self,
        x: Tensor,
        ahead: Tensor | None = None,
        *,
        streaming: bool,
        state: EncoderState | None = None,
    ) -> Tensor:
        """Token embeddings x (1, t, input_size) that follow what ``state`` has seen →
        frames (1, stride·t, output_size).

        ``ahead`` (1, ≤L, input_size): embeddings of the tokens after x, for the look-ahead;
        None at the end of the utterance (zeros). ``streaming``: chunk attention (each position
        sees everything up to the end of its own chunk) instead of full attention; a state
        carried across calls needs it, and calls that end mid-chunk are the last.
        """
        if x.dim() != 3 or x.shape[0] != 1 or x.shape[1] == 0:
            raise ValueError(f"encoder input must be (1, t>0, C), got {tuple(x.shape)}")
        if state is None:
            state = self.new_state()
        elif state.tokens.length and not streaming:
            raise ValueError("a carried encoder state needs streaming (chunk) attention")
        chunk = self.args.static_chunk_size if streaming else None
        xs = self.embed(x) * self.xscale
        ahead_xs = self.embed(ahead) * self.xscale if ahead is not None else None
        xs = self.pre_lookahead_layer(xs, ahead_xs, state.lookahead_tail)
        xs = self._run(self.encoders, xs, state.tokens, chunk)
        xs = self.up_layer(xs, state.upsample_tail)
        xs = self.up_embed(xs) * self.xscale
        stride = self.args.upsample_stride
        xs = self._run(
            self.up_encoders, xs, state.frames, None if chunk is None else chunk * stride
        )
        return self.after_norm(xs)

    @staticmethod
    def _run(layers: nn.ModuleList, x: Tensor, stack: _Stack, chunk: int | None) -> Tensor:
        start, t = stack.length, x.shape[1]
        visible = chunk_visible(start, t, chunk, x.device)
        for layer, kv, positions in zip(
            cast(Iterable[EncoderLayer], layers), stack.kv, stack.positions, strict=True
        ):
            x = x + _attend(layer.self_attn, layer.norm_mha(x), kv, positions, start, visible)
            x = x + layer.feed_forward(layer.norm_ff(x))
        stack.length = start + t
        return x
