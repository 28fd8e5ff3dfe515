"""A CosyVoice2 model directory in the official layout: its files, numbers and three models.

    cosyvoice2.yaml            the llm, flow and hift sections (read as data; no tag runs)
    llm.pt, flow.pt, hift.pt   state dicts with the official key names
    CosyVoice-BlankEN/         the Qwen2 backbone's config.json and tokenizer files (its own
                               weights are never read: llm.pt holds them)
    campplus.onnx, speech_tokenizer_v2.onnx   prompt extraction only (voices from a recording)

:data:`PARTS` tells :mod:`engine.core.prepared` how to build the models and read their checkpoints;
the engine runs from the prepared files. :func:`load_model_dir` reads the checkpoints straight
(the reference a prepared model is compared with).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from torch import nn

from engine.core.hparams import HiFTArgs, ModelConfigError, read_model_yaml
from engine.core.prepared import ModelParts
from engine.core.types import ModelLoadError
from engine.core.weights import PARTS as PART_NAMES
from engine.core.weights import check_model_dir, read_state_dict, without_init
from engine.cosyvoice2.flow import build_flow, load_flow
from engine.cosyvoice2.flow import int8_layer_names as flow_int8_layer_names
from engine.cosyvoice2.flow_args import CausalFlowArgs, flow_args_from_doc, hift_args_from_doc
from engine.cosyvoice2.hift import build_hift, load_hift
from engine.cosyvoice2.lm import (
    BACKBONE_DIR,
    CONFIG_FILE,
    UNUSED_KEYS,
    CosyVoice2LM,
    SpeechLMArgs,
    build_speech_lm,
    load_speech_lm,
    speech_lm_args,
)
from engine.cosyvoice2.qwen2 import Qwen2Config

if TYPE_CHECKING:
    from engine.core.hift import HiFTGenerator
    from engine.cosyvoice2.flow import CausalFlow

CHECKPOINT_FILES = tuple(f"{part}.pt" for part in PART_NAMES)
BACKBONE_CONFIG = f"{BACKBONE_DIR}/config.json"
REQUIRED_FILES = (CONFIG_FILE, *CHECKPOINT_FILES, BACKBONE_CONFIG)
# The tokenizer: a tokenizer.json, or the vocab.json + merges.txt pair the release ships.
TOKENIZER_FILES = (f"{BACKBONE_DIR}/vocab.json", f"{BACKBONE_DIR}/merges.txt")
TOKENIZER_JSON = f"{BACKBONE_DIR}/tokenizer.json"


@dataclass(frozen=True)
class CosyVoice2Args:
    """The hyperparameters of the three models."""

    lm: SpeechLMArgs
    flow: CausalFlowArgs
    hift: HiFTArgs

    @property
    def sample_rate(self) -> int:
        return self.hift.sampling_rate

    @property
    def token_rate(self) -> int:
        """Speech tokens per second."""
        return self.flow.input_frame_rate


def missing_model_files(model_dir: Path) -> list[str]:
    """The files the engine needs that ``model_dir`` lacks (empty when complete)."""
    model_dir = Path(model_dir)
    missing = [name for name in REQUIRED_FILES if not (model_dir / name).is_file()]
    if not (model_dir / TOKENIZER_JSON).is_file():
        missing += [name for name in TOKENIZER_FILES if not (model_dir / name).is_file()]
    return missing


def read_args(model_dir: Path) -> CosyVoice2Args:
    """Check that ``model_dir`` is a complete CosyVoice2 directory and read its numbers."""
    return read_checked_args(model_dir, CONFIG_FILE, missing_model_files, args_from)


class _FamilyArgs(Protocol):
    @property
    def lm(self) -> Any: ...
    @property
    def flow(self) -> Any: ...


ArgsT = TypeVar("ArgsT", bound=_FamilyArgs)


def read_checked_args(
    model_dir: Path,
    config_file: str,
    missing_files: Callable[[Path], list[str]],
    parse: Callable[[dict[str, Any], Qwen2Config], ArgsT],
) -> ArgsT:
    """The numbers of a Qwen2-family model directory (CosyVoice2 and the families built on it):
    the directory checked complete, its yaml parsed with the backbone's config by ``parse``, and
    the flow's token vocabulary checked against the LM's."""
    model_dir = Path(model_dir)
    check_model_dir(model_dir, missing_files(model_dir) if model_dir.is_dir() else [])
    try:
        doc = read_model_yaml(model_dir / config_file)
        args = parse(doc, Qwen2Config.read(model_dir / BACKBONE_DIR))
    except ModelConfigError as err:
        raise ModelLoadError(f"{model_dir}: {err}") from err
    if args.flow.vocab_size != args.lm.speech_token_size:
        raise ModelLoadError(
            f"{model_dir / config_file}: the flow reads {args.flow.vocab_size} speech tokens, "
            f"the LM writes {args.lm.speech_token_size}"
        )
    return args


def args_from(
    doc: dict[str, Any], backbone: Qwen2Config, source: str = CONFIG_FILE
) -> CosyVoice2Args:
    """The numbers of a parsed ``cosyvoice2.yaml`` and the backbone's config."""
    if "llm" not in doc:
        raise ModelConfigError(f"{source}: missing top-level section 'llm'")
    return CosyVoice2Args(
        lm=speech_lm_args(doc["llm"], backbone, source),
        flow=flow_args_from_doc(doc, source),
        hift=hift_args_from_doc(doc, source),
    )


