"""The synthetic CosyVoice2 and Fun-CosyVoice3 ``hift.pt`` store weight norm in the layout of the
released files (``parametrizations.weight.original0/1``); the engine loads that directory and
makes the same audio as from the same g and v saved under the ``weight_g``/``weight_v`` names."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import DATA

from engine.bench.synthetic import (
    COSYVOICE2_FILES,
    COSYVOICE3_FILES,
    QwenFamilyFiles,
    ensure_synthetic_family,
)
from engine.core.weight_norm import LAYOUTS, split_weight_norm_key
from engine.cosyvoice2.model_dir import load_model_dir as load_cosyvoice2
from engine.cosyvoice3.model_dir import load_model_dir as load_cosyvoice3

FAMILIES: dict[str, tuple[QwenFamilyFiles, Callable[[Path], Any]]] = {
    "cosyvoice2": (COSYVOICE2_FILES, load_cosyvoice2),
    "cosyvoice3": (COSYVOICE3_FILES, load_cosyvoice3),
}


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """No oversubscription of the shared cores."""


def _renamed(state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """The same tensors with every weight-norm key in ``layout``'s names."""
    out = {}
    for key, value in state.items():
        split = split_weight_norm_key(key)
        out[key if split is None else split[0] + LAYOUTS[layout][split[2]]] = value
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_the_released_layout_sounds_like_the_legacy_one(tmp_path: Path, name: str) -> None:
    family, load_model_dir = FAMILIES[name]
    tiny = DATA / family.data_dir / "tiny"
    backbone = json.loads((tiny / "CosyVoice-BlankEN" / "config.json").read_text())
    model_dir = ensure_synthetic_family(
        family, tmp_path / "cache", tiny / family.config_file, backbone
    )
    state = torch.load(model_dir / "hift.pt", weights_only=True)
    assert any(k.endswith(".parametrizations.weight.original0") for k in state)
    assert list(state) == list(_renamed(state, "parametrizations"))  # no key in another layout
    legacy = _renamed(state, "legacy")
    assert not any("parametrizations" in k for k in legacy)
    legacy_dir = tmp_path / "legacy" / model_dir.name
    shutil.copytree(model_dir, legacy_dir)
    torch.save(legacy, legacy_dir / "hift.pt")

    vocoders = [load_model_dir(d).hift for d in (model_dir, legacy_dir)]
    weights = [v.state_dict() for v in vocoders]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    mel = torch.randn(1, 80, 40, generator=torch.Generator().manual_seed(0))
    waves = [v.inference(mel, generator=torch.Generator().manual_seed(1))[0] for v in vocoders]
    assert waves[0].abs().max() > 0
    assert torch.equal(waves[0], waves[1])
