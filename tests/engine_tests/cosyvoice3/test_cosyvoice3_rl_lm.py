"""CosyVoice3's RL-tuned LM (``llm.rl.pt``): loaded in place of ``llm.pt`` when asked, prepared
into files of its own, and a clear error when the directory lacks it.

The tiny stand-in of the RL LM is the tiny ``llm.pt`` with one layer's weights doubled, so which
checkpoint a load read shows in that layer.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import DATA

from engine.core.types import ModelLoadError
from engine.cosyvoice3.engine import CosyVoice3Engine

TINY = DATA / "cosyvoice3" / "tiny"
CHANGED = "layers.0.mlp.up_proj.weight"


def _model_dir(root: Path, *, with_rl: bool) -> Path:
    model = root / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, model, ignore=shutil.ignore_patterns("prepared"))
    if with_rl:
        state = torch.load(model / "llm.pt", weights_only=True)
        (key,) = [k for k in state if k.endswith(CHANGED)]
        state[key] = state[key] * 2
        torch.save(state, model / "llm.rl.pt")
    return model


def _changed_weight(engine: CosyVoice3Engine) -> torch.Tensor:
    (weight,) = [w for k, w in engine.models.llm.state_dict().items() if k.endswith(CHANGED)]
    return weight


def test_the_rl_lm_loads_in_place_of_the_lm(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, with_rl=True)
    plain = CosyVoice3Engine.load(model, threads=1)
    rl = CosyVoice3Engine.load(model, threads=1, rl_lm=True)
    assert (plain.lm_file, rl.lm_file) == ("llm.pt", "llm.rl.pt")
    assert torch.equal(_changed_weight(rl), 2 * _changed_weight(plain))
    # Its prepared file is its own: the plain LM's is neither reused nor overwritten.
    assert rl.prepared_at_load == ("llm.fp32",)
    prepared = {p.name for p in (model / "prepared").iterdir()}
    assert {"llm.fp32.safetensors", "llm.rl.fp32.safetensors"} <= prepared
    again = CosyVoice3Engine.load(model, threads=1)
    assert again.prepared_at_load == () and torch.equal(
        _changed_weight(again), _changed_weight(plain)
    )


def test_a_directory_without_the_rl_lm_is_refused_naming_it(tmp_path: Path) -> None:
    model = _model_dir(tmp_path, with_rl=False)
    with pytest.raises(ModelLoadError, match=r"missing llm\.rl\.pt"):
        CosyVoice3Engine.load(model, threads=1, rl_lm=True)


def test_the_family_facts_name_the_file_the_engine_reads() -> None:
    from engine.cosyvoice3.model_dir import RL_LM_FILE
    from engine.family import family_named

    assert family_named("cosyvoice3").rl_lm_file == RL_LM_FILE
    assert RL_LM_FILE not in family_named("cosyvoice3").model_files  # downloaded when chosen
