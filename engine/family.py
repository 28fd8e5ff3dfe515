"""Model families: which engine runs a model directory, told by the config file it holds.

=================  ===============================================  =========================
config file        models                                           engine
=================  ===============================================  =========================
cosyvoice.yaml     CosyVoice-300M, -300M-SFT, -300M-Instruct (v1)   engine.cosyvoice1.engine
cosyvoice2.yaml    CosyVoice2-0.5B                                   engine.cosyvoice2.engine
cosyvoice3.yaml    Fun-CosyVoice3-0.5B                               engine.cosyvoice3.engine
=================  ===============================================  =========================

A family (:class:`~engine.family_facts.Family`) names its engine class and the
:class:`~engine.core.prepared.ModelParts` that prepare and load its weights; both are imported
only when used. What a caller needs to know before the engine has loaded (its official models
and their files, its sample rate, its prompt voices' cache files, whether and how it takes
instructions) is in :mod:`engine.family_facts`, re-exported here. Another family is one more
entry there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.core.types import ModelLoadError
from engine.family_facts import (  # the facts, for callers that find families here
    DESCRIBED_SPEAKER,
    FAMILIES,
    INSTRUCT2,
    INSTRUCT3,
    PROMPT_CACHE_ENDING,
    Family,
    OfFamily,
    detect_model_kind,
    family_named,
    family_of_model,
    instruct_models,
)

__all__ = [
    "DESCRIBED_SPEAKER",
    "FAMILIES",
    "INSTRUCT2",
    "INSTRUCT3",
    "PROMPT_CACHE_ENDING",
    "Family",
    "OfFamily",
    "detect_model_kind",
    "family_named",
    "family_of_model",
    "instruct_models",
    "load_engine",
    "model_family",
]


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
    expected = " or ".join(f"{family.config_file} ({family.label})" for family in FAMILIES)
    raise ModelLoadError(f"model directory {model_dir} is incomplete: missing {expected}")


def load_engine(model_dir: Path | str, **options: Any) -> Any:
    """The engine of ``model_dir``'s family, loaded (``options``: its ``load`` keywords:
    threads, lm_int8, flow_int8, hift_bf16, hift_int8, cache_dir, ...): an ``engine.api.Engine``."""
    return model_family(model_dir).engine_class().load(model_dir, **options)
