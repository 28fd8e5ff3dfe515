"""Mapped checkpoint pages that the engine no longer reads are given back (Linux only)."""

from __future__ import annotations

import os
import struct
import sys
from pathlib import Path

import pytest
import torch

from engine.weights import load_model_dir

TINY = Path(__file__).parent / "data" / "tiny_model"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/pagemap")


def resident_pages(tensor: torch.Tensor) -> int:
    """Pages wholly inside ``tensor`` that are mapped into this process (pagemap's present bit)."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page), end // page
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        pagemap.seek(first * 8)
        entries = pagemap.read((last - first) * 8)
    return sum(entry >> 63 for (entry,) in struct.iter_unpack("<Q", entries))


def test_the_lm_positional_weights_are_given_back_once_projected() -> None:
    llm = load_model_dir(TINY).llm
    weights = [block.self_attn.linear_pos.weight for block in llm.llm.encoders]
    assert weights[0].numel() * 4 >= 2 * os.sysconf("SC_PAGE_SIZE")  # whole pages to check
    embedding = torch.randn(1, 192, generator=torch.Generator().manual_seed(0))

    def decode() -> torch.Tensor:
        with torch.inference_mode():
            lm_input = llm.build_input([11, 22, 33], embedding=embedding)
            cache = llm.new_cache(lm_input.shape[1] + 300)
            outs = [llm.prefill(lm_input, cache).logits]
            outs += [llm.decode_step(token, cache).logits for token in range(1, 300)]
        return torch.cat(outs)

    first = decode()  # grows the cached rows past 256 positions: two projections per layer
    assert [resident_pages(w) for w in weights] == [0] * len(weights)
    for block in llm.llm.encoders:  # rebuilt from the given-back pages, which read back intact
        block.self_attn._pos_cache = None
    assert torch.equal(decode(), first)


def test_a_weight_written_after_loading_is_never_reverted() -> None:
    # Checkpoints are mapped copy-on-write: releasing a written page would bring back the
    # file's values. The positional rows must be built from, and the weight keep, the new ones.
    llm = load_model_dir(TINY).llm
    attention = llm.llm.encoders[0].self_attn
    written = torch.randn(attention.linear_pos.weight.shape,
                          generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        attention.linear_pos.weight.copy_(written)
    rows = attention._pos_rows(10)
    assert torch.equal(attention.linear_pos.weight, written)
    assert resident_pages(attention.linear_pos.weight) > 0
    expected = torch.nn.functional.linear(rel_pos_rows(attention, 10), written)
    assert torch.allclose(rows.transpose(0, 1).reshape(10, -1) * attention.d_k ** 0.5,
                          expected, atol=1e-5)


def rel_pos_rows(attention: torch.nn.Module, length: int) -> torch.Tensor:
    """The sin/cos encodings of relative positions length-1 … 0 (the rows _pos_rows projects)."""
    from engine.transformer import rel_pos_table

    return rel_pos_table(attention.linear_pos.weight.shape[1], length)[:length]
