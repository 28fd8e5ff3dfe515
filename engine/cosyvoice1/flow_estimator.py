"""ConditionalDecoder: the 1-D U-Net estimating the flow-matching vector field.

Layout of the network for ``channels = (c0, c1, …)``:

* a sinusoidal time embedding (×1000 time scale, sin and cos halves concatenated) followed by a
  two-layer MLP (``time_mlp``) giving ``temb`` of width ``4·c0``;
* one down level per channel entry: ResnetBlock1D → ``n_blocks`` transformer blocks → either a
  stride-2 conv (all but the last level) or a plain k3 conv (last level);
* ``num_mid_blocks`` × (ResnetBlock1D → transformer blocks) at the coarsest resolution;
* mirrored up levels that concatenate the skip connection, with a k4/s2 transposed conv (all but
  the last level) or a plain k3 conv, then ``final_block`` and a 1×1 ``final_proj``.

Parameter names follow the official ``flow.pt`` (``decoder.estimator.*``) exactly. This module is
the CPU hot spot of the whole engine (≈86 MFLOP per mel frame per row), so the forward avoids
needless work: attention runs through ``F.scaled_dot_product_attention``, the time MLPs run
once per ODE solve for all its steps (:meth:`ConditionalDecoder.time_biases`), and the mask
multiplications are skipped when every frame is valid (multiplying by 1.0 is exact, so the
result is unchanged).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.estimator_blocks import TimestepMLP, TransformerBlock, masked, sinusoidal_embedding
from engine.core.hparams import EstimatorArgs

_GROUPS = 8  # GroupNorm groups in every Block1D
_MASK_BIAS = -1.0e10  # additive attention bias for padded keys (diffusers/official value)


class Block1D(nn.Module):
    """Mish(GroupNorm(Conv_k3(x·mask)))·mask; keys ``block.0`` (conv) and ``block.1`` (norm)."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.block = nn.ModuleList(
            [nn.Conv1d(dim, dim_out, 3, padding=1), nn.GroupNorm(_GROUPS, dim_out)]
        )

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        conv, norm = self.block[0], cast(nn.GroupNorm, self.block[1])
        h = conv(masked(x, mask))
        # As (B, C, T, 1): a channels-last h (a oneDNN conv's output) then meets torch's
        # channels-last GroupNorm kernel instead of being copied to (B, C, T) first.
        h = F.group_norm(h.unsqueeze(-1), norm.num_groups, norm.weight, norm.bias, norm.eps)
        return masked(F.mish(h.squeeze(-1)), mask)


class ResnetBlock1D(nn.Module):
    """Two Block1D with an additive time bias in between, plus a 1×1 residual projection."""

    def __init__(self, dim: int, dim_out: int, time_dim: int) -> None:
        super().__init__()
        # Index 0 of the official Sequential is the (parameter-free) Mish; keep the key ``mlp.1``.
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_dim, dim_out))
        self.block1 = Block1D(dim, dim_out)
        self.block2 = Block1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def time_bias(self, temb_mish: Tensor) -> Tensor:
        """Mish(temb) (N, time_dim) → the bias added after block1, (N, C_out)."""
        return self.mlp[1](temb_mish)

    def forward(self, x: Tensor, mask: Tensor | None, time_bias: Tensor) -> Tensor:
        """x (B, C_in, T); time_bias (B, C_out) from :meth:`time_bias` → (B, C_out, T)."""
        h = self.block1(x, mask)
        h = h + time_bias.unsqueeze(-1)
        h = self.block2(h, mask)
        # The residual branch is not re-masked (as upstream).
        return h + self.res_conv(masked(x, mask))


