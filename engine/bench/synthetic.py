"""Full-size models with random weights, saved once in the official file layout: CosyVoice-300M
(``--synthetic 300m``), CosyVoice2-0.5B (``--synthetic cosyvoice2``) and Fun-CosyVoice3-0.5B
(``--synthetic cosyvoice3``).

Speed does not depend on weight values, so random weights give honest timings — but only if the
engine reads them from real files exactly as it reads the released checkpoints: the load time, the
memory mapping and the HiFT weight-norm folding are then all measured too. The files are written
once under a cache directory and reused:

    <cache-dir>/CosyVoice-300M-SFT/{cosyvoice.yaml, llm.pt, flow.pt, hift.pt, spk2info.pt}

The model directory is named like the official SFT release because the engine (and the server)
infer the model kind from the directory name. The state-dict keys and shapes come from the
engine's own modules built on the ``meta`` device from the official config, i.e. exactly what the
loader checks the real checkpoints against; ``hift.pt`` stores its weight norm as
``weight_g``/``weight_v``, the names ``torch.nn.utils.weight_norm`` gives, which the code of
the release called. The LM's EOS logit is biased far down so that, as the benchmark assumes,
the random model never ends an utterance before the forced number of tokens.

CosyVoice2 (:func:`ensure_synthetic_cosyvoice2`; Fun-CosyVoice3 likewise)::

    <cache-dir>/CosyVoice2-0.5B/{cosyvoice2.yaml, llm.pt, flow.pt, hift.pt,
                                 CosyVoice-BlankEN/{config.json, vocab.json, merges.txt, ...}}

Keys and shapes are the released files' (``tests/data/cosyvoice2/manifest_full.json``, made from
the official code). ``hift.pt`` stores its weight norm as ``parametrizations.weight.original0``
(g) / ``original1`` (v), as the released CosyVoice2 and Fun-CosyVoice3 files do: the official
code wraps HiFT's convs with ``torch.nn.utils.parametrizations.weight_norm`` wherever torch has
it (≥ 2.1), and ``state_dict()`` writes those names. The yaml is the official one and
``config.json`` the released Qwen2 backbone's. Its three stop classes are biased down like v1's
EOS. The tokenizer is the tiny test model's (1,000 BPE ids and the special tokens): Qwen2's
151,643-id vocabulary is not in the repository. Token ids fit the full embedding either way;
the difference is how many ids a text makes (more, as the small vocabulary splits Chinese into
bytes), which lengthens the LM's prefill a little, not its decode steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.core.weight_norm import (
    LAYOUTS,
    LEGACY_SUFFIXES,
    PARAMETRIZATIONS_SUFFIXES,
    split_weight_norm_key,
)

if TYPE_CHECKING:
    from engine.core.prepared import ModelParts

_LOGGER = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = Path.home() / ".cache" / "cosyvoice-engine" / "synthetic"
MODEL_DIR_NAME = "CosyVoice-300M-SFT"
MARKER_FILE = "synthetic.json"
# Bump when the generated files change, so stale caches are rebuilt.
FORMAT_VERSION = 2
SEED = 1986
SFT_SPEAKERS = ("中文女", "中文男", "日语男", "粤语女", "英文女", "英文男", "韩语女")
SPEAKER_EMBED_DIM = 192
EOS_BIAS = -100.0  # logit offset of the LM's EOS class: random weights must never stop early

# Convs that the official HiFT wraps in weight norm (tests/data/manifest_300m.json lists the 57).
_WEIGHT_NORMED = re.compile(
    r"^(conv_pre|conv_post|ups\.\d+|f0_predictor\.condnet\.\d+"
    r"|(source_)?resblocks\.\d+\.convs[12]\.\d+)\.weight$"
)


def official_config_path() -> Path:
    """The official full-size ``cosyvoice.yaml`` kept with the test fixtures of this repo."""
    path = Path(__file__).resolve().parents[2] / "tests" / "data" / "cosyvoice_300m.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: --synthetic needs a source checkout of wyoming-cosyvoice "
            "(or benchmark a real model with --model-dir)"
        )
    return path


def state_dict_specs(config: Path) -> dict[str, dict[str, torch.Size]]:
    """{file: {key: shape}} of the three checkpoints, as the engine expects them (HiFT folded)."""
    from engine.core.hift import HiFTGenerator
    from engine.cosyvoice1.flow import FlowModel
    from engine.cosyvoice1.hparams import load_model_args
    from engine.cosyvoice1.llm import TransformerLM

    args = load_model_args(config)
    specs: dict[str, dict[str, torch.Size]] = {}
    # meta: shapes only, no memory — the full LM alone would be 1.24 GB.
    with torch.device("meta"):
        for name, module in (
            ("llm.pt", TransformerLM(args.llm)),
            ("flow.pt", FlowModel(args.flow)),
            ("hift.pt", HiFTGenerator(args.hift)),
        ):
            specs[name] = {k: v.shape for k, v in module.state_dict(keep_vars=True).items()}
    return specs


def weight_norm_hift_specs(
    specs: dict[str, torch.Size], suffixes: dict[str, str]
) -> dict[str, torch.Size]:
    """Expand each weight-normed ``X.weight`` into its g (dim-0 norms) and v entries, named
    ``X`` + ``suffixes["g"]`` / ``suffixes["v"]`` (``engine.core.weight_norm``'s layouts)."""
    out: dict[str, torch.Size] = {}
    for key, shape in specs.items():
        if _WEIGHT_NORMED.match(key):
            stem = key[: -len(".weight")]
            out[stem + suffixes["g"]] = torch.Size([shape[0], *([1] * (len(shape) - 1))])
            out[stem + suffixes["v"]] = shape
        else:
            out[key] = shape
    return out


def random_tensor(
    key: str, shape: torch.Size, generator: torch.Generator, stop_classes: int = 1
) -> torch.Tensor:
    """A plausible random value: PyTorch-default-like uniform weights, unit norms, zero biases.

    The scale matters even though values do not: 1/sqrt(fan_in) keeps activations O(1) through
    14 layers, so no inf/NaN (which would break sampling) and no denormals (which are slow).
    """
    if key == "llm_decoder.bias":
        # Random logits would let RAS sampling pick EOS (the last class) about once per 160
        # steps after min_len, so requests would end early at random lengths. A very negative
        # EOS bias keeps it out of the top-k: the LM runs exactly to the forced token count.
        bias = torch.zeros(shape)
        if stop_classes:
            bias[-stop_classes:] = EOS_BIAS
        return bias
    if key.endswith("bias") or len(shape) == 0:
        return torch.zeros(shape)
    if len(shape) == 1:
        return torch.ones(shape)  # LayerNorm/GroupNorm scales, Snake alphas
    bound = 1.0 / math.sqrt(math.prod(shape[1:]))
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def _random_state(
    specs: dict[str, torch.Size],
    generator: torch.Generator,
    stop_classes: int = 1,
) -> Iterator[tuple[str, torch.Tensor]]:
    values: dict[str, torch.Tensor] = {}
    for key, shape in specs.items():
        split = split_weight_norm_key(key)
        if split is not None and split[2] == "g":
            continue  # written together with its v below
        value = random_tensor(
            key if split is None else f"{split[0]}.weight", shape, generator, stop_classes
        )
        if split is not None:
            # g = ‖v‖ per output channel makes the folded weight g·v/‖v‖ equal to v itself.
            g_key = split[0] + LAYOUTS[split[1]]["g"]
            values[g_key] = value.flatten(1).norm(dim=1).view(specs[g_key])
        values[key] = value
    for key in specs:  # official key order
        yield key, values.pop(key)


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)  # never leave a truncated file under the final name


