"""An official CosyVoice v1 model directory: config, checkpoints and speaker table, and how
:mod:`engine.core.prepared` builds its models and reads them (:data:`PARTS`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from torch import nn

from engine.core.hift import HiFTGenerator
from engine.core.hparams import ModelConfigError
from engine.core.prepared import ModelParts, PreparedLoad
from engine.core.quantize import flow_int8_layer_names, int8_layer_names
from engine.core.types import ModelLoadError
from engine.core.weight_norm import normalize_hift_state_dict
from engine.core.weights import (
    PARTS as PART_NAMES,
)
from engine.core.weights import (
    assign_state_dict,
    check_model_dir,
    list_keys,
    read_checkpoint,
    read_state_dict,
    without_init,
)
from engine.cosyvoice1.flow import FlowModel
from engine.cosyvoice1.hparams import ModelArgs, load_model_args
from engine.cosyvoice1.llm import TransformerLM

_LOGGER = logging.getLogger(__name__)

CONFIG_FILE = "cosyvoice.yaml"
CHECKPOINT_FILES = tuple(f"{part}.pt" for part in PART_NAMES)
SPEAKER_FILE = "spk2info.pt"
REQUIRED_FILES = (CONFIG_FILE, *CHECKPOINT_FILES, SPEAKER_FILE)
SPEAKER_EMBED_DIM = 192


def missing_model_files(model_dir: Path) -> list[str]:
    """Names of the required files that ``model_dir`` lacks (empty when complete)."""
    return [name for name in REQUIRED_FILES if not (Path(model_dir) / name).is_file()]


def read_model_args(model_dir: Path) -> ModelArgs:
    """Check that ``model_dir`` is a complete model directory and read its config."""
    model_dir = Path(model_dir)
    missing = missing_model_files(model_dir) if model_dir.is_dir() else []
    check_model_dir(model_dir, missing, f" (expected {', '.join(REQUIRED_FILES)})")
    try:
        return load_model_args(model_dir / CONFIG_FILE)
    except ModelConfigError as err:
        raise ModelLoadError(str(err)) from err


def load_speakers(path: Path) -> dict[str, torch.Tensor]:
    """Read ``spk2info.pt`` into {speaker name: (192,) float32 x-vector (un-normalised)}."""
    obj = read_checkpoint(path)
    if not isinstance(obj, Mapping):
        raise ModelLoadError(f"{path}: expected a dict of speakers, got {type(obj).__name__}")
    speakers: dict[str, torch.Tensor] = {}
    bad: list[str] = []
    for name, info in obj.items():
        embedding = info.get("embedding") if isinstance(info, Mapping) else None
        if (
            not isinstance(name, str)
            or not torch.is_tensor(embedding)
            or embedding.numel() != SPEAKER_EMBED_DIM
        ):
            bad.append(str(name))
            continue
        speakers[name] = embedding.detach().reshape(SPEAKER_EMBED_DIM).float().clone()
    if bad:
        raise ModelLoadError(
            f"{path}: speakers without a {SPEAKER_EMBED_DIM}-value 'embedding': {list_keys(bad)}"
        )
    return speakers


def build_on_meta(args: ModelArgs, part: str) -> nn.Module:
    """One of the three models (``llm``, ``flow``, ``hift``), built without memory for weights."""
    builders = {
        "llm": lambda: TransformerLM(args.llm),
        "flow": lambda: FlowModel(args.flow),
        "hift": lambda: HiFTGenerator(args.hift),
    }
    with torch.device("meta"), without_init():
        return builders[part]()


def read_part(model_dir: Path, args: ModelArgs, part: str) -> nn.Module:
    """One model loaded from its official checkpoint (HiFT with its weight norm folded)."""
    path = Path(model_dir) / f"{part}.pt"
    state = read_state_dict(path)
    if part == "hift":
        try:
            state = normalize_hift_state_dict(state)
        except ValueError as err:
            raise ModelLoadError(f"{path}: {err}") from err
    module = build_on_meta(args, part)
    assign_state_dict(module, state, path)
    return module


@dataclass
class LoadedModels:
    """The three models of one directory plus its speaker table, ready for inference."""

    model_dir: Path
    args: ModelArgs
    llm: TransformerLM
    flow: FlowModel
    hift: HiFTGenerator
    speakers: dict[str, torch.Tensor]

    @classmethod
    def of(
        cls,
        model_dir: Path,
        args: ModelArgs,
        modules: tuple[nn.Module, nn.Module, nn.Module],
        speakers: dict[str, torch.Tensor],
    ) -> LoadedModels:
        """From the three models in ``PART_NAMES`` order."""
        llm, flow, hift = modules
        return cls(
            model_dir,
            args,
            cast("TransformerLM", llm),
            cast("FlowModel", flow),
            cast("HiFTGenerator", hift),
            speakers,
        )


def loaded_models(load: PreparedLoad) -> LoadedModels:
    """A v1 directory's models from their prepared files, with its speakers."""
    return LoadedModels.of(load.model_dir, load.args, load.modules(), load.speakers)


def load_model_dir(model_dir: Path) -> LoadedModels:
    """Build the LM, flow and HiFT from ``cosyvoice.yaml`` and the official checkpoints."""
    model_dir = Path(model_dir)
    args = read_model_args(model_dir)
    llm, flow, hift = (read_part(model_dir, args, part) for part in PART_NAMES)
    speakers = load_speakers(model_dir / SPEAKER_FILE)
    _LOGGER.debug("Loaded %s with %d speakers", model_dir, len(speakers))
    return LoadedModels.of(model_dir, args, (llm, flow, hift), speakers)


def _int8_names(module: nn.Module, part: str) -> list[str]:
    if part == "hift":
        return []
    return int8_layer_names(module) if part == "llm" else flow_int8_layer_names(module)


PARTS = ModelParts(
    read_args=read_model_args,
    build_on_meta=build_on_meta,
    read_part=read_part,
    int8_names=_int8_names,
    read_speakers=lambda model_dir: load_speakers(model_dir / SPEAKER_FILE),
)
