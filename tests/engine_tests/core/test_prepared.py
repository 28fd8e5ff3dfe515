"""engine.core.prepared: the files the engine runs from are written once, used as they are, prepared
again when their checkpoint or torch changes, rebuilt with a warning when damaged, and compute
exactly what the official checkpoints compute.

Every test works on a copy of the tiny model in its tmp_path (without the repository copy's own
prepared files)."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, synthesize_all
from safetensors import safe_open
from safetensors.torch import save_file

from engine.__main__ import main
from engine.core import prepared
from engine.core.estimator_blocks import TransformerBlock
from engine.core.onednn_layers import use_onednn_convs, use_onednn_linears
from engine.core.prepared import (
    PREPARED_DIR,
    PreparedLoad,
    WeightFormats,
    prepare_model,
    prepared_dirs,
)
from engine.core.quantize import INT8_LINEAR_TYPES, quantize_flow_int8, quantize_lm_int8
from engine.core.transformer import ROW_BLOCK, STORED_POSITIONS, RelPosAttention
from engine.core.types import SynthesisOptions
from engine.cosyvoice1.engine import CosyVoiceEngine
from engine.cosyvoice1.model_dir import PARTS, load_model_dir, loaded_models


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Tiny tensors: a second thread only contends."""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    target = tmp_path / "CosyVoice-300M-SFT"
    shutil.copytree(TINY_MODEL, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    return target


def load(model: Path, **weights: bool) -> CosyVoiceEngine:
    return CosyVoiceEngine.load(model, threads=1, cache_dir=model.parent / "cache", **weights)


def prepared_names(model: Path) -> list[str]:
    return sorted(p.name for p in (model / PREPARED_DIR).iterdir())


def stored(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    with safe_open(path, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_prepare_writes_one_file_per_model_and_format(model: Path) -> None:
    argv = ["prepare", "--model-dir", str(model), "--lm", "fp32", "int8", "--hift", "bf16"]
    assert main(argv) == 0
    assert prepared_names(model) == [
        "flow.fp32.safetensors",
        "hift.bf16.safetensors",
        "llm.fp32.safetensors",
        "llm.int8.safetensors",
    ]
    _, key = stored(model / PREPARED_DIR / "llm.int8.safetensors")
    checkpoint = (model / "llm.pt").stat()
    assert key["weights"] == "int8" and key["torch"] == str(torch.__version__)
    assert key["source_size"] == str(checkpoint.st_size)
    assert key["source_mtime_ns"] == str(checkpoint.st_mtime_ns)


def test_the_files_hold_the_tensors_in_their_run_formats(model: Path) -> None:
    prepare_model(model, {"llm": ["int8"], "hift": ["fp32", "bf16"]}, parts=PARTS)
    llm, _ = stored(model / PREPARED_DIR / "llm.int8.safetensors")
    # int8 layers: int8 weight and per-channel scales; q, k and v as the one layer they run as.
    assert llm["llm_decoder.weight"].dtype == torch.int8
    assert llm["llm_decoder.weight_scale"].shape == (llm["llm_decoder.weight"].shape[0],)
    assert llm["llm.encoders.0.self_attn.linear_qkv.weight"].dtype == torch.int8
    assert not any(".linear_q." in name for name in llm)
    assert llm["llm.encoders.0.self_attn.linear_pos.weight"].dtype == torch.float32
    hift, _ = stored(model / PREPARED_DIR / "hift.fp32.safetensors")
    assert not any(name.endswith(("weight_g", "weight_v", "original0")) for name in hift)
    hift_bf16, _ = stored(model / PREPARED_DIR / "hift.bf16.safetensors")
    assert hift_bf16["conv_pre.weight"].dtype == torch.bfloat16
    assert hift_bf16["f0_predictor.classifier.weight"].dtype == torch.float32


def _causal_attentions(llm: torch.nn.Module) -> dict[str, RelPosAttention]:
    """The LM's attention layers that score with stored rows (its two causal encoders)."""
    return {
        name: module
        for name, module in llm.named_modules()
        if isinstance(module, RelPosAttention) and name.startswith(("llm.", "text_encoder."))
    }


@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_the_lm_file_holds_the_positional_rows_computed_at_run_time(
    model: Path, weights: str
) -> None:
    """Each causal layer's rows of its first relative positions, bit for bit the rows the LM
    loaded from its checkpoint computes when it needs them; the flow's layers have none."""
    prepare_model(model, {"llm": [weights], "flow": ["fp32"]}, parts=PARTS)
    llm, _ = stored(model / PREPARED_DIR / f"llm.{weights}.safetensors")
    flow, _ = stored(model / PREPARED_DIR / "flow.fp32.safetensors")
    assert not any(name.endswith("pos_rows") for name in flow)
    attentions = _causal_attentions(load_model_dir(model).llm)
    assert len(attentions) == 3 and {n for n in llm if n.endswith("pos_rows")} == {
        f"{name}.pos_rows" for name in attentions
    }
    blocks = STORED_POSITIONS // ROW_BLOCK
    for name, attention in attentions.items():
        rows = llm[f"{name}.pos_rows"]
        assert rows.shape == (blocks, attention.h, ROW_BLOCK, attention.d_k)
        assert rows.dtype == torch.float32
        with torch.inference_mode():
            assert torch.equal(rows, torch.stack(attention._row_blocks(blocks))), name


def test_a_file_of_the_previous_format_is_prepared_again(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file written before the LM's positional rows were stored is out of date, not damaged."""
    load(model)
    path = model / PREPARED_DIR / "llm.fp32.safetensors"
    tensors, key = stored(path)
    older = {name: t for name, t in tensors.items() if not name.endswith("pos_rows")}
    save_file(older, path, metadata={**key, "file_format": "1"})
    with caplog.at_level(logging.INFO, logger="engine.core.prepared"):
        engine = load(model)
    assert engine.prepared_at_load == ("llm.fp32",)
    assert "file_format" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges of this process's mappings of ``path`` (from /proc/self/maps)."""
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if line.rstrip("\n").endswith(str(path)):
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
@pytest.mark.parametrize("lm_int8", [False, True], ids=["fp32", "int8"])
def test_the_lm_reads_its_positional_rows_from_the_file_not_linear_pos(
    model: Path, lm_int8: bool
) -> None:
    """The rows are mapped from the prepared file; a synthesis within them never reads
    linear_pos (poisoned here: the audio is the same)."""
    engine = load(model, lm_int8=lm_int8)
    expected = synthesize_all(engine, "Hello there.", _OPTIONS)
    file = (model / PREPARED_DIR / f"llm.{'int8' if lm_int8 else 'fp32'}.safetensors").resolve()
    ranges = _mapped_ranges(file)
    for name, attention in _causal_attentions(engine.models.llm).items():
        rows = attention.pos_rows
        assert rows is not None, name
        assert any(start <= rows.data_ptr() < end for start, end in ranges), name
        weight = attention.linear_pos.weight
        attention.linear_pos.weight = torch.nn.Parameter(
            torch.full_like(weight, float("nan")), requires_grad=False
        )
    assert torch.equal(synthesize_all(engine, "Hello there.", _OPTIONS), expected)


def test_a_second_load_uses_the_prepared_files(model: Path) -> None:
    first = load(model, lm_int8=True)
    assert first.prepared_at_load == ("llm.int8", "flow.fp32", "hift.fp32")
    written = {p.name: p.stat().st_mtime_ns for p in (model / PREPARED_DIR).iterdir()}
    second = load(model, lm_int8=True)
    assert second.prepared_at_load == ()
    assert {p.name: p.stat().st_mtime_ns for p in (model / PREPARED_DIR).iterdir()} == written


def test_a_changed_checkpoint_is_prepared_again(
    model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    load(model)
    checkpoint = model / "flow.pt"
    st = checkpoint.stat()
    os.utime(checkpoint, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    with caplog.at_level(logging.INFO, logger="engine.core.prepared"):
        engine = load(model)
    assert engine.prepared_at_load == ("flow.fp32",)
    assert "Preparing flow.fp32" in caplog.text and "source_mtime_ns" in caplog.text
    assert load(model).prepared_at_load == ()


def test_another_torch_version_prepares_again(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    load(model)
    monkeypatch.setattr(torch, "__version__", "0.0.0+elsewhere")
    assert load(model).prepared_at_load == ("llm.fp32", "flow.fp32", "hift.fp32")


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbled header":
        path.write_bytes(data[:8] + b"#" * 32 + data[40:])
    else:  # the right key, but tensors that do not fit the model
        tensors, key = stored(path)
        if how == "tensor missing":
            del tensors["llm_decoder.weight_scale"]
        else:
            tensors["llm_decoder.weight"] = tensors["llm_decoder.weight"][:-1].clone()
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, path, metadata=key)


@pytest.mark.parametrize("how", ["truncated", "garbled header", "tensor missing", "wrong shape"])
def test_a_damaged_file_is_rebuilt_with_a_warning(
    model: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    expected = synthesize_all(load(model, lm_int8=True), "Hello there.", _OPTIONS)
    path = model / PREPARED_DIR / "llm.int8.safetensors"
    _damage(path, how)
    with caplog.at_level(logging.WARNING):
        engine = load(model, lm_int8=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0] and "damaged" in warnings[0]
    assert engine.prepared_at_load == ("llm.int8",)
    assert torch.equal(synthesize_all(engine, "Hello there.", _OPTIONS), expected)
    assert load(model, lm_int8=True).prepared_at_load == ()


_OPTIONS = SynthesisOptions(stream=True, seed=3, force_tokens=30, n_timesteps=2)


def _reference(model: Path, lm_int8: bool, flow_int8: bool, hift_bf16: bool) -> CosyVoiceEngine:
    """The engine's models as loaded straight from the checkpoints, with the same run-time
    choices as the engine's load (int8 layers, bfloat16 HiFT, oneDNN layers)."""
    models = load_model_dir(model)
    if lm_int8:
        quantize_lm_int8(models.llm)
    if flow_int8:
        quantize_flow_int8(models.flow)
    if hift_bf16:
        models.hift.use_bfloat16()
    use_onednn_convs(models.flow.decoder.estimator)
    if not flow_int8:
        use_onednn_linears(models.flow.decoder.estimator, TransformerBlock)
    return CosyVoiceEngine(models, threads=1)


@pytest.mark.parametrize(
    ("lm_int8", "flow_int8", "hift_bf16"),
    [(False, False, False), (True, True, False), (True, False, True)],
)
def test_prepared_models_compute_what_the_checkpoints_compute(
    model: Path, lm_int8: bool, flow_int8: bool, hift_bf16: bool
) -> None:
    engine = load(model, lm_int8=lm_int8, flow_int8=flow_int8, hift_bf16=hift_bf16)
    reference = _reference(model, lm_int8, flow_int8, engine.hift_dtype == "bfloat16")
    for text in ("Hello there.", "你好，世界。"):
        audio = synthesize_all(engine, text, _OPTIONS)
        assert audio.numel() > 0
        assert torch.equal(audio, synthesize_all(reference, text, _OPTIONS)), text


def test_a_read_only_model_directory_prepares_into_the_cache_dir(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = prepared.write_prepared

    def read_only_model_dir(path: Path, *args: object, **kwargs: object) -> None:
        if model in path.parents:
            raise PermissionError(13, "Permission denied", str(path))
        write(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prepared, "write_prepared", read_only_model_dir)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    engine = CosyVoiceEngine.load(model, threads=1)
    assert engine.prepared_at_load == ("llm.fp32", "flow.fp32", "hift.fp32")
    assert not (model / PREPARED_DIR).exists()
    cache = prepared_dirs(model)[1]
    assert cache.parent == tmp_path / "xdg" / "cosyvoice-engine"  # a name that fits any caller
    assert sorted(p.name for p in cache.iterdir()) == [
        "flow.fp32.safetensors",
        "hift.fp32.safetensors",
        "llm.fp32.safetensors",
    ]
    assert CosyVoiceEngine.load(model, threads=1).prepared_at_load == ()


def _mappings(path: Path) -> int:
    """How many mappings of ``path`` this process holds (from /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if line.rstrip("\n").endswith(str(path)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_a_mapping_that_served_replaced_weights_is_dropped(model: Path) -> None:
    """oneDNN re-lays the estimator's weights out as copies: the mapping the load read them
    through goes (with its pages), and what the flow still reads is mapped afresh."""
    loading = PreparedLoad(model, WeightFormats(), model.parent / "cache", PARTS)
    models = loaded_models(loading)
    flow_at_load = models.flow.input_embedding.weight.data_ptr()
    llm_at_load = models.llm.text_embedding.weight.data_ptr()
    assert use_onednn_convs(models.flow.decoder.estimator) > 0  # replaced at load, as the engine
    loading.finish()
    flow_file = (model / PREPARED_DIR / "flow.fp32.safetensors").resolve()
    assert models.flow.input_embedding.weight.data_ptr() != flow_at_load
    checkpoint = torch.load(model / "flow.pt", weights_only=True)
    assert torch.equal(models.flow.input_embedding.weight, checkpoint["input_embedding.weight"])
    assert _mappings(flow_file) == 1
    # Nothing of the LM was replaced: it keeps the mapping it was loaded through.
    assert models.llm.text_embedding.weight.data_ptr() == llm_at_load


@pytest.fixture(params=["chosen", "qnnpack"])
def int8_kernels(request: pytest.FixtureRequest) -> Iterator[str]:
    """The int8 kernels the engine picks on this CPU, and QNNPACK (aarch64's) where torch has it:
    the engine keeps the one in force when it works."""
    before = torch.backends.quantized.engine
    if request.param != "chosen":
        if request.param not in torch.backends.quantized.supported_engines:
            pytest.skip(f"this torch build has no {request.param} kernels")
        torch.backends.quantized.engine = request.param
    yield request.param
    torch.backends.quantized.engine = before


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_the_mappings_int8_layers_were_packed_from_are_dropped(
    model: Path, int8_kernels: str
) -> None:
    """Packed layers are copies: what stays mapped of the int8 file is the load's one mapping,
    for the float tensors the model reads in place."""
    engine = load(model, lm_int8=True, flow_int8=True)
    if int8_kernels != "chosen":
        assert torch.backends.quantized.engine == int8_kernels
    assert any(isinstance(m, INT8_LINEAR_TYPES) for m in engine.models.llm.modules())
    for name in ("llm.int8.safetensors", "flow.int8.safetensors"):
        assert _mappings((model / PREPARED_DIR / name).resolve()) == 1, name


def test_the_prepare_command_reports_a_bad_model_dir_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    incomplete = tmp_path / "incomplete"
    shutil.copytree(TINY_MODEL, incomplete, ignore=shutil.ignore_patterns(PREPARED_DIR))
    (incomplete / "llm.pt").unlink()
    for model_dir, expected in ((tmp_path / "nowhere", "does not exist"), (incomplete, "llm.pt")):
        caplog.clear()
        assert main(["prepare", "--model-dir", str(model_dir)]) == 2
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and expected in errors[0] and "\n" not in errors[0]