def _marker(config_text: str) -> dict[str, object]:
    return {
        "format_version": FORMAT_VERSION,
        "seed": SEED,
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "speakers": list(SFT_SPEAKERS),
    }


def ensure_synthetic_model(cache_dir: Path = DEFAULT_CACHE_DIR, config: Path | None = None) -> Path:
    """Return the synthetic model directory, generating it first if it is missing or stale.

    ``config`` defaults to the official full-size ``cosyvoice.yaml`` (tests pass a tiny one).
    """
    config = config or official_config_path()
    config_text = config.read_text(encoding="utf-8")
    model_dir = Path(cache_dir).expanduser() / MODEL_DIR_NAME
    marker = model_dir / MARKER_FILE
    try:
        if json.loads(marker.read_text(encoding="utf-8")) == _marker(config_text):
            _LOGGER.info("Using the synthetic model in %s", model_dir)
            return model_dir
    except (OSError, ValueError):
        pass
    start = time.perf_counter()
    _LOGGER.info("Generating a full-size synthetic CosyVoice-300M in %s (once, ~1.7 GB)", model_dir)
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    shutil.copyfile(config, model_dir / "cosyvoice.yaml")
    generator = torch.Generator().manual_seed(SEED)
    specs = state_dict_specs(config)
    specs["hift.pt"] = weight_norm_hift_specs(specs["hift.pt"], LEGACY_SUFFIXES)
    for name, file_specs in specs.items():
        # One checkpoint in memory at a time (the LM is 1.24 GB); freed before the next one.
        state = dict(_random_state(file_specs, generator))
        _save(model_dir / name, state)
        del state
        _LOGGER.info("  wrote %s (%.0f MB)", name, (model_dir / name).stat().st_size / 1e6)
    speakers = {
        name: {"embedding": torch.randn(1, SPEAKER_EMBED_DIM, generator=generator)}
        for name in SFT_SPEAKERS
    }
    _save(model_dir / "spk2info.pt", speakers)
    # Written last: its presence means every file above is complete.
    marker.write_text(json.dumps(_marker(config_text)), encoding="utf-8")
    _LOGGER.info("Synthetic model ready after %.1f s", time.perf_counter() - start)
    return model_dir


