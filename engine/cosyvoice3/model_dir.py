"""A Fun-CosyVoice3 model directory in the official layout: its files and its LM.

    cosyvoice3.yaml            the llm, flow and hift sections (read as data; no tag runs)
    llm.pt, flow.pt, hift.pt   state dicts with the official key names
    llm.rl.pt                  optional: the RL-tuned LM, the same keys and shapes as llm.pt
    CosyVoice-BlankEN/         the Qwen2 backbone's config.json and tokenizer files (its own
                               weights are never read: the LM file holds them)
    campplus.onnx, speech_tokenizer_v3.onnx   prompt extraction only (voices from a recording)

The RL LM: the official training tunes it with the same class (only the loss differs) and
saves the same module, so it loads wherever ``llm.pt`` does; the official runtime never names
it (it reads ``llm.pt``), so choosing it is a setting of ours.

:data:`PARTS` tells :mod:`engine.core.prepared` how to build the three models and read their
checkpoints (the engine runs from the prepared files); :func:`load_model_dir` reads the
checkpoints straight.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from torch import nn

from engine.core.hparams import ModelConfigError
from engine.core.prepared import ModelParts
from engine.core.types import ModelLoadError
from engine.core.weights import PARTS as PART_NAMES
from engine.core.weights import check_model_dir, read_state_dict, without_init
from engine.cosyvoice2.lm import BACKBONE_DIR, UNUSED_KEYS, SpeechLMArgs
from engine.cosyvoice2.model_dir import (
    TOKENIZER_FILES,
    TOKENIZER_JSON,
    read_checked_args,
    tie_text_head,
)
from engine.cosyvoice2.qwen2 import Qwen2Config
from engine.cosyvoice3.flow import DiTFlow, build_flow, load_flow
from engine.cosyvoice3.flow import int8_layer_names as flow_int8_layer_names
from engine.cosyvoice3.flow_args import DiTFlowArgs, flow_args_from_doc
from engine.cosyvoice3.hift import (
    CausalHiFT,
    CausalHiFTArgs,
    build_causal_hift,
    causal_hift_args_from_doc,
    load_causal_hift,
)
from engine.cosyvoice3.lm import (
    CONFIG_FILE,
    CosyVoice3LM,
    build_cosyvoice3_lm,
    cosyvoice3_lm_args,
    load_cosyvoice3_lm,
    load_cosyvoice3_lm_args,
)

LM_FILE = "llm.pt"
RL_LM_FILE = "llm.rl.pt"  # engine.family_facts says so too (the server downloads it)
CHECKPOINT_FILES = (LM_FILE, "flow.pt", "hift.pt")
BACKBONE_CONFIG = f"{BACKBONE_DIR}/config.json"
REQUIRED_FILES = (CONFIG_FILE, *CHECKPOINT_FILES, BACKBONE_CONFIG)
PROMPT_MODEL_FILES = ("campplus.onnx", "speech_tokenizer_v3.onnx")


def is_cosyvoice3_dir(model_dir: Path) -> bool:
    """Whether ``model_dir`` is meant as a CosyVoice3 directory (it holds ``cosyvoice3.yaml``)."""
    return (Path(model_dir) / CONFIG_FILE).is_file()


def missing_model_files(model_dir: Path, *, rl_lm: bool = False) -> list[str]:
    """The files the engine needs that ``model_dir`` lacks (empty when complete); ``rl_lm``:
    the RL-tuned LM is wanted too."""
    model_dir = Path(model_dir)
    wanted = REQUIRED_FILES + ((RL_LM_FILE,) if rl_lm else ())
    missing = [name for name in wanted if not (model_dir / name).is_file()]
    if not (model_dir / TOKENIZER_JSON).is_file():
        missing += [name for name in TOKENIZER_FILES if not (model_dir / name).is_file()]
    return missing


def read_lm_args(model_dir: Path, *, rl_lm: bool = False) -> SpeechLMArgs:
    """Check that ``model_dir`` is a complete CosyVoice3 directory and read the LM's numbers."""
    model_dir = Path(model_dir)
    check_model_dir(
        model_dir, missing_model_files(model_dir, rl_lm=rl_lm) if model_dir.is_dir() else []
    )
    try:
        return load_cosyvoice3_lm_args(model_dir)
    except ModelConfigError as err:
        raise ModelLoadError(f"{model_dir}: {err}") from err


def lm_file(model_dir: Path, *, rl_lm: bool = False) -> Path:
    """The LM checkpoint: ``llm.rl.pt`` when the RL-tuned LM is chosen, else ``llm.pt``."""
    return Path(model_dir) / (RL_LM_FILE if rl_lm else LM_FILE)


