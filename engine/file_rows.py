"""Embedding tables read from their checkpoint file row by row, instead of through the mapping.

A lookup reads a handful of rows, but where the page cache holds large folios (ext4 since Linux
6.16, see engine.pages) each row read in place maps the 2 MiB folio around it. Over a request
the 16 MB speech-token table becomes resident; over days of varied text, the 106 MB text table
would. Read with ``pread`` the rows land in a small fresh tensor and the table maps no page at
all (the kernel's page cache still serves the reads).
"""

from __future__ import annotations

import io
import logging
import os
import weakref

import torch
from torch import Tensor, nn

from engine.pages import file_location, open_mapped_file

_LOGGER = logging.getLogger(__name__)


class FileEmbedding(nn.Module):
    """``nn.Embedding`` lookups (same values, same shapes) served from a file with ``pread``."""

    def __init__(
        self,
        file: io.FileIO,
        offset: int,
        num_embeddings: int,
        embedding_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self._dtype = dtype
        self._row_bytes = embedding_dim * dtype.itemsize
        self._offset = offset
        # A file object, not a bare descriptor: a copy of the module fails loudly instead of
        # reading a descriptor it does not own. Closed with the module (no ResourceWarning).
        self._file = file
        weakref.finalize(self, file.close)

    @classmethod
    def replacing(cls, embedding: nn.Embedding) -> FileEmbedding | None:
        """A reader of ``embedding``'s mapped weight, or None if it is not read from a file."""
        weight = embedding.weight
        if (
            not weight.is_contiguous()
            or weight.dtype != torch.float32
            or embedding.padding_idx is not None
            or embedding.max_norm is not None
        ):
            return None
        spot = file_location(weight)
        if spot is None:
            return None
        file = open_mapped_file(spot.path, spot.inode)  # the module owns it
        if file is None:
            return None
        num_rows, dim = weight.shape
        reader = cls(file, spot.offset, num_rows, dim, dtype=weight.dtype)
        # The bytes must be the mapped ones: checked on the first and the last row.
        for row in (0, weight.shape[0] - 1):
            if reader.rows([row])[0].numpy().tobytes() != weight[row].detach().numpy().tobytes():
                _LOGGER.warning("%s changed since it was loaded; reading it mapped", spot.path)
                file.close()
                return None
        return reader

    def rows(self, ids: list[int]) -> Tensor:
        """(len(ids), embedding_dim) rows, read in one system call each."""
        size = self._row_bytes
        data = bytearray(len(ids) * size)
        view = memoryview(data)
        for n, i in enumerate(ids):
            if not 0 <= i < self.num_embeddings:
                raise IndexError(
                    f"index {i} out of range for an embedding of {self.num_embeddings} rows"
                )
            row = view[n * size : (n + 1) * size]
            if os.preadv(self._file.fileno(), [row], self._offset + i * size) != size:
                raise OSError(f"short read of embedding row {i} (file truncated?)")
        if not data:
            return torch.empty(0, self.embedding_dim, dtype=self._dtype)
        return torch.frombuffer(data, dtype=self._dtype).view(len(ids), self.embedding_dim)

    def forward(self, ids: Tensor) -> Tensor:
        return self.rows(ids.reshape(-1).tolist()).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, read from file"
