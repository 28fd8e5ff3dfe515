"""The chunk-causal vector-field estimator of the CosyVoice2 flow (``decoder.estimator``).

v1's U-Net (:mod:`engine.cosyvoice1.flow_estimator`) at a single resolution, made causal: every
convolution pads on the left only, the ResNet blocks normalise each frame over its channels
(LayerNorm) instead of over time (GroupNorm), and in streaming mode each attention query sees
every frame up to the end of its own chunk (``static_chunk_size`` frames). Layout for channel
width c:

* time embedding: sinusoid → ``time_mlp`` (v1's), one bias per ResNet block;
* ``down_blocks.0``: causal ResNet (in → c), ``n_blocks`` transformer blocks, causal conv k3;
* ``mid_blocks.*``: causal ResNet (c → c), transformer blocks;
* ``up_blocks.0``: causal ResNet (2c → c, the skip joined), transformer blocks, causal conv k3;
* ``final_block`` (causal) and the 1×1 ``final_proj``.

Nothing reaches right of a frame's chunk, so :class:`EstimatorState` (each convolution's last
two inputs, each attention layer's keys and values) carries a stream from chunk to chunk; one
state serves one ODE step. The transformer blocks are v1's modules (same keys, same maths).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.estimator_blocks import TimestepMLP, TransformerBlock, masked, sinusoidal_embedding
from engine.cosyvoice2.flow_args import CausalEstimatorArgs
from engine.cosyvoice2.flow_cache import ConvTail, KVBuffer, chunk_visible, visibility_bias


class CausalBlock1D(nn.Module):
    """Mish(LayerNorm_channels(causal conv k3 (x))); keys ``block.0`` (conv), ``block.2`` (norm).

    Indices 1 and 3 are the official transposes around the norm (no parameters).
    """

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [nn.Conv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out), nn.Identity()]
        )

    def forward(self, x: Tensor, tail: ConvTail, mask: Tensor | None = None) -> Tensor:
        conv, norm = cast(nn.Conv1d, self.block[0]), cast(nn.LayerNorm, self.block[2])
        h = tail.conv(conv, masked(x, mask)).transpose(1, 2)  # (B, T, C)
        h = F.layer_norm(h, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        return masked(F.mish(h).transpose(1, 2), mask)


class CausalResnetBlock1D(nn.Module):
    """Two causal blocks with an additive time bias between them, plus a 1×1 residual."""

    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        # Index 0 of the official Sequential is the (parameter-free) Mish; keep the key ``mlp.1``.
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = CausalBlock1D(dim, dim_out)
        self.block2 = CausalBlock1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def time_bias(self, temb_mish: Tensor) -> Tensor:
        """Mish(temb) (N, time_dim) → the bias added after block1, (N, C_out)."""
        return cast(Tensor, self.mlp[1](temb_mish))

    def forward(
        self, x: Tensor, time_bias: Tensor, tails: Iterator[ConvTail], mask: Tensor | None
    ) -> Tensor:
        h = self.block1(x, next(tails), mask) + time_bias.unsqueeze(-1)
        # The residual branch is not re-masked (as upstream).
        return self.block2(h, next(tails), mask) + self.res_conv(masked(x, mask))


def _attend(block: TransformerBlock, x: Tensor, kv: KVBuffer, bias: Tensor | None) -> Tensor:
    """v1's transformer block on t new frames (B, t, C), attending to every frame so far."""
    attn = block.attn1
    b, t, _ = x.shape

    def heads(y: Tensor) -> Tensor:
        return y.view(b, t, attn.heads, attn.head_dim).transpose(1, 2)  # (B, H, t, D)

    h = block.norm1(x)
    q, k, v = heads(attn.to_q(h)), heads(attn.to_k(h)), heads(attn.to_v(h))
    out = kv.attend(q, k, v, bias)
    x = x + attn.to_out[0](out.transpose(1, 2).reshape(b, t, attn.heads * attn.head_dim))
    return x + block.ff(block.norm3(x))


def _run_transformers(
    blocks: nn.ModuleList, x: Tensor, kv: Iterator[KVBuffer], bias: Tensor | None
) -> Tensor:
    """The blocks on x (B, C, t) in (B, t, C) layout; returns (B, C, t)."""
    h = x.transpose(1, 2)
    for block in cast(Iterable[TransformerBlock], blocks):
        h = _attend(block, h, next(kv), bias)
    return h.transpose(1, 2)


@dataclass
class EstimatorState:
    """One ODE step's memory of the frames before the next chunk."""

    tails: list[ConvTail]
    kv: list[KVBuffer]
    frames: int = 0  # frames seen so far
    computed: list[int] = field(default_factory=list)  # frames computed by each call

    @property
    def kv_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.kv)

    def copy(self) -> EstimatorState:
        """A state that goes on from here on its own (what it holds so far is shared)."""
        return EstimatorState(
            [tail.copy() for tail in self.tails],
            [buffer.copy() for buffer in self.kv],
            self.frames,
            list(self.computed),
        )


# The entries of the decoder's ModuleLists (ModuleList itself is untyped).
_Level = tuple[CausalResnetBlock1D, nn.ModuleList, nn.Conv1d]
_MidLevel = tuple[CausalResnetBlock1D, nn.ModuleList]


