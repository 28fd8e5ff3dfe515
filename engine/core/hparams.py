"""Model hyperparameters read from an official model yaml — as data, never as code.

The official file is HyperPyYAML: ``!new:pkg.Class`` / ``!name:pkg.fn`` / ``!apply:fn`` tags name
upstream Python objects and ``!ref <key>`` points at another top-level key. We parse it with a
PyYAML safe loader that turns every tag into plain data (the dotted name is recorded, nothing is
imported or called) and then copy the numbers we need into frozen dataclasses.
"""

from __future__ import annotations

import builtins
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml


class ModelConfigError(ValueError):
    """The model's yaml is missing, unreadable or lacks a required value."""


# --- YAML reading ---------------------------------------------------------------------------


@dataclass(frozen=True)
class TaggedNode:
    """A ``!new:``/``!name:``/``!apply:`` node: the dotted target and its (unresolved) arguments."""

    kind: str
    target: str
    args: Any


@dataclass(frozen=True)
class RefNode:
    """A ``!ref <key>`` node, resolved after the whole document is read."""

    expr: str


if TYPE_CHECKING:
    _SafeLoader = yaml.SafeLoader
else:  # libyaml's loader when PyYAML has it: parses the file several times faster
    _SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _DataLoader(_SafeLoader):
    """Safe loader that reads HyperPyYAML tags as inert data."""


def _construct_tagged(loader: _DataLoader, suffix: str, node: yaml.Node) -> TaggedNode:
    kind, _, target = suffix.partition(":")
    if isinstance(node, yaml.MappingNode):
        args: Any = loader.construct_mapping(node, deep=True)
    elif isinstance(node, yaml.SequenceNode):
        args = loader.construct_sequence(node, deep=True)
    else:
        args = _scalar(loader, node) or None
    return TaggedNode(kind=kind, target=target, args=args)


def _construct_ref(loader: _DataLoader, node: yaml.Node) -> RefNode:
    return RefNode(str(_scalar(loader, node)))


def _scalar(loader: _DataLoader, node: yaml.Node) -> Any:
    """A scalar node's value; any other node is PyYAML's own "expected a scalar" error."""
    if not isinstance(node, yaml.ScalarNode):
        raise yaml.constructor.ConstructorError(
            None, None, f"expected a scalar node, but found {type(node).__name__}", node.start_mark
        )
    return loader.construct_scalar(node)


for _kind in ("new", "name", "apply"):
    _DataLoader.add_multi_constructor(
        f"!{_kind}:", lambda ld, s, n, k=_kind: _construct_tagged(ld, f"{k}:{s}", n)
    )
_DataLoader.add_constructor("!ref", _construct_ref)
# The loader knows these tags; anything else (e.g. !!python/object) stays a YAML error.
_DataLoader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:timestamp"]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# HyperPyYAML reads 1e-06 as a float; YAML 1.1 would read it as a string.
_DataLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)

_REF = re.compile(r"^<([A-Za-z_][\w.]*)>$")


def _resolve(value: Any, top: dict[str, Any], depth: int = 0) -> Any:
    """Replace simple ``!ref <key>`` nodes by the referenced top-level value."""
    if depth > 32:
        raise ModelConfigError("cosyvoice.yaml: !ref chain too deep (cycle?)")
    if isinstance(value, RefNode):
        match = _REF.match(value.expr.strip())
        if match is None or match.group(1).split(".")[0] not in top:
            return value  # an expression we do not need (data pipeline) stays unresolved
        return _resolve(top[match.group(1).split(".")[0]], top, depth + 1)
    if isinstance(value, TaggedNode):
        return TaggedNode(value.kind, value.target, _resolve(value.args, top, depth + 1))
    if isinstance(value, dict):
        return {k: _resolve(v, top, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, depth + 1) for v in value]
    return value


