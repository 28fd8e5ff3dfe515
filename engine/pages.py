"""Giving the pages of memory-mapped checkpoint tensors back once they are no longer needed.

Checkpoints are opened with ``mmap=True``, so a tensor's pages count towards the RSS once
touched and stay mapped as long as any tensor of the file lives. Weights that were turned into
something else at load time (int8 copies, folded weight norm) would otherwise stay resident.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

import torch

_MADV_DONTNEED = 4


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages of a memory-mapped, never-written tensor from this process.

    The checkpoint stays mapped as long as any of its tensors lives, so float32 weights that
    were replaced by int8 copies would otherwise keep counting towards the RSS. The pages stay
    in the page cache and fault back in from the file if touched again. Only whole pages inside
    the tensor are released; a no-op off Linux.
    """
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first and not _has_written_pages(first // page, last // page):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def _has_written_pages(first: int, last: int) -> bool:
    """Whether pages ``first``…``last``-1 hold private copies (or cannot be checked).

    Checkpoints are mapped copy-on-write: a weight written in place after loading lives in
    anonymous copies of its pages, and releasing those would silently revert it to the file's
    values. /proc/self/pagemap marks a present page that is still the file's with bit 61.
    """
    try:
        with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
            pagemap.seek(first * 8)
            entries = pagemap.read((last - first) * 8)
    except OSError:
        return True  # unknown: keep the pages
    present, file_page = 1 << 63, 1 << 61
    return any(entry & present and not entry & file_page
               for (entry,) in struct.iter_unpack("<Q", entries))


def release_if_mapped(tensor: torch.Tensor, file_ranges: list[tuple[int, int]]) -> None:
    # Only pages of a mapped file: released anonymous memory would read back as zeros.
    if any(lo <= tensor.data_ptr() < hi for lo, hi in file_ranges):
        release_pages(tensor)


def file_mapped_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process that map a file (from /proc/self/maps; [] elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges
