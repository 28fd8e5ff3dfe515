"""Embedding tables served from their checkpoint files row by row (engine.file_rows)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from conftest import synthesize_all

from engine.file_rows import FileEmbedding
from engine.weights import load_model_dir

TINY = Path(__file__).parent / "data" / "tiny_model"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")


def mapped_table(tmp_path: Path, rows: int = 300, dim: int = 24) -> torch.nn.Embedding:
    path = tmp_path / "table.pt"
    torch.save({"weight": torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))}, path)
    table = torch.nn.Embedding(rows, dim)
    state = torch.load(path, mmap=True, weights_only=True)
    table.load_state_dict(state, assign=True)
    return table


def test_rows_read_from_the_file_equal_the_mapped_lookup(tmp_path: Path) -> None:
    table = mapped_table(tmp_path)
    reader = FileEmbedding.replacing(table)
    assert reader is not None
    ids = torch.tensor([[0, 299, 7, 7], [150, 1, 2, 3]])
    assert torch.equal(reader(ids), table(ids))
    assert reader(torch.zeros(1, 0, dtype=torch.long)).shape == (1, 0, 24)
    assert reader(torch.tensor([5])).shape == (1, 24)


def test_an_id_out_of_range_is_an_index_error_as_with_nn_embedding(tmp_path: Path) -> None:
    reader = FileEmbedding.replacing(mapped_table(tmp_path))
    for bad in (300, -1):
        with pytest.raises(IndexError):
            reader(torch.tensor([[1, bad]]))


def test_the_mapped_file_is_found_where_it_is_now(tmp_path: Path) -> None:
    table = mapped_table(tmp_path)
    # Replaced on disk (a new download) after it was mapped: the old file is read, not the new.
    path = tmp_path / "table.pt"
    os.replace(path, tmp_path / "old.pt")
    torch.save({"weight": torch.zeros(300, 24)}, path)
    reader = FileEmbedding.replacing(table)
    assert reader is not None
    assert torch.equal(reader(torch.tensor([3, 299])), table(torch.tensor([3, 299])))


def test_a_table_not_readable_from_a_file_stays_as_it_is(tmp_path: Path) -> None:
    assert FileEmbedding.replacing(torch.nn.Embedding(10, 4)) is None  # in memory
    table = mapped_table(tmp_path)
    os.unlink(tmp_path / "table.pt")  # still mapped, but no path reads it any more
    assert FileEmbedding.replacing(table) is None


def test_the_engine_reads_its_embedding_tables_from_the_files() -> None:
    from engine.engine import CosyVoiceEngine
    from engine.types import SynthesisOptions

    expected = load_model_dir(TINY)
    engine = CosyVoiceEngine.load(TINY)
    models = engine.models
    tables = {
        "text": (models.llm.text_embedding, expected.llm.text_embedding),
        "speech": (models.llm.speech_embedding, expected.llm.speech_embedding),
        "flow": (models.flow.input_embedding, expected.flow.input_embedding),
    }
    for name, (served, reference) in tables.items():
        assert isinstance(served, FileEmbedding), name
        ids = torch.arange(reference.num_embeddings).view(1, -1)
        assert torch.equal(served(ids), reference(ids)), name
    # Same tokens and audio as a model reading the tables through the mapping.
    options = SynthesisOptions(stream=False, seed=3, force_tokens=12, n_timesteps=2)
    audio = synthesize_all(engine, "Hello.", options)
    engine.models.llm.speech_embedding = expected.llm.speech_embedding
    engine.models.llm.text_embedding = expected.llm.text_embedding
    engine.models.flow.input_embedding = expected.flow.input_embedding
    again = synthesize_all(engine, "Hello.", options)
    assert torch.equal(audio, again)