def read_model_yaml(path: Path) -> dict[str, Any]:
    """Read ``cosyvoice.yaml`` into plain data with simple ``!ref``s resolved."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ModelConfigError(f"cannot read {path}: {err.strerror or err}") from err
    try:
        doc = yaml.load(text, Loader=_DataLoader)  # a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ModelConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(doc, dict):
        raise ModelConfigError(f"{path}: expected a mapping at the top level")
    return {k: _resolve(v, doc) for k, v in doc.items()}


# --- typed hyperparameters ------------------------------------------------------------------


@dataclass(frozen=True)
class EncoderArgs:
    """A relative-position Transformer/Conformer encoder (no conv module, no macaron)."""

    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    input_layer: str  # 'linear' (text/flow encoder) or 'linear_legacy' (LLM; ends in ReLU)
    activation: str  # FFN activation: 'silu' (Conformer) or 'relu' (Transformer)
    conformer: bool  # True: norm_mha/norm_ff names; False: norm1/norm2 names
    causal: bool  # static_chunk_size == 1 → lower-triangular attention mask


@dataclass(frozen=True)
class SamplingArgs:
    """Repetition-aware nucleus sampling (``ras_sampling``)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


@dataclass(frozen=True)
class EstimatorArgs:
    """ConditionalDecoder U-Net of the flow-matching decoder."""

    in_channels: int
    out_channels: int
    channels: tuple[int, ...]
    attention_head_dim: int
    n_blocks: int
    num_mid_blocks: int
    num_heads: int
    act_fn: str


@dataclass(frozen=True)
class HiFTArgs:
    """HiFTGenerator vocoder (``hift.pt``)."""

    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    istft_n_fft: int
    istft_hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_in_channels: int
    f0_cond_channels: int


class Section:
    """Typed access to one yaml mapping, with errors naming the key path."""

    def __init__(self, data: Any, path: str, source: str) -> None:
        if isinstance(data, TaggedNode):
            data = data.args
        if not isinstance(data, dict):
            raise ModelConfigError(f"{source}: '{path}' must be a mapping")
        self.data, self.path, self.source = data, path, source

    def _get(self, key: str, default: Any = ...) -> Any:
        if key not in self.data:
            if default is ...:
                raise ModelConfigError(f"{self.source}: missing '{self.path}.{key}'")
            return default
        value = self.data[key]
        if isinstance(value, RefNode):
            raise ModelConfigError(f"{self.source}: unresolved !ref at '{self.path}.{key}'")
        return value

    # From here on int, float and str name these methods: annotations say builtins.*.
    def int(self, key: builtins.str, default: Any = ...) -> builtins.int:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelConfigError(f"{self.source}: '{self.path}.{key}' must be an integer")
        return value

    def float(self, key: builtins.str, default: Any = ...) -> builtins.float:
        value = self._get(key, default)
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ModelConfigError(f"{self.source}: '{self.path}.{key}' must be a number")
        return float(value)

    def str(self, key: builtins.str, default: Any = ...) -> builtins.str:
        value = self._get(key, default)
        if not isinstance(value, str):
            raise ModelConfigError(f"{self.source}: '{self.path}.{key}' must be a string")
        return value

    def ints(self, key: builtins.str, default: Any = ...) -> tuple[builtins.int, ...]:
        value = self._get(key, default)
        if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
            raise ModelConfigError(f"{self.source}: '{self.path}.{key}' must be a list of integers")
        return tuple(value)

    def int_lists(self, key: builtins.str) -> tuple[tuple[builtins.int, ...], ...]:
        value = self._get(key)
        if not isinstance(value, list) or not all(isinstance(v, list) for v in value):
            raise ModelConfigError(f"{self.source}: '{self.path}.{key}' must be a list of lists")
        return tuple(tuple(int(x) for x in v) for v in value)

    def sub(self, key: builtins.str) -> Section:
        return Section(self._get(key), f"{self.path}.{key}", self.source)


def encoder_args(sec: Section, *, conformer: bool) -> EncoderArgs:
    input_layer = sec.str("input_layer", "linear")
    if input_layer not in ("linear", "linear_legacy"):
        raise ModelConfigError(
            f"{sec.source}: unsupported '{sec.path}.input_layer' {input_layer!r}"
        )
    for key, expected in (
        ("pos_enc_layer_type", "rel_pos_espnet"),
        ("selfattention_layer_type", "rel_selfattn"),
    ):
        if sec.str(key, expected) != expected:
            raise ModelConfigError(f"{sec.source}: '{sec.path}.{key}' must be {expected!r}")
    if sec.data.get("use_cnn_module") or sec.data.get("macaron_style"):
        raise ModelConfigError(f"{sec.source}: '{sec.path}': conv module / macaron not supported")
    default_act = "swish" if conformer else "relu"
    activation = {"swish": "silu", "silu": "silu", "relu": "relu"}.get(
        sec.str("activation_type", default_act)
    )
    if activation is None:
        raise ModelConfigError(f"{sec.source}: unsupported '{sec.path}.activation_type'")
    return EncoderArgs(
        input_size=sec.int("input_size"),
        output_size=sec.int("output_size", 256),
        attention_heads=sec.int("attention_heads", 4),
        linear_units=sec.int("linear_units", 2048),
        num_blocks=sec.int("num_blocks", 6),
        input_layer=input_layer,
        activation=activation,
        conformer=conformer,
        causal=sec.int("static_chunk_size", 0) == 1,
    )


