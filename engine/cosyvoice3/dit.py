"""The CosyVoice3 flow's vector-field estimator: a diffusion transformer (``decoder.estimator``).

Layout (the official ``DiT`` key names):

* ``time_embed.time_mlp``: the flow time's 256-wide sinusoid → Linear → SiLU → Linear (``dim``);
* ``input_embed``: Linear over [x ‖ cond ‖ mu ‖ spks] per frame, plus a causal convolutional
  position embedding (two grouped convolutions of kernel 31, each followed by Mish);
* ``transformer_blocks.*``: adaptive layer norm (shift, scale and gate of the attention and the
  feed-forward from SiLU(time) by one Linear), self-attention with rotary position angles and
  the chunk mask, a tanh-GELU feed-forward;
* ``norm_out`` (adaptive, scale then shift) and ``proj_out`` to the mel bins.

Two facts of the official code the maths keeps: the rotary angles are applied to the first
``dim_head`` channels of the query and key projections before they are split into heads, so
only the first head is rotated; their channel pairs are interleaved (0-1, 2-3, …).

Nothing reaches right of a frame's chunk (the convolutions look left, a query sees the keys up
to the end of its own chunk), so :class:`EstimatorState` (the convolutions' last inputs, each
block's keys and values) carries a stream from chunk to chunk; one state serves one ODE step.
Batch rows are the guidance rows of one utterance: no padding mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.estimator_blocks import sinusoidal_embedding
from engine.cosyvoice2.flow_cache import ConvTail, KVBuffer, chunk_visible, visibility_bias
from engine.cosyvoice2.flow_estimator import EstimatorState
from engine.cosyvoice3.flow_args import CONV_POS_GROUPS, CONV_POS_KERNEL, TIME_FREQ_DIM, DiTArgs

_NORM_EPS = 1e-6
# How many time grids time_biases keeps (a profile has one; a server a handful).
_KEPT_GRIDS = 16
_ROPE_BASE = 10000.0


def _norm(x: Tensor) -> Tensor:
    """LayerNorm over channels without weights (eps 1e-6)."""
    return F.layer_norm(x, x.shape[-1:], eps=_NORM_EPS)


def _modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """norm(x)·(1 + scale) + shift, with (rows, C) shift and scale for every frame (the same
    operations in place on the norm: no buffer per operation)."""
    return _norm(x).mul_(1 + scale[:, None]).add_(shift[:, None])


def _gated_residual(x: Tensor, gate: Tensor, update: Tensor) -> Tensor:
    """x + gate·update, with (rows, C) gate for every frame; written over ``update``."""
    return update.mul_(gate.unsqueeze(1)).add_(x)


class TimeEmbedding(nn.Module):
    """Flow time (N,) → (N, dim); key ``time_mlp.0`` / ``time_mlp.2``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: Tensor) -> Tensor:
        return cast(Tensor, self.time_mlp(sinusoidal_embedding(t, TIME_FREQ_DIM)))


class CausalConvPositions(nn.Module):
    """Two left-padded grouped convolutions, each followed by Mish (keys ``conv1.0``,
    ``conv2.0``)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.Sequential(
            nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), nn.Mish()
        )
        self.conv2 = nn.Sequential(
            nn.Conv1d(dim, dim, CONV_POS_KERNEL, groups=CONV_POS_GROUPS), nn.Mish()
        )

    def forward(self, x: Tensor, tails: Sequence[ConvTail]) -> Tensor:
        """x (rows, t, dim) after what the tails have seen → (rows, t, dim)."""
        h = x.transpose(1, 2)
        for conv, tail in zip((self.conv1, self.conv2), tails, strict=True):
            h = F.mish(tail.conv(cast(nn.Conv1d, conv[0]), h))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    """[x ‖ cond ‖ mu ‖ spks] → ``proj`` → + causal conv positions."""

    def __init__(self, args: DiTArgs) -> None:
        super().__init__()
        self.proj = nn.Linear(2 * args.mel_dim + args.mu_dim + args.spk_dim, args.dim)
        self.conv_pos_embed = CausalConvPositions(args.dim)

    def forward(
        self, x: Tensor, cond: Tensor, mu: Tensor, spks: Tensor, tails: Sequence[ConvTail]
    ) -> Tensor:
        """x, cond, mu (rows, t, 80); spks (rows, 80) → (rows, t, dim)."""
        frames = x.shape[1]
        h = self.proj(torch.cat([x, cond, mu, spks.unsqueeze(1).expand(-1, frames, -1)], dim=-1))
        return self.conv_pos_embed(h, tails) + h


def rotary_frequencies(dim_head: int) -> Tensor:
    """The rotary frequencies of ``dim_head`` channels: 10000^(−2i/dim_head), i < dim_head/2."""
    return 1.0 / (_ROPE_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head))


class RotaryAngles(nn.Module):
    """Rotary position angles of ``dim_head`` channels, pairs interleaved. The official
    module keeps its frequencies in ``flow.pt`` (``inv_freq``); they follow from
    ``dim_head``, so the loader checks them and this module computes them (no parameters)."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        self.dim_head = dim_head
        self._frequencies: Tensor | None = None

    def forward(self, start: int, length: int) -> tuple[Tensor, Tensor]:
        """cos and sin (length, dim_head) of positions start … start+length−1."""
        if self._frequencies is None:
            self._frequencies = rotary_frequencies(self.dim_head)
        positions = torch.arange(start, start + length, dtype=torch.float32)
        angles = positions.unsqueeze(1) * self._frequencies.unsqueeze(0)
        angles = angles.repeat_interleave(2, dim=-1)  # (f0, f0, f1, f1, …)
        return angles.cos(), angles.sin()