# --- CosyVoice2-0.5B ---------------------------------------------------------------------------

COSYVOICE2_DIR_NAME = "CosyVoice2-0.5B"
# 2: hift.pt in the parametrizations weight-norm layout of the released files.
COSYVOICE2_FORMAT_VERSION = 2
COSYVOICE3_FORMAT_VERSION = 2
COSYVOICE2_STOP_CLASSES = 3  # EOS and the two other stop tokens after the 6561 speech tokens
BACKBONE_DIR = "CosyVoice-BlankEN"
TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json")
_TIED_HEAD = "llm.model.lm_head.weight"  # the same tensor as the token embedding
_TIED_TO = "llm.model.model.embed_tokens.weight"


@dataclass(frozen=True)
class QwenFamilyFiles:
    """What a synthetic directory of a Qwen2-LM family (CosyVoice2, Fun-CosyVoice3) is made of."""

    label: str
    dir_name: str  # named like the official release
    config_file: str  # the yaml's name in the directory
    data_dir: str  # tests/data/<this>: the official yaml, the manifest, the tiny tokenizer
    full_config: str  # the official full-size yaml there
    format_version: int
    stop_classes: int  # rows of the LM's decoder bias pushed down (0: it has no bias)
    args_from: Callable[[dict[str, Any], Any, str], Any]  # (yaml doc, Qwen2Config, source)
    parts: Callable[[], ModelParts]


def _cosyvoice2_args(doc: dict[str, Any], backbone: Any, source: str) -> Any:
    from engine.cosyvoice2.model_dir import args_from

    return args_from(doc, backbone, source)


def _cosyvoice2_parts() -> ModelParts:
    from engine.cosyvoice2.model_dir import PARTS

    return PARTS


def _cosyvoice3_args(doc: dict[str, Any], backbone: Any, source: str) -> Any:
    from engine.cosyvoice3.model_dir import args_from

    return args_from(doc, backbone, source)


def _cosyvoice3_parts() -> ModelParts:
    from engine.cosyvoice3.model_dir import PARTS

    return PARTS


COSYVOICE2_FILES = QwenFamilyFiles(
    "CosyVoice2", COSYVOICE2_DIR_NAME, "cosyvoice2.yaml", "cosyvoice2", "cosyvoice2_0.5b.yaml",
    COSYVOICE2_FORMAT_VERSION, COSYVOICE2_STOP_CLASSES, _cosyvoice2_args, _cosyvoice2_parts,
)  # fmt: skip
# No decoder bias: a forced count masks every stop token instead (engine.core.lm_step).
COSYVOICE3_FILES = QwenFamilyFiles(
    "Fun-CosyVoice3", "Fun-CosyVoice3-0.5B", "cosyvoice3.yaml", "cosyvoice3",
    "cosyvoice3_0.5b.yaml", COSYVOICE3_FORMAT_VERSION, 0, _cosyvoice3_args, _cosyvoice3_parts,
)  # fmt: skip


def family_data_dir(family: QwenFamilyFiles = COSYVOICE2_FILES) -> Path:
    """``tests/data/<family>`` of this repository: the official yaml, the released backbone's
    config (in the manifest) and the tiny tokenizer."""
    path = Path(__file__).resolve().parents[2] / "tests" / "data" / family.data_dir
    if not (path / "manifest_full.json").is_file():
        raise FileNotFoundError(
            f"{path}/manifest_full.json not found: --synthetic needs a source checkout of "
            "wyoming-cosyvoice (or benchmark a real model with --model-dir)"
        )
    return path


def cosyvoice2_data_dir() -> Path:
    """``tests/data/cosyvoice2`` of this repository."""
    return family_data_dir(COSYVOICE2_FILES)


