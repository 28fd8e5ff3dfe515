"""CosyVoice v1's hyperparameters: the three models of an official ``cosyvoice.yaml``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.core.hparams import (
    EncoderArgs,
    EstimatorArgs,
    HiFTArgs,
    ModelConfigError,
    SamplingArgs,
    Section,
    cfm_fields,
    encoder_args,
    estimator_fields,
    flow_fields,
    hift_args,
    read_model_yaml,
    sampling_args,
)


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
class ModelArgs:
    """Everything needed to build the three models of one model directory."""

    sample_rate: int
    llm: LLMArgs
    flow: FlowArgs
    hift: HiFTArgs


def _llm_args(sec: Section) -> LLMArgs:
    return LLMArgs(
        text_token_size=sec.int("text_token_size"),
        speech_token_size=sec.int("speech_token_size"),
        text_encoder_input_size=sec.int("text_encoder_input_size"),
        llm_input_size=sec.int("llm_input_size"),
        llm_output_size=sec.int("llm_output_size"),
        spk_embed_dim=sec.int("spk_embed_dim", 192),
        text_encoder=encoder_args(sec.sub("text_encoder"), conformer=True),
        llm=encoder_args(sec.sub("llm"), conformer=False),
        sampling=sampling_args(sec.sub("sampling")),
    )


def _flow_args(sec: Section) -> FlowArgs:
    regulator = sec.sub("length_regulator")
    cfm, est = cfm_fields(sec)
    return FlowArgs(
        **flow_fields(sec),
        encoder=encoder_args(sec.sub("encoder"), conformer=True),
        regulator_channels=regulator.int("channels"),
        regulator_sampling_ratios=regulator.ints("sampling_ratios"),
        estimator=EstimatorArgs(**estimator_fields(est)),
        **cfm,
    )


def load_model_args(yaml_path: Path) -> ModelArgs:
    """Read the hyperparameters of the three models from an official ``cosyvoice.yaml``."""
    doc = read_model_yaml(yaml_path)
    source = Path(yaml_path).name
    top = Section(doc, "", source)
    for key in ("llm", "flow", "hift"):
        if key not in doc:
            raise ModelConfigError(f"{yaml_path}: missing top-level section '{key}'")
    return ModelArgs(
        sample_rate=top.int("sample_rate", 22050),
        llm=_llm_args(Section(doc["llm"], "llm", source)),
        flow=_flow_args(Section(doc["flow"], "flow", source)),
        hift=hift_args(Section(doc["hift"], "hift", source)),
    )
