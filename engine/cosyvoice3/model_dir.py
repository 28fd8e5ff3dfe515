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
"""

from __future__ import annotations

from pathlib import Path

from engine.core.hparams import ModelConfigError
from engine.core.types import ModelLoadError
from engine.core.weights import check_model_dir, read_state_dict
from engine.cosyvoice2.lm import BACKBONE_DIR, SpeechLMArgs
from engine.cosyvoice2.model_dir import TOKENIZER_FILES, TOKENIZER_JSON
from engine.cosyvoice3.lm import (
    CONFIG_FILE,
    CosyVoice3LM,
    load_cosyvoice3_lm,
    load_cosyvoice3_lm_args,
)

LM_FILE = "llm.pt"
RL_LM_FILE = "llm.rl.pt"
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