class Downsample1D(nn.Module):
    """Conv1d k3, stride 2, pad 1: T → ceil(T/2); key ``conv``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, 3, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


class Upsample1D(nn.Module):
    """ConvTranspose1d k4, stride 2, pad 1: T → 2T; key ``conv``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv = nn.ConvTranspose1d(dim, dim, 4, stride=2, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv(x)


def _transformer_stack(dim: int, args: EstimatorArgs) -> nn.ModuleList:
    return nn.ModuleList(
        TransformerBlock(dim, args.num_heads, args.attention_head_dim) for _ in range(args.n_blocks)
    )


def _run_transformers(blocks: nn.ModuleList, x: Tensor, mask: Tensor | None) -> Tensor:
    """Apply the blocks to x (B, C, T) in (B, T, C) layout; returns (B, C, T) laid out
    channels-last (a transposed view), which the convolutions read as they are."""
    if len(blocks) == 0:
        return x
    bias = None
    if mask is not None:  # (B, 1, T) → (B, 1, 1, T): 0 for valid keys, -1e10 for padded keys
        bias = ((1.0 - mask) * _MASK_BIAS).unsqueeze(1).to(x.dtype)
    # (B, T, C): free when x is channels-last (a oneDNN conv's output), else one copy a level.
    h = x.transpose(1, 2).contiguous()
    for block in blocks:
        h = block(h, bias)
    return h.transpose(1, 2)


# What each entry of the decoder's ModuleLists holds (ModuleList itself is untyped): a down or
# up level is a ResNet block, its transformer blocks and a resampling conv; a mid level has no conv.
_Level = tuple[ResnetBlock1D, nn.ModuleList, nn.Module]
_MidLevel = tuple[ResnetBlock1D, nn.ModuleList]


class ConditionalDecoder(nn.Module):
    """The flow-matching vector-field estimator (``decoder.estimator``)."""

    def __init__(self, args: EstimatorArgs) -> None:
        super().__init__()
        if args.act_fn != "gelu":
            raise ValueError(f"estimator act_fn {args.act_fn!r} is not supported (only 'gelu')")
        channels = tuple(args.channels)
        if not channels:
            raise ValueError("estimator needs at least one channel entry")
        self.in_channels = args.in_channels
        time_dim = channels[0] * 4
        self.time_mlp = TimestepMLP(args.in_channels, time_dim)

        self.down_blocks = nn.ModuleList()
        for i, dim_out in enumerate(channels):
            dim_in = args.in_channels if i == 0 else channels[i - 1]
            last = i == len(channels) - 1
            sample: nn.Module = (
                nn.Conv1d(dim_out, dim_out, 3, padding=1) if last else Downsample1D(dim_out)
            )
            self.down_blocks.append(
                nn.ModuleList(
                    [
                        ResnetBlock1D(dim_in, dim_out, time_dim),
                        _transformer_stack(dim_out, args),
                        sample,
                    ]
                )
            )

        self.mid_blocks = nn.ModuleList(
            nn.ModuleList(
                [
                    ResnetBlock1D(channels[-1], channels[-1], time_dim),
                    _transformer_stack(channels[-1], args),
                ]
            )
            for _ in range(args.num_mid_blocks)
        )

        # Up levels mirror the down levels; each input is [previous output, skip] (2× channels).
        rev = channels[::-1] + (channels[0],)
        self.up_blocks = nn.ModuleList()
        for i in range(len(rev) - 1):
            dim_in, dim_out = rev[i] * 2, rev[i + 1]
            last = i == len(rev) - 2
            sample = nn.Conv1d(dim_out, dim_out, 3, padding=1) if last else Upsample1D(dim_out)
            self.up_blocks.append(
                nn.ModuleList(
                    [
                        ResnetBlock1D(dim_in, dim_out, time_dim),
                        _transformer_stack(dim_out, args),
                        sample,
                    ]
                )
            )

        self.final_block = Block1D(rev[-1], rev[-1])
        self.final_proj = nn.Conv1d(rev[-1], args.out_channels, 1)
        self._n_resnets = len(self._resnets())

    def _resnets(self) -> list[ResnetBlock1D]:
        """The ResNet blocks in the order :meth:`forward` runs them."""
        return [level[0] for level in (*self.down_blocks, *self.mid_blocks, *self.up_blocks)]

    def time_biases(self, t: Tensor) -> list[Tensor]:
        """The part of a pass that depends on the flow time alone: for times t (N,), each
        ResNet block's time bias (N, C_out), in the order :meth:`forward` takes them.

        An ODE solve knows every step's time in advance and asks once for all of them: the
        time MLPs then read their weights (20 MB of float32 at 300M size) once a solve instead
        of once a pass. Measured after a 70-frame batch-2 pass: 2.3 ms of its 146 ms; all ten
        steps' rows at once 3.9 ms.
        """
        temb = self.time_mlp(sinusoidal_embedding(t, self.in_channels))  # (N, time_dim)
        temb_mish = F.mish(temb)  # every ResNet's time MLP starts with the same Mish
        return [resnet.time_bias(temb_mish) for resnet in self._resnets()]

    def forward(
        self,
        x: Tensor,
        mask: Tensor,
        mu: Tensor,
        t: Tensor,
        spks: Tensor | None = None,
        cond: Tensor | None = None,
        time_biases: Sequence[Tensor] | None = None,
    ) -> Tensor:
        """Vector field for x (B, 80, T) given mask (B, 1, T), mu (B, 80, T), t (B,),
        spks (B, 80) and cond (B, 80, T). ``time_biases``: :meth:`time_biases` of t, when the
        caller computed them ahead (t is then not read). Returns (B, 80, T), zero at masked
        frames."""
        if time_biases is None:
            time_biases = self.time_biases(t)
        elif len(time_biases) != self._n_resnets:
            raise ValueError(f"{len(time_biases)} time biases for {self._n_resnets} ResNet blocks")
        rows = x.shape[0]
        biases = iter([b.expand(rows, -1) if b.shape[0] == 1 else b for b in time_biases])

        parts = [x, mu]
        if spks is not None:
            parts.append(spks.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, 80) → (B, 80, T)
        if cond is not None:
            parts.append(cond)
        h = torch.cat(parts, dim=1)  # (B, in_channels, T)

        # With no padding every mask multiplication is a no-op: carry None instead.
        full = bool(mask.min() >= 1.0)
        level_mask: Tensor | None = None if full else mask
        masks: list[Tensor | None] = [level_mask]
        skips: list[Tensor] = []
        for resnet, blocks, sample in cast(Iterable[_Level], self.down_blocks):
            m = masks[-1]
            h = resnet(h, m, next(biases))
            h = _run_transformers(blocks, h, m)
            skips.append(h)
            h = sample(masked(h, m))
            # Stride-2 keeps frames 0, 2, 4, …; the last level does not downsample but the
            # extra mask is dropped below, exactly as the reference bookkeeping does.
            masks.append(None if m is None else m[:, :, ::2])
        masks.pop()

        m = masks[-1]
        for resnet, blocks in cast(Iterable[_MidLevel], self.mid_blocks):
            h = resnet(h, m, next(biases))
            h = _run_transformers(blocks, h, m)

        for resnet, blocks, sample in cast(Iterable[_Level], self.up_blocks):
            m = masks.pop()
            skip = skips.pop()
            # The transposed conv yields 2·ceil(T/2) frames; crop to the skip length.
            h = torch.cat([h[:, :, : skip.shape[-1]], skip], dim=1)
            h = resnet(h, m, next(biases))
            h = _run_transformers(blocks, h, m)
            h = sample(masked(h, m))

        h = self.final_block(h, m)
        out = self.final_proj(masked(h, m))
        return masked(out, level_mask).contiguous()  # (B, 80, T) plain, whatever the convs gave
