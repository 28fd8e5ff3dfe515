"""MaskedDiffWithXvec: speech tokens → 80-bin mel by conditional flow matching.

Pipeline for one call (batch 1): speaker x-vector → 80-d ``spks``; prompt+new tokens → embedding →
bidirectional rel-pos Conformer encoder → ``encoder_proj`` (80-d) → interpolating length regulator
(22050/256 frames per 50 Hz token) → ``mu``; then 10 Euler steps of the ODE dx/dt = v(x, t) on a
cosine time grid, where v is the U-Net estimator evaluated on a CFG batch of two rows
(conditional, and with mu/spks/cond zeroed) and combined as (1+w)·v_cond − w·v_uncond.

Flow cache (streaming). The cache is the official tensor layout, a float tensor of shape
``(1, 80, C, 2)``: ``[..., 0]`` holds the initial noise z and ``[..., 1]`` the conditioning mu of
C pinned frames. A call pins the first C frames of its own z **and** mu to these values and returns
a new cache made of its prompt frames followed by its last 34 frames (the 20-token overlap of the
next chunk). An empty cache is ``(1, 80, 0, 2)`` (see :func:`empty_flow_cache`); ``None`` is
accepted as empty.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.hparams import EstimatorArgs
from engine.core.solver import (
    EXACT_SOLVER,
    T_SCHEDULERS,
    FieldInputs,
    GuidedCFM,
    StepCallback,
    VectorField,
)
from engine.core.speaker import project_speaker
from engine.core.transformer import RelPosEncoder
from engine.cosyvoice1.flow_estimator import ConditionalDecoder
from engine.cosyvoice1.hparams import FlowArgs

_LOGGER = logging.getLogger(__name__)

_SAMPLE_RATE = 22050  # hard-coded upstream in the token → frame conversion
_HOP = 256
_OVERLAP_TOKENS = 20  # streaming overlap between chunks, hard-coded upstream
_CACHE_TAIL_FRAMES = 34  # = frames(_OVERLAP_TOKENS) at 50 Hz; the z/mu tail kept for the next chunk


def tokens_to_frames(n_tokens: int, token_rate: int) -> int:
    """floor(n / rate · 22050 / 256), with the same float evaluation order as upstream."""
    return int(n_tokens / token_rate * _SAMPLE_RATE / _HOP)


def empty_flow_cache(
    dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> Tensor:
    """The flow cache of a request's first chunk: (1, 80, 0, 2)."""
    return torch.zeros(1, 80, 0, 2, dtype=dtype, device=device)


