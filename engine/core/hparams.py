"""Model hyperparameters read from an official ``cosyvoice.yaml`` — as data, never as code.

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
    """The model's ``cosyvoice.yaml`` is missing, unreadable or lacks a required value."""


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
class LLMArgs:
    """TransformerLM (``llm.pt``)."""

    text_token_size: int
    speech_token_size: int
    text_encoder_input_size: int
    llm_input_size: int
    llm_output_size: int
    spk_embed_dim: int
    text_encoder: EncoderArgs
    llm: EncoderArgs
    sampling: SamplingArgs


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
class FlowArgs:
    """MaskedDiffWithXvec (``flow.pt``)."""

    input_size: int
    output_size: int
    spk_embed_dim: int
    vocab_size: int
    input_frame_rate: int
    encoder: EncoderArgs
    regulator_channels: int
    regulator_sampling_ratios: tuple[int, ...]
    cfm_in_channels: int
    spk_emb_dim: int
    sigma_min: float
    t_scheduler: str
    inference_cfg_rate: float
    estimator: EstimatorArgs


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


@dataclass(frozen=True)
class ModelArgs:
    """Everything needed to build the three models of one model directory."""

    sample_rate: int
    llm: LLMArgs
    flow: FlowArgs
    hift: HiFTArgs


class _Section:
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

    def sub(self, key: builtins.str) -> _Section:
        return _Section(self._get(key), f"{self.path}.{key}", self.source)


def _encoder_args(sec: _Section, *, conformer: bool) -> EncoderArgs:
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


def _llm_args(sec: _Section) -> LLMArgs:
    sampling = sec.sub("sampling")
    return LLMArgs(
        text_token_size=sec.int("text_token_size"),
        speech_token_size=sec.int("speech_token_size"),
        text_encoder_input_size=sec.int("text_encoder_input_size"),
        llm_input_size=sec.int("llm_input_size"),
        llm_output_size=sec.int("llm_output_size"),
        spk_embed_dim=sec.int("spk_embed_dim", 192),
        text_encoder=_encoder_args(sec.sub("text_encoder"), conformer=True),
        llm=_encoder_args(sec.sub("llm"), conformer=False),
        sampling=SamplingArgs(
            top_p=sampling.float("top_p", 0.8),
            top_k=sampling.int("top_k", 25),
            win_size=sampling.int("win_size", 10),
            tau_r=sampling.float("tau_r", 0.1),
        ),
    )


def _flow_args(sec: _Section) -> FlowArgs:
    regulator = sec.sub("length_regulator")
    cfm = sec.sub("decoder")
    cfm_params = cfm.sub("cfm_params")
    if "content" in cfm_params.data:  # !new:omegaconf.DictConfig {content: {...}}
        cfm_params = cfm_params.sub("content")
    est = cfm.sub("estimator")
    return FlowArgs(
        input_size=sec.int("input_size", 512),
        output_size=sec.int("output_size", 80),
        spk_embed_dim=sec.int("spk_embed_dim", 192),
        vocab_size=sec.int("vocab_size", 4096),
        input_frame_rate=sec.int("input_frame_rate", 50),
        encoder=_encoder_args(sec.sub("encoder"), conformer=True),
        regulator_channels=regulator.int("channels"),
        regulator_sampling_ratios=regulator.ints("sampling_ratios"),
        cfm_in_channels=cfm.int("in_channels", 240),
        spk_emb_dim=cfm.int("spk_emb_dim", 80),
        sigma_min=cfm_params.float("sigma_min", 1e-6),
        t_scheduler=cfm_params.str("t_scheduler", "cosine"),
        inference_cfg_rate=cfm_params.float("inference_cfg_rate", 0.7),
        estimator=EstimatorArgs(
            in_channels=est.int("in_channels"),
            out_channels=est.int("out_channels"),
            channels=est.ints("channels", [256, 256]),
            attention_head_dim=est.int("attention_head_dim", 64),
            n_blocks=est.int("n_blocks", 1),
            num_mid_blocks=est.int("num_mid_blocks", 2),
            num_heads=est.int("num_heads", 4),
            act_fn=est.str("act_fn", "snake"),
        ),
    )


def _hift_args(sec: _Section) -> HiFTArgs:
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


def load_model_args(yaml_path: Path) -> ModelArgs:
    """Read the hyperparameters of the three models from an official ``cosyvoice.yaml``."""
    doc = read_model_yaml(yaml_path)
    source = Path(yaml_path).name
    top = _Section(doc, "", source)
    for key in ("llm", "flow", "hift"):
        if key not in doc:
            raise ModelConfigError(f"{yaml_path}: missing top-level section '{key}'")
    return ModelArgs(
        sample_rate=top.int("sample_rate", 22050),
        llm=_llm_args(_Section(doc["llm"], "llm", source)),
        flow=_flow_args(_Section(doc["flow"], "flow", source)),
        hift=_hift_args(_Section(doc["hift"], "hift", source)),
    )
