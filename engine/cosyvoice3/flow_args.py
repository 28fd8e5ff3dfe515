"""Hyperparameters of the CosyVoice3 flow, read from an official ``cosyvoice3.yaml``.

The ``flow`` section is a ``CausalMaskedDiffWithDiT``: token embedding, a pre-look-ahead layer
(``pre_lookahead_layer``, its own section), the ×``token_mel_ratio`` repeat, and a DiT estimator
under ``decoder.estimator``. The file is read as data (:func:`engine.core.hparams.read_model_yaml`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.hparams import (
    ModelConfigError,
    Section,
    cfm_fields,
    flow_fields,
    read_model_yaml,
)
from engine.cosyvoice2.flow_args import flow_section, int_or_product

# Fixed by the official DiT classes rather than the yaml: the sinusoid fed to the time MLP, and
# the causal convolutional position embedding (two grouped convolutions) after the input proj.
TIME_FREQ_DIM = 256
CONV_POS_KERNEL = 31
CONV_POS_GROUPS = 16


@dataclass(frozen=True)
class DiTArgs:
    """DiT (``decoder.estimator``): a transformer with adaptive layer norm on the flow time."""

    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    static_chunk_size: int  # mel frames per attention chunk in streaming mode


@dataclass(frozen=True)
class DiTFlowArgs:
    """CausalMaskedDiffWithDiT (``flow.pt``)."""

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    input_frame_rate: int  # speech tokens per second
    token_mel_ratio: int  # mel frames per token
    pre_lookahead_len: int
    pre_lookahead_channels: int  # the look-ahead layer's width between its convolutions
    cfm_in_channels: int
    spk_emb_dim: int
    sigma_min: float
    t_scheduler: str
    inference_cfg_rate: float
    estimator: DiTArgs

    @property
    def chunk_tokens(self) -> int:
        """Tokens per attention chunk in streaming mode."""
        return self.estimator.static_chunk_size // self.token_mel_ratio


def _dit_args(est: Section, doc: dict[str, Any], mel_dim: int) -> DiTArgs:
    if "long_skip_connection" in est.data and est.data["long_skip_connection"]:
        raise ModelConfigError(f"{est.source}: '{est.path}.long_skip_connection' is not supported")
    if int_or_product(est, "num_decoding_left_chunks", doc, -1) >= 0:
        raise ModelConfigError(
            f"{est.source}: '{est.path}.num_decoding_left_chunks' must be negative "
            "(every earlier chunk visible)"
        )
    dim_mel = est.int("mel_dim", 80)
    return DiTArgs(
        dim=est.int("dim"),
        depth=est.int("depth", 8),
        heads=est.int("heads", 8),
        dim_head=est.int("dim_head", 64),
        ff_mult=est.int("ff_mult", 4),
        mel_dim=dim_mel,
        mu_dim=est.int("mu_dim", dim_mel),
        spk_dim=est.int("spk_dim", mel_dim),
        static_chunk_size=int_or_product(est, "static_chunk_size", doc, 50),
    )


def flow_args_from_doc(doc: dict[str, Any], source: str = "cosyvoice3.yaml") -> DiTFlowArgs:
    """The flow section of a parsed v3 yaml (:func:`engine.core.hparams.read_model_yaml`)."""
    sec = flow_section(doc, source, "CausalMaskedDiffWithDiT")
    cfm, est = cfm_fields(sec)
    sizes = flow_fields(sec)
    lookahead = sec.int("pre_lookahead_len", 3)
    pre = sec.sub("pre_lookahead_layer")
    args = DiTFlowArgs(
        **sizes,
        token_mel_ratio=sec.int("token_mel_ratio", 2),
        pre_lookahead_len=lookahead,
        pre_lookahead_channels=pre.int("channels"),
        estimator=_dit_args(est, doc, sizes["output_size"]),
        **cfm,
    )
    _check_flow_args(args, pre, source)
    return args


def _check_flow_args(args: DiTFlowArgs, pre: Section, source: str) -> None:
    """What the engine's DiT flow needs of the numbers, with errors naming the key."""
    est = args.estimator
    if pre.int("in_channels") != args.input_size or pre.int("pre_lookahead_len") != (
        args.pre_lookahead_len
    ):
        raise ModelConfigError(
            f"{source}: 'flow.pre_lookahead_layer' must take 'flow.input_size' channels and "
            "'flow.pre_lookahead_len' tokens"
        )
    if args.input_size != est.mu_dim or est.mel_dim != args.output_size:
        raise ModelConfigError(
            f"{source}: the DiT's mu_dim must equal 'flow.input_size' and its mel_dim "
            "'flow.output_size'"
        )
    if args.input_size != args.output_size:
        # mu is the embedded tokens themselves; the official solver copies it into buffers
        # as wide as the mel, so no other width runs upstream.
        raise ModelConfigError(
            f"{source}: 'flow.input_size' ({args.input_size}) must equal 'flow.output_size' "
            f"({args.output_size})"
        )
    if est.spk_dim != args.output_size:
        raise ModelConfigError(f"{source}: the DiT's spk_dim must equal 'flow.output_size'")
    if est.static_chunk_size <= 0 or est.static_chunk_size % args.token_mel_ratio:
        raise ModelConfigError(
            f"{source}: 'flow.decoder.estimator.static_chunk_size' must be a positive multiple "
            "of token_mel_ratio"
        )
    if est.dim % CONV_POS_GROUPS or est.dim_head % 2:
        raise ModelConfigError(
            f"{source}: the DiT's dim must be a multiple of {CONV_POS_GROUPS} and dim_head even"
        )
    if args.t_scheduler not in ("cosine", "linear"):
        raise ModelConfigError(f"{source}: unsupported t_scheduler {args.t_scheduler!r}")


def load_flow_args(yaml_path: Path) -> DiTFlowArgs:
    """Read the flow hyperparameters of an official v3 yaml."""
    return flow_args_from_doc(read_model_yaml(yaml_path), Path(yaml_path).name)