def hift_args(sec: Section) -> HiFTArgs:
    istft = sec.sub("istft_params")
    f0 = sec.sub("f0_predictor")
    return HiFTArgs(
        in_channels=sec.int("in_channels", 80),
        base_channels=sec.int("base_channels", 512),
        nb_harmonics=sec.int("nb_harmonics", 8),
        sampling_rate=sec.int("sampling_rate", 22050),
        nsf_alpha=sec.float("nsf_alpha", 0.1),
        nsf_sigma=sec.float("nsf_sigma", 0.003),
        nsf_voiced_threshold=sec.float("nsf_voiced_threshold", 10),
        upsample_rates=sec.ints("upsample_rates"),
        upsample_kernel_sizes=sec.ints("upsample_kernel_sizes"),
        istft_n_fft=istft.int("n_fft"),
        istft_hop_len=istft.int("hop_len"),
        resblock_kernel_sizes=sec.ints("resblock_kernel_sizes"),
        resblock_dilation_sizes=sec.int_lists("resblock_dilation_sizes"),
        source_resblock_kernel_sizes=sec.ints("source_resblock_kernel_sizes"),
        source_resblock_dilation_sizes=sec.int_lists("source_resblock_dilation_sizes"),
        lrelu_slope=sec.float("lrelu_slope", 0.1),
        audio_limit=sec.float("audio_limit", 0.99),
        f0_in_channels=f0.int("in_channels", 80),
        f0_cond_channels=f0.int("cond_channels", 512),
    )


def sampling_args(sec: Section) -> SamplingArgs:
    """The LM's ``sampling`` section (repetition-aware nucleus sampling)."""
    return SamplingArgs(
        top_p=sec.float("top_p", 0.8),
        top_k=sec.int("top_k", 25),
        win_size=sec.int("win_size", 10),
        tau_r=sec.float("tau_r", 0.1),
    )


def estimator_fields(est: Section) -> dict[str, Any]:
    """The fields of :class:`EstimatorArgs` from a flow's ``decoder.estimator`` section (a
    family's estimator args may add more)."""
    return {
        "in_channels": est.int("in_channels"),
        "out_channels": est.int("out_channels"),
        "channels": est.ints("channels", [256, 256]),
        "attention_head_dim": est.int("attention_head_dim", 64),
        "n_blocks": est.int("n_blocks", 1),
        "num_mid_blocks": est.int("num_mid_blocks", 2),
        "num_heads": est.int("num_heads", 4),
        "act_fn": est.str("act_fn", "snake"),
    }


def flow_fields(flow: Section) -> dict[str, Any]:
    """The sizes every family's ``flow`` section gives (its flow args' first fields)."""
    return {
        "input_size": flow.int("input_size", 512),
        "output_size": flow.int("output_size", 80),
        "spk_embed_dim": flow.int("spk_embed_dim", 192),
        "vocab_size": flow.int("vocab_size", 4096),
        "input_frame_rate": flow.int("input_frame_rate", 50),
    }


def cfm_fields(flow: Section) -> tuple[dict[str, Any], Section]:
    """What a flow's ``decoder`` (the conditional flow matching) says beside its estimator, as
    the flow args' fields, and the estimator's section."""
    cfm = flow.sub("decoder")
    params = cfm.sub("cfm_params")
    if "content" in params.data:  # !new:omegaconf.DictConfig {content: {...}}
        params = params.sub("content")
    fields = {
        "cfm_in_channels": cfm.int("in_channels", 240),
        "spk_emb_dim": cfm.int("spk_emb_dim", 80),
        "sigma_min": params.float("sigma_min", 1e-6),
        "t_scheduler": params.str("t_scheduler", "cosine"),
        "inference_cfg_rate": params.float("inference_cfg_rate", 0.7),
    }
    return fields, cfm.sub("estimator")
