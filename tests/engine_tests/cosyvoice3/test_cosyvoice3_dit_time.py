"""The DiT's time modulations: computed once per time grid once the weights are final (the
engine's load asks for it), the same values as computing them again; the weights that made them
let go between grids, the same speech."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import cast

import pytest
import torch
from conftest import TESTS
from torch import nn

from engine.bench.cosyvoice2 import VOICE, add_bench_voice
from engine.core import prepared
from engine.core.onednn_layers import OneDnnLinear, onednn_linears_faster
from engine.core.prepared import PREPARED_DIR
from engine.core.types import SynthesisOptions
from engine.cosyvoice3.dit import DiT, DiTBlock
from engine.cosyvoice3.engine import CosyVoice3Engine
from engine.cosyvoice3.flow import DiTFlow, frame_layer_groups, modulation_layer_names
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


def _pointers(engine: CosyVoice3Engine, names: list[str]) -> list[int]:
    return [engine.models.flow.get_parameter(name).data_ptr() for name in names]


def _speech(engine: CosyVoice3Engine, steps: int, solver: str) -> torch.Tensor:
    options = SynthesisOptions(
        speaker=VOICE, seed=0, force_tokens=20, n_timesteps=steps, solver=solver, stream=True
    )
    return torch.cat([torch.from_numpy(c.samples) for c in engine.synthesize("Hello.", options)])


def test_released_modulation_weights_give_the_same_speech(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The tiny model's weights are small enough to be read as copies, which stay resident.
    # Mapped, as the full-size model's are, its modulation weights are mapped afresh each time
    # a grid is kept, and a grid not seen yet (other steps, another solver) reads them again:
    # the speech is the same, bit for bit, and the other weights stay where they were.
    model_dir = tmp_path / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, model_dir, ignore=shutil.ignore_patterns(PREPARED_DIR))
    kept = CosyVoice3Engine.load(model_dir)
    monkeypatch.setattr(prepared, "_COPY_BYTES", 0)  # every tensor of two dimensions mapped
    released = CosyVoice3Engine.load(model_dir)
    for engine in (kept, released):
        add_bench_voice(engine, "Hello there.")
    modulations = [f"{name}.weight" for name in modulation_layer_names(released.models.flow)]
    others = ["decoder.estimator.input_embed.proj.weight", "input_embedding.weight"]
    kept_at, others_at = _pointers(kept, modulations), _pointers(released, others)
    for steps, solver, new_grid in ((10, "euler", True), (3, "heun", True), (10, "euler", False)):
        before = _pointers(released, modulations)
        assert torch.equal(_speech(released, steps, solver), _speech(kept, steps, solver))
        moved = [a != b for a, b in zip(_pointers(released, modulations), before, strict=True)]
        assert moved == [new_grid] * len(modulations)
    assert _pointers(kept, modulations) == kept_at  # copies: nothing to release
    assert _pointers(released, others) == others_at


def test_the_per_frame_linears_run_on_onednn_where_it_is_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mapped as the full-size model's weights are: each block's are reordered through a
    # mapping of their own; the modulation Linears stay mapped.
    model_dir = tmp_path / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, model_dir, ignore=shutil.ignore_patterns(PREPARED_DIR))
    monkeypatch.setattr(prepared, "_COPY_BYTES", 0)
    flow = CosyVoice3Engine.load(model_dir).models.flow
    per_frame = [flow.get_submodule(name) for group in frame_layer_groups(flow) for name in group]
    modulations = [flow.get_submodule(name) for name in modulation_layer_names(flow)]
    assert len(per_frame) == 6 * flow.args.estimator.depth
    assert all(isinstance(m, OneDnnLinear) == onednn_linears_faster() for m in per_frame)
    assert all(type(m) is nn.Linear for m in modulations)
