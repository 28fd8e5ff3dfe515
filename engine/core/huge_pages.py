"""An LM's packed weights moved onto transparent huge pages, where Linux offers them.

A decode step reads every weight of the LM once per token, a few hundred MB in order. On 4 KB
pages that is tens of thousands of TLB misses per token, each a page-table walk beside the
stream; on 2 MB pages about a hundred. Linux gives anonymous memory huge pages where the
program asks (``madvise(MADV_HUGEPAGE)``, the default "madvise" mode of most distributions) or
everywhere ("always"); torch's allocator never asks. So after a load the LM's weight buffers
in anonymous memory (the int8 and int4 kernels' packed layouts, whatever else is large) are
copied, one after the other, into one anonymous mapping marked for huge pages, and the modules
hold views of it. The maths is untouched: the same bytes, elsewhere. Tables read from a
prepared file as needed stay mapped: a copy would make every row resident.

Each buffer's old memory is freed as soon as its copy is made and handed back to the system
(``malloc_trim`` where the C library has it, every ``_TRIM_EVERY`` bytes copied), so the
load's peak grows by at most that much.
Where the kernel offers no transparent huge pages ("never", not Linux) nothing moves.
"""

from __future__ import annotations

import bisect
import logging
import mmap
import sys
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from engine.core.runtime import give_back_free_heap

_LOGGER = logging.getLogger(__name__)

_THP = Path("/sys/kernel/mm/transparent_hugepage")
# Buffers smaller than this stay where they are (biases, scales): they are a few per cent of
# the bytes a token reads.
MIN_BYTES = 64 * 1024
# Each moved buffer starts on a cache line, as torch's own allocations do.
_ALIGN = 64
# Linux's number for the advice (Python's mmap names it from 3.13).
_MADV_POPULATE_WRITE = 23
# Freed memory is handed back to the system after every this many bytes copied.
_TRIM_EVERY = 64 * 2**20


def huge_page_size() -> int | None:
    """The size of a transparent huge page where anonymous memory may ask for them, else None
    (not Linux, the mode "never", or no ``MADV_HUGEPAGE`` in this Python)."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        if "[never]" in (_THP / "enabled").read_text():
            return None
        return int((_THP / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return None


def _advised_mapping(size: int) -> mmap.mmap | None:
    """A private anonymous mapping of ``size`` bytes advised to take huge pages, or None where
    the system refuses either (the weights then stay where they are: a hint, not a need)."""
    try:
        arena = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except OSError as err:
        _LOGGER.debug("No mapping on huge pages for the LM's weights: %s", err)
        return None
    return arena


def _populate(arena: mmap.mmap, start: int, size: int) -> None:
    """Fault the pages the copies will write in one call (``MADV_POPULATE_WRITE``, Linux 5.14):
    one fault per huge page inside the copies was several times slower on a VM whose freed
    memory goes back to its host (docs/dev/performance-notes.md). Older kernels refuse the
    advice; then the copies fault the pages."""
    length = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
    try:
        arena.madvise(getattr(mmap, "MADV_POPULATE_WRITE", _MADV_POPULATE_WRITE), start, length)
    except OSError:
        pass


def _anonymous_ranges() -> list[tuple[int, int]]:
    """The address ranges of this process's anonymous memory (heap and anonymous mappings:
    inode 0 in /proc/self/maps), sorted."""
    ranges: list[tuple[int, int]] = []
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return ranges  # nothing known to be anonymous: nothing moves
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[4] == "0":
            start, end = (int(part, 16) for part in fields[0].split("-"))
            ranges.append((start, end))
    return sorted(ranges)


def _in_ranges(ranges: list[tuple[int, int]], start: int, size: int) -> bool:
    index = bisect.bisect_right(ranges, (start, sys.maxsize)) - 1
    return index >= 0 and ranges[index][0] <= start and start + size <= ranges[index][1]


def _large_buffers(modules: Iterable[nn.Module]) -> list[tuple[nn.Module, str, int, int]]:
    """(module, name, address, bytes) of every contiguous CPU buffer of at least ``MIN_BYTES``
    in anonymous memory inside ``modules``, each module once (LMs share modules:
    engine.core.shared_layers). A buffer read from a mapped file (a prepared file's table whose
    rows are read as needed) stays: a copy would make all of it resident. No tensor is held:
    each one's memory can go as soon as it has moved."""
    anonymous = _anonymous_ranges()
    seen: set[int] = set()
    found = []
    for root in modules:
        for module in root.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            for name, buffer in module.named_buffers(recurse=False):
                size = buffer.numel() * buffer.element_size()
                if (
                    buffer.device.type == "cpu"
                    and buffer.is_contiguous()
                    and size >= MIN_BYTES
                    and _in_ranges(anonymous, buffer.data_ptr(), size)
                ):
                    found.append((module, name, buffer.data_ptr(), size))
    return found


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def move_to_huge_pages(modules: Iterable[nn.Module]) -> int:
    """Move the large buffers of ``modules`` into one mapping on transparent huge pages; the
    bytes moved (0 where the system offers none). A buffer held by several modules moves once
    and stays one tensor."""
    page = huge_page_size()
    if page is None:
        return 0
    buffers = _large_buffers(modules)
    total = sum(
        _padded(size) for size in {address: size for _, _, address, size in buffers}.values()
    )
    if total == 0:
        return 0
    # Room to start on a huge page boundary. Only the pages the copies fill become resident
    # (the last huge page whole where the mapping holds all of it).
    arena = _advised_mapping(total + page)
    if arena is None:
        return 0
    # The views below keep the mapping alive: torch.frombuffer holds a reference to it.
    memory = torch.frombuffer(arena, dtype=torch.uint8)
    offset = -memory.data_ptr() % page
    _populate(arena, offset, total)
    moved: dict[int, torch.Tensor] = {}  # by the old buffer's address
    since_trim = 0
    for module, name, address, size in buffers:
        if address not in moved:
            buffer = getattr(module, name)
            view = memory[offset : offset + size].view(buffer.dtype).view(buffer.shape)
            view.copy_(buffer)
            del buffer
            moved[address] = view
            offset += _padded(size)
            since_trim += size
        setattr(module, name, moved[address])  # the old buffer goes with its last holder
        if since_trim >= _TRIM_EVERY:
            give_back_free_heap()
            since_trim = 0
    give_back_free_heap()
    _LOGGER.info("The LM's weights (%.0f MB) on %d KB huge pages", total / 1e6, page // 1024)
    return total