def family_specs(
    family: QwenFamilyFiles, config: Path, backbone: dict[str, Any]
) -> dict[str, dict[str, torch.Size]]:
    """{file: {key: shape}} of the family's three checkpoints, as the engine expects them
    (both keys of the tied text head; HiFT in the released files' parametrizations layout)."""
    from engine.core.hparams import read_model_yaml
    from engine.cosyvoice2.qwen2 import Qwen2Config

    args = family.args_from(read_model_yaml(config), Qwen2Config.from_dict(backbone), config.name)
    parts = family.parts()
    specs = {}
    for part in ("llm", "flow", "hift"):
        module = parts.build_on_meta(args, part)
        specs[f"{part}.pt"] = {k: v.shape for k, v in module.state_dict(keep_vars=True).items()}
    specs["hift.pt"] = weight_norm_hift_specs(specs["hift.pt"], PARAMETRIZATIONS_SUFFIXES)
    return specs


def cosyvoice2_specs(config: Path, backbone: dict[str, Any]) -> dict[str, dict[str, torch.Size]]:
    """:func:`family_specs` of CosyVoice2."""
    return family_specs(COSYVOICE2_FILES, config, backbone)


def _family_marker(
    family: QwenFamilyFiles, config_text: str, backbone: dict[str, Any]
) -> dict[str, object]:
    return {
        "format_version": family.format_version,
        "seed": SEED,
        "config_sha256": hashlib.sha256(config_text.encode()).hexdigest(),
        "backbone": backbone,
    }


def _write_backbone_folder(folder: Path, backbone: dict[str, Any], tokenizer: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(backbone, indent=2), encoding="utf-8")
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer / name, folder / name)


def ensure_synthetic_family(
    family: QwenFamilyFiles,
    cache_dir: Path = DEFAULT_CACHE_DIR,
    config: Path | None = None,
    backbone: dict[str, Any] | None = None,
) -> Path:
    """The family's synthetic directory, generated first if it is missing or stale.

    ``config`` / ``backbone`` default to the official full-size yaml and the released Qwen2
    ``config.json`` (tests pass the tiny model's).
    """
    data = family_data_dir(family)
    config = config or data / family.full_config
    if backbone is None:
        manifest = json.loads((data / "manifest_full.json").read_text(encoding="utf-8"))
        backbone = {**manifest["qwen2_config"], "torch_dtype": "float32"}
    config_text = config.read_text(encoding="utf-8")
    model_dir = Path(cache_dir).expanduser() / family.dir_name
    marker = model_dir / MARKER_FILE
    expected = _family_marker(family, config_text, backbone)
    try:
        if json.loads(marker.read_text(encoding="utf-8")) == expected:
            _LOGGER.info("Using the synthetic model in %s", model_dir)
            return model_dir
    except (OSError, ValueError):
        pass
    start = time.perf_counter()
    _LOGGER.info("Generating a synthetic %s model in %s (once)", family.label, model_dir)
    _LOGGER.info(
        "  its tokenizer is the tiny test model's (1,000 BPE ids + special tokens), not Qwen2's"
    )
    if model_dir.exists():
        shutil.rmtree(model_dir)
    model_dir.mkdir(parents=True)
    shutil.copyfile(config, model_dir / family.config_file)
    _write_backbone_folder(model_dir / BACKBONE_DIR, backbone, data / "tiny" / BACKBONE_DIR)
    generator = torch.Generator().manual_seed(SEED)
    for name, file_specs in family_specs(family, config, backbone).items():
        tied = file_specs.pop(_TIED_HEAD, None)
        # One checkpoint in memory at a time (the LM is 2 GB); freed before the next one.
        state = dict(_random_state(file_specs, generator, family.stop_classes))
        if tied is not None:  # one storage under both keys, as in the released file
            state[_TIED_HEAD] = state[_TIED_TO]
        _save(model_dir / name, state)
        del state
        _LOGGER.info("  wrote %s (%.0f MB)", name, (model_dir / name).stat().st_size / 1e6)
    # Written last: its presence means every file above is complete.
    marker.write_text(json.dumps(expected), encoding="utf-8")
    _LOGGER.info("Synthetic model ready after %.1f s", time.perf_counter() - start)
    return model_dir


def ensure_synthetic_cosyvoice2(
    cache_dir: Path = DEFAULT_CACHE_DIR,
    config: Path | None = None,
    backbone: dict[str, Any] | None = None,
) -> Path:
    """The synthetic CosyVoice2 directory (:func:`ensure_synthetic_family`)."""
    return ensure_synthetic_family(COSYVOICE2_FILES, cache_dir, config, backbone)


def ensure_synthetic_cosyvoice3(
    cache_dir: Path = DEFAULT_CACHE_DIR,
    config: Path | None = None,
    backbone: dict[str, Any] | None = None,
) -> Path:
    """The synthetic Fun-CosyVoice3 directory (:func:`ensure_synthetic_family`)."""
    return ensure_synthetic_family(COSYVOICE3_FILES, cache_dir, config, backbone)