def load_lm(model_dir: Path, *, rl_lm: bool = False, int8: bool = False) -> CosyVoice3LM:
    """The LM straight from its official checkpoint (float32, or with the int8 layers)."""
    args = read_lm_args(model_dir, rl_lm=rl_lm)
    path = lm_file(model_dir, rl_lm=rl_lm)
    return load_cosyvoice3_lm(read_state_dict(path), args, int8=int8, source=str(path))


@dataclass(frozen=True)
class CosyVoice3Args:
    """The hyperparameters of the three models."""

    lm: SpeechLMArgs
    flow: DiTFlowArgs
    hift: CausalHiFTArgs

    @property
    def sample_rate(self) -> int:
        return self.hift.sampling_rate

    @property
    def token_rate(self) -> int:
        """Speech tokens per second."""
        return self.flow.input_frame_rate


def read_args(model_dir: Path) -> CosyVoice3Args:
    """Check that ``model_dir`` is a complete CosyVoice3 directory and read its numbers."""
    return read_checked_args(model_dir, CONFIG_FILE, missing_model_files, args_from)


def read_rl_args(model_dir: Path) -> CosyVoice3Args:
    """:func:`read_args` of a directory that must hold the RL-tuned LM too."""
    missing = functools.partial(missing_model_files, rl_lm=True)
    return read_checked_args(model_dir, CONFIG_FILE, missing, args_from)


def args_from(
    doc: dict[str, Any], backbone: Qwen2Config, source: str = CONFIG_FILE
) -> CosyVoice3Args:
    """The numbers of a parsed ``cosyvoice3.yaml`` and the backbone's config."""
    if "llm" not in doc:
        raise ModelConfigError(f"{source}: missing top-level section 'llm'")
    return CosyVoice3Args(
        lm=cosyvoice3_lm_args(doc["llm"], backbone, source),
        flow=flow_args_from_doc(doc, source),
        hift=causal_hift_args_from_doc(doc, source),
    )


def build_on_meta(args: CosyVoice3Args, part: str) -> nn.Module:
    """One of the three models, built without memory for its weights."""
    with without_init():  # every value is assigned from a file
        if part == "llm":
            return build_cosyvoice3_lm(args.lm)
        if part == "flow":
            return build_flow(args.flow)
        return build_causal_hift(args.hift)


def read_part(
    model_dir: Path, args: CosyVoice3Args, part: str, checkpoint: str | None = None
) -> nn.Module:
    """One model loaded from its official checkpoint (``<part>.pt`` unless another is given),
    float32 (HiFT's weight norm folded)."""
    path = Path(model_dir) / (checkpoint or f"{part}.pt")
    state = read_state_dict(path)
    with without_init():
        if part == "llm":
            return load_cosyvoice3_lm(state, args.lm, source=str(path))
        if part == "flow":
            return load_flow(state, args.flow, source=str(path))
        return load_causal_hift(state, args.hift, source=str(path))


def int8_names(module: nn.Module, part: str) -> list[str]:
    """The layers an int8 model of ``part`` runs in int8 (HiFT has none)."""
    if part == "llm":
        return cast(CosyVoice3LM, module).int8_layer_names()
    if part == "flow":
        return flow_int8_layer_names(cast(DiTFlow, module))
    return []


PARTS = ModelParts(
    read_args=read_args,
    build_on_meta=build_on_meta,
    read_part=read_part,
    int8_names=int8_names,
    left_out={"llm": UNUSED_KEYS},
    finish=tie_text_head,
)
# The same directory with the RL-tuned LM in place of llm.pt (its prepared files: llm.rl.*).
RL_PARTS = dataclasses.replace(
    PARTS,
    read_args=read_rl_args,
    read_part=lambda model_dir, args, part: read_part(
        model_dir, args, part, RL_LM_FILE if part == "llm" else None
    ),
    checkpoints={"llm": RL_LM_FILE},
)


@dataclass
class CosyVoice3Models:
    """The three models of one directory, ready for inference."""

    model_dir: Path
    args: CosyVoice3Args
    llm: CosyVoice3LM
    flow: DiTFlow
    hift: CausalHiFT

    @classmethod
    def of(
        cls, model_dir: Path, args: Any, modules: tuple[nn.Module, nn.Module, nn.Module]
    ) -> CosyVoice3Models:
        """From the three models in ``llm, flow, hift`` order."""
        llm, flow, hift = modules
        return cls(
            Path(model_dir),
            cast(CosyVoice3Args, args),
            cast(CosyVoice3LM, llm),
            cast(DiTFlow, flow),
            cast(CausalHiFT, hift),
        )


def load_model_dir(model_dir: Path) -> CosyVoice3Models:
    """The three float32 models straight from the official checkpoints (no prepared file)."""
    args = read_args(model_dir)
    modules = tuple(read_part(model_dir, args, part) for part in PART_NAMES)
    return CosyVoice3Models.of(model_dir, args, (modules[0], modules[1], modules[2]))
