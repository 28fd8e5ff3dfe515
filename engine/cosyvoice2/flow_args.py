"""Hyperparameters of the CosyVoice2 flow and HiFT, read from an official ``cosyvoice2.yaml``.

The file is read as data by :func:`engine.core.hparams.read_model_yaml` (no tag is executed). v2's
``flow`` section is a ``CausalMaskedDiffWithXvec`` (upsampling Conformer encoder, chunk-causal
decoder); its ``hift`` section has v1's layout with other numbers, so it fills v1's
:class:`~engine.core.hparams.HiFTArgs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.core.hparams import (
    EstimatorArgs,
    HiFTArgs,
    ModelConfigError,
    RefNode,
    Section,
    TaggedNode,
    cfm_fields,
    estimator_fields,
    flow_fields,
    hift_args,
    read_model_yaml,
)

# Fixed by the official encoder class rather than its yaml: four up-sampled Conformer layers
# after a stride-2 up-sampling conv, and a 3-token look-ahead conv in front.
UP_BLOCKS = 4
UPSAMPLE_STRIDE = 2
# The fixed noise of the causal CFM: torch.manual_seed(0), then randn(1, 80, 50 · 300) —
# room for 300 s of mel frames.
NOISE_SEED = 0
NOISE_FRAMES = 50 * 300


@dataclass(frozen=True)
class UpsampleEncoderArgs:
    """UpsampleConformerEncoder: rel-pos Conformer layers (no conv module, no macaron)."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    num_up_blocks: int
    upsample_stride: int
    pre_lookahead_len: int
    static_chunk_size: int  # tokens per attention chunk in streaming mode


@dataclass(frozen=True)
class CausalEstimatorArgs(EstimatorArgs):
    """CausalConditionalDecoder: the chunk-causal vector-field estimator (v1's numbers, and
    its attention chunks)."""

    static_chunk_size: int  # mel frames per attention chunk in streaming mode
    num_decoding_left_chunks: int  # < 0: every earlier chunk is visible


@dataclass(frozen=True)
class CausalFlowArgs:
    """CausalMaskedDiffWithXvec (``flow.pt``)."""

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    input_frame_rate: int  # speech tokens per second
    token_mel_ratio: int  # mel frames per token
    pre_lookahead_len: int
    encoder: UpsampleEncoderArgs
    cfm_in_channels: int
    spk_emb_dim: int
    sigma_min: float
    t_scheduler: str
    inference_cfg_rate: float
    estimator: CausalEstimatorArgs


_REF_FACTOR = re.compile(r"^\s*(?:<([A-Za-z_]\w*)>|(\d+))\s*$")


def _product_of_refs(expr: str, doc: dict[str, Any], source: str, where: str) -> int:
    """Evaluate a ``!ref <a> * <b>`` product of top-level integers (the only expression the
    flow section uses)."""
    value = 1
    for factor in expr.split("*"):
        match = _REF_FACTOR.match(factor)
        if match is None:
            raise ModelConfigError(f"{source}: cannot evaluate !ref {expr!r} at '{where}'")
        if match.group(2) is not None:
            value *= int(match.group(2))
            continue
        ref = doc.get(match.group(1))
        if isinstance(ref, bool) or not isinstance(ref, int):
            raise ModelConfigError(f"{source}: '{match.group(1)}' in '{where}' must be an integer")
        value *= ref
    return value


def int_or_product(sec: Section, key: str, doc: dict[str, Any], default: int) -> int:
    """An integer value of ``sec``, which may be a ``!ref <a> * <b>`` product."""
    raw = sec.data.get(key, default)
    if isinstance(raw, RefNode):
        return _product_of_refs(raw.expr, doc, sec.source, f"{sec.path}.{key}")
    return sec.int(key, default)


def _encoder_args(sec: Section, pre_lookahead_len: int) -> UpsampleEncoderArgs:
    for key, expected in (
        ("input_layer", "linear"),
        ("pos_enc_layer_type", "rel_pos_espnet"),
        ("selfattention_layer_type", "rel_selfattn"),
    ):
        if sec.str(key, expected) != expected:
            raise ModelConfigError(f"{sec.source}: '{sec.path}.{key}' must be {expected!r}")
    if sec.data.get("use_cnn_module", True) or sec.data.get("macaron_style", True):
        raise ModelConfigError(
            f"{sec.source}: '{sec.path}': set use_cnn_module and macaron_style to False "
            "(the conv module and macaron FFN are not supported)"
        )
    if sec.str("activation_type", "swish") not in ("swish", "silu"):
        raise ModelConfigError(f"{sec.source}: '{sec.path}.activation_type' must be 'swish'")
    return UpsampleEncoderArgs(
        input_size=sec.int("input_size"),
        output_size=sec.int("output_size", 256),
        attention_heads=sec.int("attention_heads", 4),
        linear_units=sec.int("linear_units", 2048),
        num_blocks=sec.int("num_blocks", 6),
        num_up_blocks=UP_BLOCKS,
        upsample_stride=UPSAMPLE_STRIDE,
        pre_lookahead_len=pre_lookahead_len,
        static_chunk_size=sec.int("static_chunk_size", 0),
    )


