"""The DiT's time modulations: computed once per time grid once the weights are final (the
engine's load asks for it), the same values as computing them again."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from conftest import TESTS
from torch import nn

from engine.cosyvoice3.dit import DiT, DiTBlock
from engine.cosyvoice3.engine import CosyVoice3Engine
from engine.cosyvoice3.flow import DiTFlow
from engine.cosyvoice3.model_dir import read_args, read_part

TINY = TESTS / "data" / "cosyvoice3" / "tiny"


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """No oversubscription of the shared cores."""


def _dit() -> DiT:
    flow = cast(DiTFlow, read_part(TINY, read_args(TINY), "flow"))
    return cast(DiT, flow.decoder.estimator)


def _counted(dit: DiT) -> list[int]:
    """How many times the first block's modulation Linear has run (a one-item list)."""
    calls = [0]

    def count(module: nn.Module, args: object, out: object) -> None:
        calls[0] += 1

    first_block = cast(DiTBlock, dit.transformer_blocks[0])
    first_block.attn_norm.linear.register_forward_hook(count)
    return calls


def _grid(steps: int) -> torch.Tensor:
    return 1 - torch.cos(torch.linspace(0, 1, steps + 1)[:-1] * 0.5 * torch.pi)


def test_a_dit_without_keeping_computes_every_call() -> None:
    dit = _dit()
    calls = _counted(dit)
    with torch.inference_mode():
        dit.time_biases(_grid(10))
        dit.time_biases(_grid(10))
    assert calls[0] == 2


def test_a_kept_grid_is_computed_once_and_equals_a_fresh_computation() -> None:
    dit, fresh = _dit(), _dit()
    calls = _counted(dit)
    dit.keep_time_biases()
    with torch.inference_mode():
        first = dit.time_biases(_grid(10))
        again = dit.time_biases(_grid(10))
        other = dit.time_biases(_grid(4))
        want = fresh.time_biases(_grid(10))
    assert calls[0] == 2  # the 10-step grid once, the 4-step grid once
    assert all(a is b for a, b in zip(first, again, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(first, want, strict=True))
    assert other[0].shape[0] == 4


def test_the_loaded_engine_keeps_its_grids(tmp_path: Path) -> None:
    engine = CosyVoice3Engine.load(TINY, cache_dir=tmp_path)
    dit = cast(DiT, engine.models.flow.decoder.estimator)
    calls = _counted(dit)
    with torch.inference_mode():
        dit.time_biases(_grid(10))
        dit.time_biases(_grid(10))
    assert calls[0] == 1
