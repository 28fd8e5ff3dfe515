"""Mapping a loaded model's tensors afresh: the same values, and the pages the old mapping made
resident leave this process (what lets CosyVoice3's DiT give back its modulation weights)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engine.core.mapped_weights import MappedWeights, point_at

MIB = 1 << 20


def _read(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """These tensors of ``path`` through one new mapping of it, as the loader maps them."""
    with safe_open(path, framework="pt", backend="mmap") as stored:
        return {name: stored.get_tensor(name) for name in names}


def _resident(path: Path) -> int:
    """Bytes of ``path`` resident in this process's mappings of it (/proc/self/smaps)."""
    total, ours = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            field = line.split()
            if field and "-" in field[0] and not field[0].endswith(":"):  # a mapping's header
                ours = line.rstrip("\n").endswith(str(path))
            elif ours and field[0] == "Rss:":
                total += int(field[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_a_tensor_mapped_afresh_leaves_its_old_pages_behind(tmp_path: Path) -> None:
    # Two 16 MiB weights through one mapping; the first given a mapping of its own before it
    # is read. Both read whole, then the first mapped afresh: only the second stays resident
    # (the mapping the first was read through goes), until the first is read again.
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))
    path = (tmp_path / "model.safetensors").resolve()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    want = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    point_at(model, _read(path, ["0.weight", "1.weight"]))
    mapped = MappedWeights(model, frozenset(want), lambda names: _read(path, names))
    assert mapped.under(["0"]) == ["0.weight"]

    def read_all() -> None:
        with torch.inference_mode():
            model(torch.ones(1, 2048))

    mapped.map_afresh(["0.weight"])  # a mapping of its own, before it is read
    read_all()
    assert _resident(path) >= 32 * MIB
    mapped.map_afresh(["0.weight"])
    assert _resident(path) < 24 * MIB  # the second weight, and at most a folio of the first
    read_all()  # readable all the same
    assert _resident(path) >= 32 * MIB
    assert isinstance(model[0].weight, nn.Parameter) and not model[0].weight.is_inference()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name])
