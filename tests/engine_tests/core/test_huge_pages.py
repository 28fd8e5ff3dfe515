"""The LM's weights on transparent huge pages (engine.core.huge_pages): the same bytes in one
mapping Linux may back with huge pages, nothing moved where it offers none."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_MODEL
from torch import nn

from engine.core import huge_pages
from engine.core.huge_pages import MIN_BYTES, huge_page_size, move_to_huge_pages
from engine.core.prepared import PREPARED_DIR
from engine.cosyvoice1.engine import CosyVoiceEngine


class _Layer(nn.Module):
    """A Linear whose weight and bias are buffers, as the int8 and int4 kernels' layers."""

    weight: torch.Tensor
    bias: torch.Tensor

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _advised(address: int) -> bool:
    """Whether the mapping holding ``address`` was advised to take huge pages (its ``VmFlags``
    in /proc/self/smaps hold ``hg``): whether Linux then backs it with them depends on the
    memory it has free."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return "hg" in line.split()[1:]
    return False


def _layers() -> tuple[_Layer, _Layer, _Layer]:
    torch.manual_seed(0)
    shared = torch.randn(256, 256)  # 256 KB: moves; held by the first two layers
    first = _Layer(shared, torch.randn(256))  # the bias (1 KB) stays
    second = _Layer(shared, torch.randn(256))
    third = _Layer(torch.randn(128, 256), torch.randn(128))
    return first, second, third


def test_moved_buffers_compute_the_same_from_one_mapping() -> None:
    layers = _layers()
    first, second, third = layers
    x = torch.randn(3, 256)
    before = [layer(x) for layer in layers]
    biases = [layer.bias.data_ptr() for layer in layers]
    old = [first.weight.data_ptr(), third.weight.data_ptr()]
    moved = move_to_huge_pages([nn.Sequential(first, third), second])
    assert all(torch.equal(b, layer(x)) for b, layer in zip(before, layers, strict=True))
    # Small buffers stay where they were; a buffer two modules hold stays one tensor.
    assert [layer.bias.data_ptr() for layer in layers] == biases
    assert first.weight is second.weight
    page = huge_page_size()
    weights = [first.weight, third.weight]
    if page is None:  # nothing to move to: nothing moved
        assert moved == 0
        assert [w.data_ptr() for w in weights] == old
        return
    assert moved == (256 + 128) * 256 * 4  # each large buffer once, whole cache lines
    assert [w.data_ptr() for w in weights] != old
    # In one mapping, from its first huge page boundary on, each on a cache line.
    assert weights[0].data_ptr() % page == 0
    assert weights[1].data_ptr() == weights[0].data_ptr() + 256 * 256 * 4
    assert all(_advised(w.data_ptr()) for w in weights)


def test_nothing_moves_where_the_kernel_offers_no_huge_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    monkeypatch.setattr(huge_pages, "_THP", tmp_path)
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert huge_page_size() == 2097152
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    assert huge_page_size() is None
    layers = _layers()
    old = layers[0].weight.data_ptr()
    assert move_to_huge_pages(layers) == 0
    assert layers[0].weight.data_ptr() == old


def test_a_refused_mapping_leaves_the_weights_where_they_are(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # E.g. a sandbox that forbids the advice: a hint, so the load goes on without it.
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages, "huge_page_size", lambda: 2 * 2**20)
    monkeypatch.setattr(huge_pages.mmap, "mmap", refuse)
    layers = _layers()
    old = [layer.weight.data_ptr() for layer in layers]
    assert move_to_huge_pages(layers) == 0
    assert [layer.weight.data_ptr() for layer in layers] == old


def test_a_loaded_int8_lm_reads_its_weights_from_the_mapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "CosyVoice-300M-SFT"
    shutil.copytree(TINY_MODEL, model, ignore=shutil.ignore_patterns(PREPARED_DIR))
    cache = tmp_path / "cache"
    offered = huge_page_size() is not None
    # The tiny LM's layers are smaller than the full-size model's: all of them move here.
    assert MIN_BYTES > 1024
    monkeypatch.setattr(huge_pages, "MIN_BYTES", 1024)
    moved = CosyVoiceEngine.load(model, threads=1, lm_int8=True, cache_dir=cache).models.llm
    monkeypatch.setattr(huge_pages, "huge_page_size", lambda: None)
    kept = CosyVoiceEngine.load(model, threads=1, lm_int8=True, cache_dir=cache).models.llm
    # What moves: every large buffer in anonymous memory. v1's position tables are read from
    # the prepared file as needed (mapped): they stay, or all of them would become resident.
    paths = {id(module): path for path, module in kept.named_modules()}
    anonymous = {
        f"{paths[id(module)]}.{name}".lstrip(".")
        for module, name, _, _ in huge_pages._large_buffers([kept])
    }
    large = {name: b for name, b in moved.named_buffers() if b.numel() * b.element_size() >= 1024}
    mapped = set(large) - anonymous
    assert anonymous and any(name.endswith("pos_rows") for name in mapped)
    assert all(_advised(large[name].data_ptr()) == offered for name in anonymous)
    assert not any(_advised(large[name].data_ptr()) for name in mapped)
    # The same bytes, so the same maths.
    for (name, a), (_, b) in zip(moved.named_buffers(), kept.named_buffers(), strict=True):
        assert torch.equal(a, b), name