class InterpolateRegulator(nn.Module):
    """Linear interpolation of token features to mel frames, then a small conv stack.

    ``model`` = len(sampling_ratios) × [Conv1d k3, GroupNorm(1), Mish] + Conv1d k1 (keys
    ``model.K.*`` as in flow.pt; the Mish entries have no parameters).
    """

    def __init__(self, channels: int, sampling_ratios: tuple[int, ...], token_rate: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in sampling_ratios:
            layers += [
                nn.Conv1d(channels, channels, 3, padding=1),
                nn.GroupNorm(1, channels),
                nn.Mish(),
            ]
        layers.append(nn.Conv1d(channels, channels, 1))
        self.model = nn.Sequential(*layers)
        self.token_rate = token_rate

    def interpolate(self, x1: Tensor, x2: Tensor, mel_len1: int, mel_len2: int) -> Tensor:
        """Prompt features x1 (1, N1, C) and new features x2 (1, N2, C) → (1, C, mel_len1+mel_len2).

        With more than 40 new tokens the first and last 20 tokens are stretched to exactly 34
        frames each, so that a streaming chunk's 20-token overlap lands on a clean frame boundary.
        """

        def stretch(x: Tensor, size: int) -> Tensor:  # (1, N, C) → (1, C, size)
            return F.interpolate(x.transpose(1, 2).contiguous(), size=size, mode="linear")

        n2 = x2.shape[1]
        if n2 > 2 * _OVERLAP_TOKENS:
            edge = tokens_to_frames(_OVERLAP_TOKENS, self.token_rate)
            new = torch.cat(
                [
                    stretch(x2[:, :_OVERLAP_TOKENS], edge),
                    stretch(x2[:, _OVERLAP_TOKENS:-_OVERLAP_TOKENS], mel_len2 - 2 * edge),
                    stretch(x2[:, -_OVERLAP_TOKENS:], edge),
                ],
                dim=2,
            )
        else:
            new = stretch(x2, mel_len2)
        if x1.shape[1] == 0:
            return new
        # The prompt is stretched independently to the prompt mel length (not forced to agree).
        return torch.cat([stretch(x1, mel_len1), new], dim=2)

    def forward(self, x: Tensor) -> Tensor:
        """Interpolated features (1, C, T) → mu (1, C, T)."""
        return self.model(x)


class ConditionalCFM(GuidedCFM):
    """The flow ODE's solver with classifier-free guidance (key prefix ``decoder``)."""

    def __init__(self, args: EstimatorArgs, t_scheduler: str) -> None:
        super().__init__()
        if t_scheduler not in T_SCHEDULERS:
            raise ValueError(f"unsupported t_scheduler {t_scheduler!r}")
        self.t_scheduler = t_scheduler
        self.estimator = ConditionalDecoder(args)

    def vector_field(self, evaluations: int, **options: Any) -> VectorField:
        def field(step: int, x: Tensor, at: FieldInputs) -> Tensor:
            # Batch 1 has no padding: every frame of every row is valid.
            mask = torch.ones(x.shape[0], 1, x.shape[-1], dtype=at.mu.dtype, device=at.mu.device)
            return self.estimator(
                x, mask, at.mu, at.t, at.spks, at.cond, time_biases=at.time_biases
            )

        return field


@dataclass
class FlowConditioning:
    """Everything computed before the ODE (also what the parity tests compare)."""

    spks: Tensor  # (1, 80) projected, L2-normalised x-vector
    encoder_out: Tensor  # (1, N1+N2, D) Conformer output
    h: Tensor  # (1, N1+N2, 80) encoder_proj output
    interp: Tensor  # (1, 80, T) length-regulator input after interpolation
    mu: Tensor  # (1, 80, T)
    cond: Tensor  # (1, 80, T): prompt mel in the first mel_len1 frames, zeros after
    mel_len1: int  # prompt frames
    mel_len2: int  # frames generated for the new tokens


class FlowModel(nn.Module):
    """MaskedDiffWithXvec with the official ``flow.pt`` key names."""

    def __init__(self, args: FlowArgs) -> None:
        super().__init__()
        self.args = args
        self.input_embedding = nn.Embedding(args.vocab_size, args.input_size)
        self.spk_embed_affine_layer = nn.Linear(args.spk_embed_dim, args.output_size)
        self.encoder = RelPosEncoder(args.encoder)
        self.encoder_proj = nn.Linear(args.encoder.output_size, args.output_size)
        self.length_regulator = InterpolateRegulator(
            args.regulator_channels, args.regulator_sampling_ratios, args.input_frame_rate
        )
        self.decoder = ConditionalCFM(args.estimator, args.t_scheduler)

    @torch.no_grad()
    def encode(
        self, tokens: Tensor, prompt_tokens: Tensor, prompt_feat: Tensor, embedding: Tensor
    ) -> FlowConditioning:
        """Speaker projection, encoder, length regulator and cond for one utterance (batch 1)."""
        if tokens.dim() != 2 or tokens.shape[0] != 1 or tokens.shape[1] == 0:
            raise ValueError(f"tokens must have shape (1, N>0), got {tuple(tokens.shape)}")
        if prompt_tokens.dim() != 2 or prompt_tokens.shape[0] != 1:
            raise ValueError(
                f"prompt_tokens must have shape (1, N), got {tuple(prompt_tokens.shape)}"
            )
        if (
            prompt_feat.dim() != 3
            or prompt_feat.shape[0] != 1
            or prompt_feat.shape[2] != self.args.output_size
        ):
            raise ValueError(
                f"prompt_feat must have shape (1, T, 80), got {tuple(prompt_feat.shape)}"
            )
        spks = project_speaker(self.spk_embed_affine_layer, embedding)  # (1, 80)

        n1, n2 = prompt_tokens.shape[1], tokens.shape[1]
        ids = torch.cat([prompt_tokens, tokens], dim=1).long().clamp(min=0)  # (1, N1+N2)
        # Batch 1 has no padding, so the official pad-mask multiply and encoder mask are no-ops.
        encoder_out = self.encoder(self.input_embedding(ids))
        h = self.encoder_proj(encoder_out)  # (1, N, 80)

        mel_len1 = prompt_feat.shape[1]
        mel_len2 = tokens_to_frames(n2, self.args.input_frame_rate)
        interp = self.length_regulator.interpolate(h[:, :n1], h[:, n1:], mel_len1, mel_len2)
        mu = self.length_regulator(interp)  # (1, 80, T)

        cond = torch.zeros_like(mu)
        cond[:, :, :mel_len1] = prompt_feat.to(mu).transpose(1, 2)
        return FlowConditioning(spks, encoder_out, h, interp, mu, cond, mel_len1, mel_len2)

    @torch.no_grad()
    def inference(
        self,
        tokens: Tensor,
        prompt_tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        flow_cache: Tensor | None,
        *,
        noise: Tensor | None = None,
        generator: torch.Generator | None = None,
        n_timesteps: int = 10,
        cfg_rate: float | None = None,
        solver: str = EXACT_SOLVER,
        step_callback: StepCallback | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Mel for new tokens (1, N2) → ((1, 80, mel_len2), new flow cache (1, 80, C', 2)).

        prompt_tokens (1, N1) and prompt_feat (1, T1, 80) may be empty (N1 = T1 = 0); embedding
        is the raw (1, 192) x-vector. ``noise`` (1, 80, T1+mel_len2) replaces the initial
        ``randn`` draw (parity tests); otherwise it is drawn with ``generator``.
        """
        c = self.encode(tokens, prompt_tokens, prompt_feat, embedding)
        mu = c.mu
        total = c.mel_len1 + c.mel_len2
        if noise is not None:
            if tuple(noise.shape) != (1, mu.shape[1], total):
                raise ValueError(
                    f"noise must have shape (1, {mu.shape[1]}, {total}), got {tuple(noise.shape)}"
                )
            z = noise.to(mu).clone()
        else:
            z = torch.randn(mu.shape, generator=generator, dtype=mu.dtype, device=mu.device)

        cached = 0 if flow_cache is None else flow_cache.shape[2]
        if flow_cache is not None and cached:
            if cached > total:
                raise ValueError(f"flow cache has {cached} frames but the call has only {total}")
            # Pin the overlap: same noise AND same mu as the previous chunk for these frames.
            z[:, :, :cached] = flow_cache[:, :, :, 0]
            mu[:, :, :cached] = flow_cache[:, :, :, 1]
        # Slicing with -34 keeps everything when total < 34, as upstream.
        new_cache = torch.stack(
            [
                torch.cat([z[:, :, : c.mel_len1], z[:, :, -_CACHE_TAIL_FRAMES:]], dim=2),
                torch.cat([mu[:, :, : c.mel_len1], mu[:, :, -_CACHE_TAIL_FRAMES:]], dim=2),
            ],
            dim=-1,
        )  # (1, 80, mel_len1 + 34, 2)

        rate = self.args.inference_cfg_rate if cfg_rate is None else cfg_rate
        _LOGGER.debug(
            "flow: %d prompt + %d new tokens → %d frames (%d pinned), %d steps",
            prompt_tokens.shape[1],
            tokens.shape[1],
            total,
            cached,
            n_timesteps,
        )
        mel = self.decoder.solve(
            z,
            mu,
            c.spks,
            c.cond,
            n_timesteps=n_timesteps,
            cfg_rate=rate,
            solver=solver,
            step_callback=step_callback,
        )
        return mel[:, :, c.mel_len1 :], new_cache