def build_on_meta(args: CosyVoice2Args, part: str) -> nn.Module:
    """One of the three models, built without memory for its weights."""
    builders = {
        "llm": lambda: build_speech_lm(args.lm),
        "flow": lambda: build_flow(args.flow),
        "hift": lambda: build_hift(args.hift),
    }
    with without_init():  # every value is assigned from a file
        return builders[part]()


def read_part(model_dir: Path, args: CosyVoice2Args, part: str) -> nn.Module:
    """One model loaded from its official checkpoint, float32 (HiFT's weight norm folded)."""
    path = Path(model_dir) / f"{part}.pt"
    state = read_state_dict(path)
    source = str(path)
    with without_init():
        if part == "llm":
            return load_speech_lm(state, args.lm, source=source)
        if part == "flow":
            return load_flow(state, args.flow, source=source)
        return load_hift(state, args.hift, source=source)


def int8_names(module: nn.Module, part: str) -> list[str]:
    """The layers an int8 model of ``part`` runs in int8 (HiFT has none)."""
    if part == "llm":
        return cast(CosyVoice2LM, module).int8_layer_names()
    if part == "flow":
        return flow_int8_layer_names(cast("CausalFlow", module))
    return []


def tie_text_head(module: nn.Module, part: str) -> None:
    """A loaded part made whole (CosyVoice2 and the families built on its LM): the LM's text
    head tied to its embedding again."""
    if part == "llm":  # the head is not in the prepared file
        cast(CosyVoice2LM, module).llm.model.tie_weights()


PARTS = ModelParts(
    read_args=read_args,
    build_on_meta=build_on_meta,
    read_part=read_part,
    int8_names=int8_names,
    # The unused text head is tied to the embedding: one copy in the file, not two.
    left_out={"llm": UNUSED_KEYS},
    finish=tie_text_head,
)


@dataclass
class CosyVoice2Models:
    """The three models of one directory, ready for inference."""

    model_dir: Path
    args: CosyVoice2Args
    llm: CosyVoice2LM
    flow: CausalFlow
    hift: HiFTGenerator

    @classmethod
    def of(
        cls, model_dir: Path, args: Any, modules: tuple[nn.Module, nn.Module, nn.Module]
    ) -> CosyVoice2Models:
        """From the three models in ``llm, flow, hift`` order."""
        llm, flow, hift = modules
        return cls(
            Path(model_dir),
            cast(CosyVoice2Args, args),
            cast(CosyVoice2LM, llm),
            cast("CausalFlow", flow),
            cast("HiFTGenerator", hift),
        )


def load_model_dir(model_dir: Path) -> CosyVoice2Models:
    """The three float32 models straight from the official checkpoints (no prepared file)."""
    args = read_args(model_dir)
    modules = tuple(read_part(model_dir, args, part) for part in PART_NAMES)
    return CosyVoice2Models.of(model_dir, args, (modules[0], modules[1], modules[2]))