def rotate_first(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of x (rows, t, C) by the angles, in place
    (x is a projection's fresh output); the rest stay (the official projection is rotated
    before its heads are split). Returns x."""
    width = cos.shape[-1]
    head = x[..., :width]
    pairs = head.unflatten(-1, (-1, 2))
    turned = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    head.copy_(head * cos + turned * sin)
    return x


class DiTAttention(nn.Module):
    """Keys ``to_q``, ``to_k``, ``to_v``, ``to_out.0`` (all with bias)."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        self.heads, self.dim_head = heads, dim_head
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])  # to_out.1 is dropout upstream

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], kv: KVBuffer, bias: Tensor | None
    ) -> Tensor:
        """x (rows, t, dim) → (rows, t, dim), attending to every key ``kv`` holds and these."""
        rows, t, _ = x.shape
        cos, sin = rope

        def heads(y: Tensor) -> Tensor:
            return y.view(rows, t, self.heads, self.dim_head).transpose(1, 2)

        q = heads(rotate_first(self.to_q(x), cos, sin))
        k = heads(rotate_first(self.to_k(x), cos, sin))
        out = kv.attend(q, k, heads(self.to_v(x)), bias)
        return cast(Tensor, self.to_out[0](out.transpose(1, 2).reshape(rows, t, -1)))


class AdaptiveNorm(nn.Module):
    """``attn_norm``: one Linear from SiLU(time) to a block's six modulations."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 6 * dim)


class DiTFeedForward(nn.Module):
    """Linear → tanh-GELU → Linear; keys ``ff.0.0`` and ``ff.2`` (``ff.1`` is dropout
    upstream)."""

    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        self.ff = nn.Sequential(
            nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
            nn.Identity(),
            nn.Linear(inner, dim),
        )

    def forward(self, x: Tensor) -> Tensor:
        return cast(Tensor, self.ff(x))


class DiTBlock(nn.Module):
    """x += gate·Attn(modulated norm(x)); x += gate·FF(modulated norm(x))."""

    def __init__(self, args: DiTArgs) -> None:
        super().__init__()
        self.attn_norm = AdaptiveNorm(args.dim)
        self.attn = DiTAttention(args.dim, args.heads, args.dim_head)
        self.ff = DiTFeedForward(args.dim, args.ff_mult)

    def modulation(self, time_silu: Tensor) -> Tensor:
        """SiLU(time embedding) (N, dim) → this block's six modulations (N, 6·dim)."""
        return cast(Tensor, self.attn_norm.linear(time_silu))

    def forward(
        self,
        x: Tensor,
        modulation: Tensor,
        rope: tuple[Tensor, Tensor],
        kv: KVBuffer,
        bias: Tensor | None,
    ) -> Tensor:
        shift_a, scale_a, gate_a, shift_f, scale_f, gate_f = modulation.chunk(6, dim=1)
        x = _gated_residual(x, gate_a, self.attn(_modulate(x, shift_a, scale_a), rope, kv, bias))
        return _gated_residual(x, gate_f, self.ff(_modulate(x, shift_f, scale_f)))


class FinalNorm(nn.Module):
    """``norm_out``: norm(x)·(1 + scale) + shift, scale first in its Linear's output."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)

    def forward(self, x: Tensor, modulation: Tensor) -> Tensor:
        scale, shift = modulation.chunk(2, dim=1)
        return _modulate(x, shift, scale)


class DiT(nn.Module):
    """The v3 estimator with the official ``flow.pt`` key names (under ``decoder.estimator``)."""

    def __init__(self, args: DiTArgs) -> None:
        super().__init__()
        self.args = args
        self.time_embed = TimeEmbedding(args.dim)
        self.input_embed = InputEmbedding(args)
        self.rotary_embed = RotaryAngles(args.dim_head)
        self.transformer_blocks = nn.ModuleList(DiTBlock(args) for _ in range(args.depth))
        self.norm_out = FinalNorm(args.dim)
        self.proj_out = nn.Linear(args.dim, args.mel_dim)
        # time_biases' results by flow times, once keep_time_biases was called (None: none).
        self._kept_biases: dict[tuple[torch.dtype, tuple[float, ...]], list[Tensor]] | None = None
        # Lets the modulation weights' pages go once a grid is kept (keep_time_biases).
        self._release_weights: Callable[[], None] | None = None

    def _blocks(self) -> Iterable[DiTBlock]:
        return cast(Iterable[DiTBlock], self.transformer_blocks)

    def new_state(self, cache_dtype: torch.dtype | None = None) -> EstimatorState:
        """An empty state: the two position convolutions' tails, one key/value buffer per
        block kept in ``cache_dtype`` (None: as computed)."""
        return EstimatorState(
            [ConvTail(), ConvTail()], [KVBuffer(cache_dtype) for _ in range(self.args.depth)]
        )

    def time_biases(self, t: Tensor) -> list[Tensor]:
        """Every block's modulations (N, 6·dim), then the final norm's (N, 2·dim), for flow
        times t (N,); after :meth:`keep_time_biases`, the same tensors for the same times (not
        to be written)."""
        key = (t.dtype, tuple(t.tolist()))
        if self._kept_biases is not None and key in self._kept_biases:
            return self._kept_biases[key]
        time_silu = F.silu(self.time_embed(t))
        biases = [block.modulation(time_silu) for block in self._blocks()]
        biases.append(self.norm_out.linear(time_silu))
        if self._kept_biases is not None:
            if len(self._kept_biases) >= _KEPT_GRIDS:
                self._kept_biases.clear()  # a bound the profiles' few grids never reach
            self._kept_biases[key] = biases
            if self._release_weights is not None:
                self._release_weights()
        return biases

    def modulation_layers(self) -> list[str]:
        """Dotted names (from the DiT) of the Linears that make the time modulations: each
        block's adaptive norm and the final norm."""
        blocks = [f"transformer_blocks.{i}.attn_norm.linear" for i in range(self.args.depth)]
        return [*blocks, "norm_out.linear"]

    def keep_time_biases(self, release_weights: Callable[[], None] | None = None) -> None:
        """From now on keep :meth:`time_biases`' result for each time grid (call it once the
        weights are final: nothing tells the kept results that a weight changed).

        A solve asks for its whole time grid once per flow call, and a profile's grid never
        changes: the modulation Linears (:meth:`modulation_layers`) hold 139 M weights (0.55 GB
        in float32) that each chunk's call would read again (≈ 2.8 GFLOP and 0.55 GB of reads
        for a full-size chunk at 10 steps), where a kept grid is 0.55 MB a time.

        ``release_weights``: called each time a grid has been computed and kept, to let the
        memory of the modulation weights go while they stay readable for a grid not seen yet
        (the engine maps them afresh from the prepared file: the same bytes, not resident
        until read again).
        """
        self._kept_biases = {}
        self._release_weights = release_weights

    def forward(
        self,
        x: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor,
        cond: Tensor,
        *,
        streaming: bool,
        state: EstimatorState | None = None,
        time_biases: Sequence[Tensor] | None = None,
    ) -> Tensor:
        """Vector field (rows, 80, t) for the t frames after those ``state`` has seen.

        x, mu, cond (rows, 80, t); t (rows,) flow times; spks (rows, 80). ``streaming``: chunk
        attention (needed to carry a state); else every frame sees every other.
        ``time_biases``: :meth:`time_biases` of t computed ahead (t is then not read).
        """
        if state is None:
            state = self.new_state()
        elif state.frames and not streaming:
            raise ValueError("a carried estimator state needs streaming (chunk) attention")
        if time_biases is None:
            time_biases = self.time_biases(t)
        rows, frames = x.shape[0], x.shape[-1]
        mods = [m.expand(rows, -1) if m.shape[0] == 1 else m for m in time_biases]
        start = state.frames
        chunk = self.args.static_chunk_size if streaming else None
        bias = visibility_bias(chunk_visible(start, frames, chunk, x.device), x.dtype)
        rope = self.rotary_embed(start, frames)

        h = self.input_embed(
            x.transpose(1, 2), cond.transpose(1, 2), mu.transpose(1, 2), spks, state.tails
        )
        for block, mod, kv in zip(self._blocks(), mods, state.kv, strict=False):
            h = block(h, mod, rope, kv, bias)
        h = self.norm_out(h, mods[-1])
        state.frames += frames
        state.computed.append(frames)
        return self.proj_out(h).transpose(1, 2)
