"""Checkpoint indexes: the same tensors as torch.load, without unpickling, and never stale."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from engine import weights
from engine.checkpoint_index import index_path
from engine.pages import file_location
from engine.weights import read_state_dict

DATA = Path(__file__).parent / "data"


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "flow.pt"
    path.parent.mkdir()
    shutil.copy(DATA / "tiny_model" / "flow.pt", path)
    return path


def _same(got: dict[str, torch.Tensor], expect: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expect)
    for name, tensor in expect.items():
        assert got[name].dtype == tensor.dtype, name
        assert got[name].shape == tensor.shape and got[name].stride() == tensor.stride(), name
        assert torch.equal(got[name], tensor), name


def _no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(path: Path) -> object:
        raise AssertionError(f"{path} was unpickled")

    monkeypatch.setattr(weights, "read_checkpoint", refuse)


def test_indexed_tensors_are_the_unpickled_ones_as_views_of_the_file(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    index_dir = tmp_path / "cache"
    expect = read_state_dict(checkpoint)
    first = read_state_dict(checkpoint, index_dir)  # unpickles, then writes the index
    assert index_path(index_dir, checkpoint).is_file()
    _same(first, expect)
    _no_unpickling(monkeypatch)
    indexed = read_state_dict(checkpoint, index_dir)
    _same(indexed, expect)
    # Views of the file, like torch.load(mmap=True)'s: the engine fences and reads rows by
    # file offset (engine.pages, engine.file_rows).
    weight = next(t for t in indexed.values() if t.numel() > 1000)
    spot = file_location(weight)
    assert spot is not None and spot.inode == checkpoint.stat().st_ino


def test_a_rewritten_checkpoint_is_read_afresh_and_reindexed(
    checkpoint: Path, tmp_path: Path
) -> None:
    index_dir = tmp_path / "cache"
    read_state_dict(checkpoint, index_dir)
    state = {k: v.clone() for k, v in torch.load(checkpoint, weights_only=True).items()}
    name = next(k for k, v in state.items() if v.is_floating_point() and v.numel() > 10)
    state[name] += 1.0  # same size, same layout: only the zip's CRC tells them apart
    torch.save(state, checkpoint)
    got = read_state_dict(checkpoint, index_dir)
    _same(got, state)
    again = read_state_dict(checkpoint, index_dir)  # through the rebuilt index
    _same(again, state)


@pytest.mark.parametrize(
    "damage", ["not-json", "offset-past-the-end", "unknown-dtype", "bad-entry", "other-torch"]
)
def test_a_damaged_index_is_rebuilt(
    checkpoint: Path, tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture
) -> None:
    index_dir = tmp_path / "cache"
    expect = read_state_dict(checkpoint, index_dir)
    path = index_path(index_dir, checkpoint)
    index = json.loads(path.read_text())
    name = next(iter(index["tensors"]))
    if damage == "not-json":
        path.write_text("{not json")
    else:
        if damage == "offset-past-the-end":
            index["tensors"][name][3] = checkpoint.stat().st_size
        elif damage == "unknown-dtype":
            index["tensors"][name][0] = "complex128"
        elif damage == "bad-entry":
            index["tensors"][name] = [1, 2]
        else:
            index["torch"] = "0.0"
        path.write_text(json.dumps(index))
    with caplog.at_level(logging.WARNING):
        got = read_state_dict(checkpoint, index_dir)
    _same(got, expect)
    if damage in ("offset-past-the-end", "unknown-dtype", "bad-entry"):
        assert "not used" in caplog.text
    assert json.loads(path.read_text()) != index or damage == "not-json"
    assert json.loads(path.read_text())["torch"] == torch.__version__


def test_an_unwritable_cache_dir_only_costs_the_index(checkpoint: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    got = read_state_dict(checkpoint, blocker / "cache")
    _same(got, read_state_dict(checkpoint))


def test_a_bad_checkpoint_still_fails_with_its_own_error(checkpoint: Path, tmp_path: Path) -> None:
    index_dir = tmp_path / "cache"
    read_state_dict(checkpoint, index_dir)
    checkpoint.write_bytes(checkpoint.read_bytes()[:1000])  # truncated after indexing
    with pytest.raises(weights.ModelLoadError, match="truncated or corrupt"):
        read_state_dict(checkpoint, index_dir)