def _only_level(levels: nn.ModuleList) -> _Level:
    return cast(_Level, tuple(cast(nn.ModuleList, levels[0])))


class CausalConditionalDecoder(nn.Module):
    """The v2 estimator with the official ``flow.pt`` key names."""

    def __init__(self, args: CausalEstimatorArgs) -> None:
        super().__init__()
        if len(args.channels) != 1:
            raise ValueError("the causal estimator has exactly one resolution level")
        self.args = args
        c = args.channels[0]
        time_dim = 4 * c
        self.time_mlp = TimestepMLP(args.in_channels, time_dim)

        def transformers() -> nn.ModuleList:
            return nn.ModuleList(
                TransformerBlock(c, args.num_heads, args.attention_head_dim)
                for _ in range(args.n_blocks)
            )

        def causal_conv() -> nn.Conv1d:
            return nn.Conv1d(c, c, 3)  # left-padded by its ConvTail

        self.down_blocks = nn.ModuleList(
            [
                nn.ModuleList(
                    [
                        CausalResnetBlock1D(args.in_channels, c, time_dim),
                        transformers(),
                        causal_conv(),
                    ]
                )
            ]
        )
        self.mid_blocks = nn.ModuleList(
            nn.ModuleList([CausalResnetBlock1D(c, c, time_dim), transformers()])
            for _ in range(args.num_mid_blocks)
        )
        self.up_blocks = nn.ModuleList(
            [
                nn.ModuleList(
                    [CausalResnetBlock1D(2 * c, c, time_dim), transformers(), causal_conv()]
                )
            ]
        )
        self.final_block = CausalBlock1D(c, c)
        self.final_proj = nn.Conv1d(c, args.out_channels, 1)

    def _resnets(self) -> list[CausalResnetBlock1D]:
        """The ResNet blocks in the order :meth:`forward` runs them."""
        return [level[0] for level in (*self.down_blocks, *self.mid_blocks, *self.up_blocks)]

    def new_state(self, cache_dtype: torch.dtype | None = None) -> EstimatorState:
        """An empty state: 2 convolutions per ResNet, the down/up convs and the final block;
        one key/value buffer per transformer block, kept in ``cache_dtype`` (None: as
        computed)."""
        n_tails = 2 * len(self._resnets()) + 3
        n_attention = self.args.n_blocks * (2 + self.args.num_mid_blocks)
        return EstimatorState(
            [ConvTail() for _ in range(n_tails)],
            [KVBuffer(cache_dtype) for _ in range(n_attention)],
        )

    def time_biases(self, t: Tensor) -> list[Tensor]:
        """Each ResNet block's time bias (N, C) for flow times t (N,), in forward order."""
        temb = self.time_mlp(sinusoidal_embedding(t, self.args.in_channels))
        temb_mish = F.mish(temb)
        return [resnet.time_bias(temb_mish) for resnet in self._resnets()]

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
        mask: Tensor | None = None,
    ) -> Tensor:
        """Vector field (B, 80, t) for the t frames after those ``state`` has seen.

        x, mu, cond (B, 80, t); t (B,) flow times; spks (B, 80). ``streaming``: chunk attention
        (needed to carry a state); else every frame sees every other. ``time_biases``:
        :meth:`time_biases` of t computed ahead (t is then not read). ``mask`` (B, 1, t), 0 at
        padded frames of a batch (a one-shot call only): their output is 0 and no frame
        attends to them.
        """
        if state is None:
            state = self.new_state()
        elif state.frames and not streaming:
            raise ValueError("a carried estimator state needs streaming (chunk) attention")
        if mask is not None and state.frames:
            raise ValueError("a padding mask is for one-shot calls, not a carried state")
        if mask is not None and bool(mask.min() >= 1.0):
            mask = None  # nothing padded: every multiplication by the mask is a no-op
        if time_biases is None:
            time_biases = self.time_biases(t)
        rows, frames = x.shape[0], x.shape[-1]
        biases = iter([b.expand(rows, -1) if b.shape[0] == 1 else b for b in time_biases])
        tails, kv = iter(state.tails), iter(state.kv)
        chunk = self.args.static_chunk_size if streaming else None
        visible = chunk_visible(state.frames, frames, chunk, x.device)
        if mask is not None:  # (B, 1, 1, t) padded keys hidden from every query
            keys = (mask > 0).unsqueeze(1)
            visible = keys if visible is None else keys & visible
        bias = visibility_bias(visible, x.dtype)

        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, frames), cond], dim=1)
        resnet, blocks, conv = _only_level(self.down_blocks)
        h = _run_transformers(blocks, resnet(h, next(biases), tails, mask), kv, bias)
        skip = h
        h = next(tails).conv(conv, masked(h, mask))
        for resnet, blocks in cast(Iterable[_MidLevel], self.mid_blocks):
            h = _run_transformers(blocks, resnet(h, next(biases), tails, mask), kv, bias)
        resnet, blocks, conv = _only_level(self.up_blocks)
        h = torch.cat([h, skip], dim=1)
        h = _run_transformers(blocks, resnet(h, next(biases), tails, mask), kv, bias)
        h = next(tails).conv(conv, masked(h, mask))
        h = self.final_block(h, next(tails), mask)
        out = masked(self.final_proj(masked(h, mask)), mask)
        state.frames += frames
        state.computed.append(frames)
        return out
