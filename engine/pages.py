"""Giving the pages of memory-mapped checkpoint tensors back once they are no longer needed.

Checkpoints are opened with ``mmap=True``, so a tensor's pages count towards the RSS once
touched and stay mapped as long as any tensor of the file lives. Weights that were turned into
something else at load time (int8 copies, folded weight norm) would otherwise stay resident.

Releasing them once is not enough where the page cache holds large folios (ext4 since Linux
6.16): a fault on any byte of a 2 MiB folio maps all of it, so touching a 1 KB LayerNorm weight
maps the int8-replaced float weights around it again. :func:`fence_off_unused` takes those
stretches out of the file mapping for good.
"""

from __future__ import annotations

import ctypes
import functools
import io
import logging
import os
import struct
import sys
from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch

_LOGGER = logging.getLogger(__name__)

_MADV_DONTNEED = 4
_PROT_NONE = 0
# MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE: replaces what is mapped there.
_MAP_FENCE = 0x02 | 0x20 | 0x10 | 0x4000


def give_back_free_heap() -> None:
    """Return the memory malloc holds free to the kernel (glibc's ``malloc_trim``; else no-op).

    glibc keeps what a vocoder pass frees: over a streamed `fastest` request of six chunks the
    free heap grew from 40 to 115 MB, all of it still resident. A trim after a chunk costs a few
    milliseconds against the 0.4–3 s a chunk takes.
    """
    trim = getattr(_libc(), "malloc_trim", None)  # glibc only (musl has none)
    if trim is not None:
        trim(0)


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """This process's C library (None off Linux), with ``mmap``'s signature declared."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    )
    return libc


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages of a memory-mapped, never-written tensor from this process.

    The checkpoint stays mapped as long as any of its tensors lives, so float32 weights that
    were replaced by int8 copies would otherwise keep counting towards the RSS. The pages stay
    in the page cache and fault back in from the file if touched again. Only whole pages inside
    the tensor are released; a no-op off Linux.
    """
    libc = _libc()
    if libc is None or tensor.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first and not _has_written_pages(first // page, last // page):
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
    return any(
        entry & present and not entry & file_page for (entry,) in struct.iter_unpack("<Q", entries)
    )


def release_if_mapped(tensor: torch.Tensor, file_ranges: list[tuple[int, int]]) -> None:
    # Only pages of a mapped file: released anonymous memory would read back as zeros.
    if any(lo <= tensor.data_ptr() < hi for lo, hi in file_ranges):
        release_pages(tensor)


def mapping_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """Address range of the file mapping holding ``tensor`` (None if not file-mapped).

    A mapping already split into areas is found by the areas' shared file and start address
    minus file offset; pages fenced off at its end are no longer part of it.
    """
    areas = list(_file_areas())
    home = _area_holding(tensor, areas)
    if home is None:
        return None
    same = [area.hi for area in areas if area.mapping == home.mapping]
    return home.mapping[0], max(same)


class FileSpot(NamedTuple):
    """Where a file-mapped tensor's first byte lives: the file's path, inode and byte offset."""

    path: str
    inode: int
    offset: int


def file_location(tensor: torch.Tensor) -> FileSpot | None:
    """The file and offset behind a file-mapped tensor (None if it is not file-mapped).

    The path is the mapped file's name now (a rename is followed, a deleted file ends in
    " (deleted)"): whoever opens it must check the inode.
    """
    area = _area_holding(tensor, _file_areas())
    if area is None:
        return None
    return FileSpot(area.path, int(area.mapping[2]), tensor.data_ptr() - area.mapping[0])


def read_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Contiguous copies of ``tensors``; those of a file mapping are read with ``pread``.

    Copied through the mapping, each small tensor (a norm, a bias) would map the 2 MiB
    page-cache folio around it, and with it pages of the large weights beside it that the int8
    layers replace: on the full-size model, 200 MB of ``flow.pt`` and 100 MB of ``llm.pt``
    resident at the load's peak, until the fence. ``pread`` copies from the page cache and maps
    nothing. A tensor that is not file-mapped, was written since (copy-on-write), or whose file
    cannot be read back as mapped, is cloned.
    """
    areas = list(_file_areas())
    files: dict[tuple[int, str, str], io.FileIO | None] = {}
    try:
        return [_pread_copy(t, areas, files) for t in tensors]
    finally:
        for file in files.values():
            if file is not None:
                file.close()


def _pread_copy(
    tensor: torch.Tensor, areas: list[_Area], files: dict[tuple[int, str, str], io.FileIO | None]
) -> torch.Tensor:
    area = _area_holding(tensor, areas) if tensor.numel() else None
    if area is None or not tensor.is_contiguous() or _written_since_mapped(tensor):
        return tensor.clone(memory_format=torch.contiguous_format)
    if area.mapping not in files:
        files[area.mapping] = open_mapped_file(area.path, int(area.mapping[2]))
    file = files[area.mapping]
    copy = torch.empty_like(tensor, memory_format=torch.contiguous_format)
    size = tensor.numel() * tensor.element_size()
    buffer = (ctypes.c_char * size).from_address(copy.data_ptr())
    offset = tensor.data_ptr() - area.mapping[0]
    if file is None or os.preadv(file.fileno(), [buffer], offset) != size:
        return tensor.clone(memory_format=torch.contiguous_format)
    return copy


def _written_since_mapped(tensor: torch.Tensor) -> bool:
    """Whether any page of a file-mapped tensor holds a private copy (the file has other bytes)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    return _has_written_pages(start // page, -(-end // page))


def open_mapped_file(path: str, inode: int) -> io.FileIO | None:
    """``path`` opened for reading, if it is still the mapped file (same inode); else None.

    The inode only: btrfs subvolumes report another device number to stat than to maps.
    """
    try:
        file = open(path, "rb", buffering=0)  # the caller closes it
    except OSError as err:  # e.g. deleted since it was mapped
        _LOGGER.debug("Cannot reopen mapped file %s: %s", path, err)
        return None
    if os.fstat(file.fileno()).st_ino != inode:
        file.close()
        return None
    return file


def fence_off_unused(mapping: tuple[int, int], in_use: list[torch.Tensor]) -> int:
    """Replace the pages of ``mapping`` no tensor of ``in_use`` touches by inaccessible ones.

    Call it only once every tensor that will ever be read from the mapping is in ``in_use``,
    and while the mapping is alive: reading a fenced page is a segmentation fault, by design,
    not a silent zero. A page after each tensor is kept, for kernels that read a little past
    the end. The address range stays reserved, so the storage's final ``munmap`` still covers
    exactly its own pages. Returns the bytes fenced off (0 off Linux or if the kernel refuses;
    the pages then merely stay mappable, as before).
    """
    libc = _libc()
    if libc is None:
        return 0
    lo, hi = mapping
    page = os.sysconf("SC_PAGE_SIZE")
    used = sorted(_extent(t) for t in in_use if t.numel() and lo <= t.data_ptr() < hi)
    holes, cursor = [], lo
    for start, end in used:
        if start > cursor:
            holes.append((cursor, start))
        cursor = max(cursor, end + page)
    holes.append((cursor, hi))
    fenced = 0
    for start, end in holes:
        first, last = -(-start // page) * page, end // page * page  # whole pages only
        if last > first:
            if libc.mmap(first, last - first, _PROT_NONE, _MAP_FENCE, -1, 0) != first:
                _LOGGER.warning(
                    "Could not fence off unused checkpoint pages: %s",
                    os.strerror(ctypes.get_errno()),
                )
                break
            fenced += last - first
    return fenced


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte address a (possibly strided) tensor reads."""
    span = sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )
    return tensor.data_ptr(), tensor.data_ptr() + (span + 1) * tensor.element_size()


def file_mapped_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process that map a file (from /proc/self/maps; [] elsewhere)."""
    return [(area.lo, area.hi) for area in _file_areas()]


class _Area(NamedTuple):
    lo: int
    hi: int
    mapping: tuple[int, str, str]  # (start address minus file offset, device, inode)
    path: str


def _area_holding(tensor: torch.Tensor, areas: Iterable[_Area]) -> _Area | None:
    ptr = tensor.data_ptr()
    return next((area for area in areas if area.lo <= ptr < area.hi), None)


def _file_areas() -> Iterator[_Area]:
    """The file-backed areas of /proc/self/maps (none where it cannot be read)."""
    try:
        with open(
            "/proc/self/maps", encoding=sys.getfilesystemencoding(), errors="surrogateescape"
        ) as maps:
            lines = maps.readlines()
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            yield _Area(
                lo, hi, (lo - int(fields[2], 16), fields[3], fields[4]), fields[5].rstrip("\n")
            )
