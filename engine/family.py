"""Model families: which engine runs a model directory, told by the config file it holds.

=================  ===============================================  =========================
config file        models                                           engine
=================  ===============================================  =========================
cosyvoice.yaml     CosyVoice-300M, -300M-SFT, -300M-Instruct (v1)   engine.cosyvoice1.engine
cosyvoice2.yaml    CosyVoice2-0.5B                                   engine.cosyvoice2.engine
=================  ===============================================  =========================

A family names its engine class and the :class:`~engine.core.prepared.ModelParts` that prepare and
load its weights; both are imported only when used. Another family (e.g. Fun-CosyVoice3's
``cosyvoice3.yaml``) is one more entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.core.types import ModelLoadError

if TYPE_CHECKING:
    from engine.core.prepared import ModelParts

# Config files of families the engine knows but cannot run (a clearer error than "no config").
_UNSUPPORTED = {"cosyvoice3.yaml": "Fun-CosyVoice3"}


@dataclass(frozen=True)
class Family:
    """One model family: its config file, engine class and model parts ("module:name")."""

    name: str
    label: str  # for people
    config_file: str
    engine: str
    parts: str

    def engine_class(self) -> Any:
        return _resolve(self.engine)

    def model_parts(self) -> ModelParts:
        parts: ModelParts = _resolve(self.parts)
        return parts


FAMILIES = (
    Family(
        "cosyvoice",
        "CosyVoice v1",
        "cosyvoice.yaml",
        "engine.cosyvoice1.engine:CosyVoiceEngine",
        "engine.cosyvoice1.model_dir:PARTS",
    ),
    Family(
        "cosyvoice2",
        "CosyVoice2",
        "cosyvoice2.yaml",
        "engine.cosyvoice2.engine:CosyVoice2Engine",
        "engine.cosyvoice2.model_dir:PARTS",
    ),
)


def _resolve(target: str) -> Any:
    module, _, name = target.partition(":")
    return getattr(import_module(module), name)


def model_family(model_dir: Path | str) -> Family:
    """The family of an official model directory (ModelLoadError if it is none we know)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    found = [family for family in FAMILIES if (model_dir / family.config_file).is_file()]
    if len(found) == 1:
        return found[0]
    if len(found) > 1:
        names = ", ".join(family.config_file for family in found)
        raise ModelLoadError(f"model directory {model_dir} holds several model configs: {names}")
    for config, name in _UNSUPPORTED.items():
        if (model_dir / config).is_file():
            raise ModelLoadError(f"{model_dir}: {name} models ({config}) are not supported yet")
    expected = " or ".join(f"{family.config_file} ({family.label})" for family in FAMILIES)
    raise ModelLoadError(f"model directory {model_dir} is incomplete: missing {expected}")


def load_engine(model_dir: Path | str, **options: Any) -> Any:
    """The engine of ``model_dir``'s family, loaded (``options``: its ``load`` keywords:
    threads, lm_int8, flow_int8, hift_bf16, cache_dir, ...)."""
    return model_family(model_dir).engine_class().load(model_dir, **options)