def flow_section(doc: dict[str, Any], source: str, class_name: str) -> Section:
    """The ``flow`` section of a parsed yaml, refused if it builds another class."""
    if "flow" not in doc:
        raise ModelConfigError(f"{source}: missing top-level section 'flow'")
    flow = doc["flow"]
    if isinstance(flow, TaggedNode) and not flow.target.endswith(class_name):
        raise ModelConfigError(f"{source}: 'flow' is a {flow.target}, not {class_name}")
    return Section(flow, "flow", source)


def flow_args_from_doc(doc: dict[str, Any], source: str = "cosyvoice2.yaml") -> CausalFlowArgs:
    """The flow section of a parsed v2 yaml (:func:`engine.core.hparams.read_model_yaml`)."""
    sec = flow_section(doc, source, "CausalMaskedDiffWithXvec")
    cfm, est = cfm_fields(sec)
    lookahead = sec.int("pre_lookahead_len", 3)
    args = CausalFlowArgs(
        **flow_fields(sec),
        token_mel_ratio=sec.int("token_mel_ratio", 2),
        pre_lookahead_len=lookahead,
        encoder=_encoder_args(sec.sub("encoder"), lookahead),
        estimator=CausalEstimatorArgs(
            **estimator_fields(est),
            static_chunk_size=int_or_product(est, "static_chunk_size", doc, 50),
            num_decoding_left_chunks=int_or_product(est, "num_decoding_left_chunks", doc, 2),
        ),
        **cfm,
    )
    _check_flow_args(args, source)
    return args


def _check_flow_args(args: CausalFlowArgs, source: str) -> None:
    """What the chunk-causal design needs of the numbers, with errors naming the key."""
    enc, est = args.encoder, args.estimator
    if args.token_mel_ratio != enc.upsample_stride:
        raise ModelConfigError(
            f"{source}: 'flow.token_mel_ratio' must equal the encoder's up-sampling stride "
            f"({enc.upsample_stride})"
        )
    if enc.input_size != args.input_size or enc.output_size != args.input_size:
        raise ModelConfigError(
            f"{source}: the encoder's input_size and output_size must equal 'flow.input_size'"
        )
    if enc.static_chunk_size <= 0 or est.static_chunk_size <= 0:
        raise ModelConfigError(f"{source}: the flow's static_chunk_size values must be positive")
    if est.static_chunk_size != enc.static_chunk_size * args.token_mel_ratio:
        raise ModelConfigError(
            f"{source}: 'flow.decoder.estimator.static_chunk_size' must be the encoder's "
            "static_chunk_size times token_mel_ratio"
        )
    if est.num_decoding_left_chunks >= 0:
        raise ModelConfigError(
            f"{source}: 'flow.decoder.estimator.num_decoding_left_chunks' must be negative "
            "(every earlier chunk visible)"
        )
    if len(est.channels) != 1:
        raise ModelConfigError(
            f"{source}: 'flow.decoder.estimator.channels' must have one entry (a single "
            "resolution level; the chunk-causal decoder does not resample)"
        )
    if est.act_fn != "gelu":
        raise ModelConfigError(f"{source}: 'flow.decoder.estimator.act_fn' must be 'gelu'")
    if args.t_scheduler not in ("cosine", "linear"):
        raise ModelConfigError(f"{source}: unsupported t_scheduler {args.t_scheduler!r}")


def hift_args_from_doc(doc: dict[str, Any], source: str = "cosyvoice2.yaml") -> HiFTArgs:
    """The hift section of a parsed v2 yaml (v1's layout: :class:`HiFTArgs`)."""
    if "hift" not in doc:
        raise ModelConfigError(f"{source}: missing top-level section 'hift'")
    return hift_args(Section(doc["hift"], "hift", source))


def load_flow_args(yaml_path: Path) -> CausalFlowArgs:
    """Read the flow hyperparameters of an official v2 yaml."""
    return flow_args_from_doc(read_model_yaml(yaml_path), Path(yaml_path).name)


def load_hift_args(yaml_path: Path) -> HiFTArgs:
    """Read the HiFT hyperparameters of an official v2 yaml."""
    return hift_args_from_doc(read_model_yaml(yaml_path), Path(yaml_path).name)
