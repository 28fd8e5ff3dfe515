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
    written = torch.randn(
        attention.linear_pos.weight.shape, generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        attention.linear_pos.weight.copy_(written)
    rows = attention._pos_rows(10)
    assert torch.equal(attention.linear_pos.weight, written)
    assert resident_pages(attention.linear_pos.weight) > 0
    expected = torch.nn.functional.linear(rel_pos_rows(attention, 10), written)
    assert torch.allclose(
        rows.transpose(0, 1).reshape(10, -1) * attention.d_k**0.5, expected, atol=1e-5
    )


def rel_pos_rows(attention: torch.nn.Module, length: int) -> torch.Tensor:
    """The sin/cos encodings of relative positions length-1 … 0 (the rows _pos_rows projects)."""
    from engine.transformer import rel_pos_table

    return rel_pos_table(attention.linear_pos.weight.shape[1], length)[:length]


# --- fencing off the pages no model reads (large page-cache folios) -------------------------


def file_areas(path: Path) -> list[tuple[int, int]]:
    """This process's address ranges that still map ``path`` (from /proc/self/maps)."""
    target = os.path.realpath(path)
    areas = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == target:
                lo, hi = (int(x, 16) for x in fields[0].split("-"))
                areas.append((lo, hi))
    return areas


def mapped(tensor: torch.Tensor, areas: list[tuple[int, int]]) -> bool:
    return any(lo <= tensor.data_ptr() < hi for lo, hi in areas)


def save_big_and_small(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint with an unused 4 MB tensor between two small used ones."""
    tensors = {
        "norm_a": torch.randn(256),
        "replaced": torch.randn(1024, 1024),
        "norm_b": torch.randn(256),
    }
    torch.save(tensors, path)
    return tensors


def test_fence_keeps_the_used_tensors_and_unmaps_the_rest(tmp_path: Path) -> None:
    from engine.pages import fence_off_unused, mapping_of

    path = tmp_path / "model.pt"
    saved = save_big_and_small(path)
    first = torch.load(path, mmap=True, weights_only=True)
    second = torch.load(path, mmap=True, weights_only=True)  # another load, never fenced
    lo, hi = mapping_of(first["replaced"])
    assert mapping_of(torch.randn(4)) is None
    assert hi - lo >= path.stat().st_size

    fenced = fence_off_unused((lo, hi), [first["norm_a"], first["norm_b"]])
    replaced_bytes = saved["replaced"].numel() * 4
    assert replaced_bytes - 2 * os.sysconf("SC_PAGE_SIZE") <= fenced
    areas = file_areas(path)
    assert mapped(first["norm_a"], areas) and mapped(first["norm_b"], areas)
    middle = first["replaced"].view(-1)[replaced_bytes // 8 :]
    assert not mapped(middle, areas)  # its pages no longer map the file at all
    assert mapping_of(first["norm_a"]) == (lo, hi)  # the split mapping is still found whole
    for name in ("norm_a", "norm_b"):
        assert torch.equal(first[name], saved[name])
    assert all(torch.equal(second[name], saved[name]) for name in saved)


def test_a_fenced_page_faults_instead_of_reading_zeros(tmp_path: Path) -> None:
    # A bug that still read a fenced tensor must crash loudly, never compute with zeros.
    import subprocess

    path = tmp_path / "model.pt"
    save_big_and_small(path)
    script = (
        "import torch, sys\n"
        "from engine.pages import fence_off_unused, mapping_of\n"
        f"sd = torch.load({str(path)!r}, mmap=True, weights_only=True)\n"
        "fence_off_unused(mapping_of(sd['norm_a']), [sd['norm_a'], sd['norm_b']])\n"
        "print(float(sd['norm_b'].sum()), flush=True)\n"
        "print(float(sd['replaced'][512].sum()), flush=True)\n"
    )
    import resource

    def no_core_file() -> None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    run = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent.parent,
        timeout=120,
        preexec_fn=no_core_file,
    )
    assert run.returncode == -11, run.stderr  # SIGSEGV
    assert len(run.stdout.splitlines()) == 1  # the used tensor was read first


@pytest.mark.parametrize("int8_cache", ["miss", "hit"])
def test_loaded_engine_maps_no_replaced_float_weights(tmp_path: Path, int8_cache: str) -> None:
    """After an int8 load only the tensors the models read are still mapped from the files."""
    from engine.engine import CosyVoiceEngine
    from engine.pages import mapping_of

    # One int8-replaced weight per file, and a float32 weight the model still reads from it.
    replaced = {
        "llm.pt": "llm.encoders.0.feed_forward.w_1.weight",
        "flow.pt": "decoder.estimator.mid_blocks.0.1.0.ff.net.2.weight",
    }
    raw = {name: torch.load(TINY / name, mmap=True, weights_only=True) for name in replaced}
    if int8_cache == "hit":
        CosyVoiceEngine.load(TINY, lm_int8=True, flow_int8=True, int8_cache_dir=tmp_path)
    engine = CosyVoiceEngine.load(TINY, lm_int8=True, flow_int8=True, int8_cache_dir=tmp_path)
    assert engine.lm_int8_cache_hit is (int8_cache == "hit")
    still_read = {
        "llm.pt": engine.models.llm.llm.embed.out[0].weight,
        "flow.pt": engine.models.flow.spk_embed_affine_layer.weight,
    }
    page = os.sysconf("SC_PAGE_SIZE")
    for name, key in replaced.items():
        areas = file_areas(TINY / name)
        found = mapping_of(still_read[name])
        assert found is not None  # still read in place from the file
        # The same byte of the file, in the engine's mapping: no area maps it any more.
        # (Its last whole page: the page after a tensor still read stays mapped, as a margin.)
        tensor = raw[name][key]
        assert tensor.numel() * tensor.element_size() >= 3 * page
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
        inner = found[0] + (end - fresh_base(raw[name])) // page * page - page
        assert not any(lo <= inner < hi for lo, hi in areas), key
    with torch.inference_mode():
        assert list(engine.synthesize("Hello.", short_options()))


def test_a_checkpoint_no_model_reads_is_not_fenced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A half-precision checkpoint is converted to float32 copies: no model reads its mapping,
    which must not be fenced (its addresses may belong to something else by then)."""
    import shutil

    import engine.weights
    from engine.engine import CosyVoiceEngine

    fenced_ranges: list[tuple[int, int]] = []
    real_fence = engine.weights.fence_off_unused

    def recording_fence(mapping: tuple[int, int], in_use: list[torch.Tensor]) -> int:
        fenced_ranges.append(mapping)
        return real_fence(mapping, in_use)

    monkeypatch.setattr(engine.weights, "fence_off_unused", recording_fence)

    model_dir = tmp_path / "model"
    shutil.copytree(TINY, model_dir)
    hift = torch.load(model_dir / "hift.pt", weights_only=True)
    torch.save({k: v.half() for k, v in hift.items()}, model_dir / "hift.pt")
    tts = CosyVoiceEngine.load(model_dir)
    assert len(fenced_ranges) == 2  # llm.pt and flow.pt, read in place
    assert not file_areas(model_dir / "hift.pt")  # unmapped with its last tensor
    assert file_areas(model_dir / "llm.pt")  # float32: read in place
    with torch.inference_mode():
        assert list(tts.synthesize("Hello.", short_options()))


def fresh_base(state: dict[str, torch.Tensor]) -> int:
    from engine.pages import mapping_of

    found = mapping_of(next(iter(state.values())))
    assert found is not None
    return found[0]


def short_options():
    from engine.types import SynthesisOptions

    return SynthesisOptions(stream=True, seed=0, force_tokens=20, n_timesteps=2)


def test_small_tensors_are_copied_out_of_the_checkpoint() -> None:
    """Norms and biases: read in place, each would map the 2 MiB folio around it."""
    from engine.pages import mapping_of

    llm = load_model_dir(TINY).llm
    block = llm.llm.encoders[0]
    assert mapping_of(block.norm1.weight) is None and mapping_of(block.self_attn.pos_bias_u) is None
    assert mapping_of(block.feed_forward.w_1.weight) is not None  # large: used in place


def page_is_mapped(address: int) -> bool:
    """Whether the page holding ``address`` is mapped into this process (pagemap's bit 63)."""
    page = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        pagemap.seek(address // page * 8)
        (entry,) = struct.unpack("<Q", pagemap.read(8))
    return bool(entry >> 63)


def test_copies_are_read_from_the_file_without_mapping_its_pages(tmp_path: Path) -> None:
    """Copied through the mapping, a small tensor would map the page-cache folio around it
    (2 MiB with large folios) until the load's fence: measured 300 MB at the load's peak."""
    from engine.pages import read_copies

    path = tmp_path / "model.pt"
    saved = save_big_and_small(path)
    state = torch.load(path, mmap=True, weights_only=True)
    copies = read_copies([state["norm_a"], state["norm_b"]])

    # The file's pages under the small tensors were never touched through the mapping.
    assert not page_is_mapped(state["norm_a"].data_ptr())
    assert not page_is_mapped(state["norm_b"].data_ptr())
    areas = file_areas(path)
    for copy, name in zip(copies, ["norm_a", "norm_b"], strict=True):
        assert torch.equal(copy, saved[name]) and not mapped(copy, areas)

    # Neither is read from a file: cloned (a strided view is not one stretch of the file).
    plain, strided = torch.randn(3, 4), state["replaced"][:, :3]
    copies = read_copies([plain, strided])
    for copy, expected in zip(copies, [plain, saved["replaced"][:, :3]], strict=True):
        assert torch.equal(copy, expected) and copy.is_contiguous()
        assert copy.data_ptr() != expected.data_ptr() and not mapped(copy, areas)


def test_a_file_replaced_since_mapping_is_copied_from_the_mapping(tmp_path: Path) -> None:
    from engine.pages import read_copies

    path = tmp_path / "model.pt"
    saved = save_big_and_small(path)
    state = torch.load(path, mmap=True, weights_only=True)
    other = tmp_path / "other.pt"
    torch.save({name: -tensor for name, tensor in saved.items()}, other)
    os.replace(other, path)  # a new inode at the same path: its bytes are not the mapped ones

    (copy,) = read_copies([state["norm_a"]])
    assert torch.equal(copy, saved["norm_a"])


def test_a_tensor_written_since_mapping_is_copied_with_its_new_values(tmp_path: Path) -> None:
    # Mapped copy-on-write: the file still has the old bytes, the tensor the new ones.
    from engine.pages import read_copies

    path = tmp_path / "model.pt"
    save_big_and_small(path)
    state = torch.load(path, mmap=True, weights_only=True)
    state["norm_b"][7] = 123.0

    (copy,) = read_copies([state["norm_b"]])
    assert torch.equal(copy, state["norm_b"]) and copy[7] == 123.0
