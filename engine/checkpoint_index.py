"""A checkpoint's tensors without unpickling it, through a small index of where they lie.

``torch.load(weights_only=True, mmap=True)`` parses a checkpoint's pickle with a pure-Python
unpickler: for ``flow.pt``'s 1185 tensors that is ≈ 0.2 s alone, and ≈ 0.5 s at every start of
the fast profiles, where it shares two cores with the int8 packers. Yet a torch checkpoint is an
uncompressed zip whose tensor bytes sit at fixed offsets. So the first load unpickles as before
(and ``weights_only`` vets the file), then records every tensor's dtype, shape, stride and byte
offset in a JSON index in the engine's cache directory; later loads map the checkpoint and build
the same tensors as views of the mapping: same bytes, same layout, no pickle code at all.

An index is used only while the checkpoint's zip directory is the one it was made from (the
name, offset, CRC-32 and size of every member, and the file's size): a replaced or rewritten
checkpoint, or an index that does not fit the file, is rebuilt from ``torch.load``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

import torch

from engine.pages import file_location

_LOGGER = logging.getLogger(__name__)

INDEX_FORMAT = 1
# The dtypes an index may name (a checkpoint with others is simply not indexed).
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def cache_file(cache_dir: Path, checkpoint: Path, suffix: str) -> Path:
    """A cache file of one checkpoint in the engine's cache dir (its index, its int8 layers),
    named by the checkpoint's absolute path, so models never share one."""
    digest = hashlib.sha256(str(Path(checkpoint).resolve()).encode()).hexdigest()[:16]
    return Path(cache_dir) / f"{Path(checkpoint).stem}-{digest}{suffix}"


def index_path(index_dir: Path, checkpoint: Path) -> Path:
    """The index file of one checkpoint."""
    return cache_file(index_dir, checkpoint, ".index.json")


def zip_key(checkpoint: Path) -> str | None:
    """A digest of the checkpoint's zip directory and size (None: not a readable zip)."""
    try:
        with zipfile.ZipFile(checkpoint) as archive:
            members = [
                (i.filename, i.header_offset, i.compress_type, i.CRC, i.file_size)
                for i in archive.infolist()
            ]
        size = Path(checkpoint).stat().st_size
    except (OSError, zipfile.BadZipFile, ValueError):
        return None
    return hashlib.sha256(repr((size, members)).encode()).hexdigest()


def _extent(shape: list[int], stride: list[int]) -> int:
    """Elements a strided tensor spans from its first one (0 when it has none)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


def read_indexed(checkpoint: Path, index_dir: Path) -> dict[str, torch.Tensor] | None:
    """The checkpoint's tensors through its index; None when there is no usable index."""
    path = index_path(index_dir, checkpoint)
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    try:
        if (
            index["format"] != INDEX_FORMAT
            or index["torch"] != torch.__version__
            or index["zip"] != zip_key(checkpoint)
        ):
            return None
        return _map_tensors(checkpoint, index["tensors"])
    except (KeyError, TypeError, ValueError, OSError, RuntimeError) as err:
        _LOGGER.warning("Index %s not used (%s: %s); rebuilding it", path, type(err).__name__, err)
        return None


def _map_tensors(checkpoint: Path, entries: Mapping[str, list]) -> dict[str, torch.Tensor]:
    with open(checkpoint, "rb") as stream:
        size = os.fstat(stream.fileno()).st_size
        # Private and writable, as torch.load(mmap=True) maps it: a write would copy the page,
        # never reach the file.
        mapped = mmap.mmap(
            stream.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    tensors = {}
    for name, (dtype_name, shape, stride, offset) in entries.items():
        dtype = _DTYPES[dtype_name]
        count = _extent(shape, stride)
        if count == 0:
            tensors[name] = torch.empty_strided(shape, stride, dtype=dtype)
            continue
        if offset < 0 or offset + count * dtype.itemsize > size:
            raise ValueError(f"{name} lies outside the file")
        flat = torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset)
        tensors[name] = flat.as_strided(shape, stride)
    return tensors


def write_index(checkpoint: Path, index_dir: Path, tensors: Mapping[str, torch.Tensor]) -> bool:
    """Record where ``tensors`` (as ``torch.load(mmap=True)`` returned them) lie in the file.

    Returns False, writing nothing, when a tensor is not a view of the checkpoint's mapping or
    has a dtype the index does not name; a failed write is logged and skipped.
    """
    key = zip_key(checkpoint)
    entries = _entries(checkpoint, tensors)
    if key is None or entries is None:
        return False
    index = {"format": INDEX_FORMAT, "torch": torch.__version__, "zip": key, "tensors": entries}
    path = index_path(index_dir, checkpoint)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: a reader sees the old index or the new one, never half.
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as out:
            json.dump(index, out)
        os.replace(tmp, path)
    except OSError as err:
        _LOGGER.warning("Could not write the checkpoint index %s: %s", path, err)
        return False
    return True


def _entries(checkpoint: Path, tensors: Mapping[str, torch.Tensor]) -> dict[str, list] | None:
    st = Path(checkpoint).stat()
    size, inode = st.st_size, st.st_ino
    base: int | None = None
    entries = {}
    for name, tensor in tensors.items():
        dtype_name = str(tensor.dtype).removeprefix("torch.")
        shape, stride = list(tensor.shape), list(tensor.stride())
        if dtype_name not in _DTYPES or tensor.layout != torch.strided:
            return None
        count = _extent(shape, stride)
        if count == 0:
            entries[name] = [dtype_name, shape, stride, 0]
            continue
        if base is None:  # every tensor of one torch.load(mmap=True) is in one mapping
            spot = file_location(tensor)
            if spot is None or spot.inode != inode:
                return None
            base = tensor.data_ptr() - spot.offset
        offset = tensor.data_ptr() - base
        if offset < 0 or offset + count * tensor.element_size() > size:
            return None
        entries[name] = [dtype_name, shape, stride, offset]
    return entries
