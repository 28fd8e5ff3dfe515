"""The on-disk cache of the int8 LM weights (engine.quantize.Int8Loader) on the tiny model.

Every test copies the tiny model into its tmp_path and passes ``int8_cache_dir`` explicitly, so
nothing is written outside tmp_path (and touching ``llm.pt`` never changes the repository).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import struct
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import synthesize_all

from engine.checkpoint_index import index_path
from engine.cpu import capped_threads, thread_ceiling
from engine.engine import CosyVoiceEngine
from engine.quantize import cache_path, default_int8_cache_dir
from engine.types import ModelLoadError
from engine.weights import CHECKPOINT_FILES

TINY = Path(__file__).parent / "data" / "tiny_model"
FORCED = [3, 7, 9, 11, 5]


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Tiny tensors: a second thread only contends."""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    target = tmp_path / "tiny_model"
    shutil.copytree(TINY, target)
    return target


def logits(engine: CosyVoiceEngine) -> torch.Tensor:
    """Prefill and teacher-forced decode steps through the (int8) LM decoder."""
    llm = engine.models.llm
    embedding = torch.randn(1, 192, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        lm_input = llm.build_input([11, 22, 33, 44], embedding=embedding)
        cache = llm.new_cache(lm_input.shape[1] + len(FORCED))
        outs = [llm.prefill(lm_input, cache).logits]
        outs += [llm.decode_step(token, cache).logits for token in FORCED]
    return torch.cat(outs)


@pytest.fixture(scope="module")
def reference(single_torch_thread: None) -> torch.Tensor:
    """Logits of the LM quantised by torch's own ``quantize_dynamic``, no cache involved."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    engine = CosyVoiceEngine.load(TINY)
    llm = engine.models.llm
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for parent in [*llm.text_encoder.encoders, *llm.llm.encoders, llm]:
            names = (
                ["llm_decoder"]
                if parent is llm
                else [
                    n
                    for n, m in parent.named_modules()
                    if isinstance(m, torch.nn.Linear) and not n.endswith("linear_pos")
                ]
            )
            quantize_dynamic(
                parent,
                dict.fromkeys(names, per_channel_dynamic_qconfig),
                dtype=torch.qint8,
                inplace=True,
            )
    return logits(engine)


def load(model: Path, cache_dir: Path) -> CosyVoiceEngine:
    return CosyVoiceEngine.load(model, lm_int8=True, int8_cache_dir=cache_dir)


def warnings_of(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


@pytest.fixture
def cached(model: Path, tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """(cache dir, cache file) after a first load that wrote the cache."""
    cache_dir = tmp_path / "cache"
    assert load(model, cache_dir).lm_int8_cache_hit is False
    yield cache_dir, cache_path(cache_dir, model / "llm.pt")


def test_miss_writes_the_cache_and_a_hit_gives_identical_logits(
    model: Path, tmp_path: Path, reference: torch.Tensor, caplog: pytest.LogCaptureFixture
) -> None:
    cache_dir = tmp_path / "cache"
    caplog.set_level(logging.INFO)
    fresh = load(model, cache_dir)
    assert fresh.lm_int8_cache_hit is False
    # No temp file left behind; beside the int8 layers, the checkpoints' indexes.
    files = sorted(p for p in cache_dir.iterdir() if not p.name.endswith(".index.json"))
    assert files == [cache_path(cache_dir, model / "llm.pt")]
    assert sorted(index_path(cache_dir, model / name).name for name in CHECKPOINT_FILES) == sorted(
        p.name for p in cache_dir.iterdir() if p.name.endswith(".index.json")
    )
    assert torch.equal(logits(fresh), reference)  # the fresh path is quantize_dynamic's recipe

    hit = load(model, cache_dir)
    assert hit.lm_int8_cache_hit is True
    assert torch.equal(logits(hit), reference)
    assert warnings_of(caplog) == ""
    obj = torch.load(files[0], weights_only=True, mmap=True)  # plain tensors only
    assert obj["meta"]["source"] == str((model / "llm.pt").resolve())


def test_a_hit_never_uses_the_float_weights_of_the_int8_layers(
    cached: tuple[Path, Path], model: Path, reference: torch.Tensor
) -> None:
    # Same size and mtime, but the float32 decoder weights are NaN: a hit must not notice.
    llm_pt = model / "llm.pt"
    st = llm_pt.stat()
    state = torch.load(llm_pt, weights_only=True)
    for key, value in state.items():
        if (
            key.startswith(("llm.encoders.", "llm_decoder."))
            and "linear_pos" not in key
            and key.endswith(".weight")
            and value.dim() == 2
        ):
            value.fill_(float("nan"))
    torch.save(state, llm_pt)
    # The premise: a change the cache's size+mtime key cannot see.
    assert llm_pt.stat().st_size == st.st_size, "torch.save wrote a different size"
    os.utime(llm_pt, ns=(st.st_atime_ns, st.st_mtime_ns))
    engine = load(model, cached[0])
    assert engine.lm_int8_cache_hit is True
    assert torch.equal(logits(engine), reference)


def test_loads_restore_the_torch_thread_count(
    cached: tuple[Path, Path], model: Path, tmp_path: Path
) -> None:
    # The load runs on one torch thread while the int8 layers are packed; a server left on one
    # thread afterwards would vocode at half speed. Also when the load fails. (Within the
    # CPU's thread ceiling: where more threads crash, the load caps them.)
    before = torch.get_num_threads()
    expect = capped_threads(2, thread_ceiling())
    try:
        torch.set_num_threads(2)
        assert load(model, cached[0]).lm_int8_cache_hit is True
        assert torch.get_num_threads() == expect
        with pytest.raises(ModelLoadError):
            load(tmp_path / "missing", cached[0])
        assert torch.get_num_threads() == expect
    finally:
        torch.set_num_threads(before)


def test_a_stale_cache_is_rebuilt(
    cached: tuple[Path, Path],
    model: Path,
    reference: torch.Tensor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache_dir, cache_file = cached
    st = (model / "llm.pt").stat()
    os.utime(model / "llm.pt", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    engine = load(model, cache_dir)
    assert engine.lm_int8_cache_hit is False
    assert "stale" in warnings_of(caplog) and "mtime_ns" in warnings_of(caplog)
    assert torch.equal(logits(engine), reference)
    meta = torch.load(cache_file, weights_only=True, mmap=True)["meta"]
    assert meta["mtime_ns"] == st.st_mtime_ns + 1_000_000_000  # rewritten under the new key
    assert load(model, cache_dir).lm_int8_cache_hit is True


def _largest_record(path: Path) -> tuple[int, int]:
    """(offset, size) of the largest tensor record's bytes inside the zip file."""
    with zipfile.ZipFile(path) as archive:
        info = max(archive.infolist(), key=lambda i: i.file_size)
    with path.open("rb") as f:
        f.seek(info.header_offset)
        name_len, extra_len = struct.unpack("<HH", f.read(30)[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def _flip_a_weight_byte(path: Path) -> None:
    offset, size = _largest_record(path)
    data = bytearray(path.read_bytes())
    data[offset + size // 2] ^= 0x55
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garbage(path: Path) -> None:
    path.write_bytes(os.urandom(4096))


def _foreign(path: Path) -> None:
    torch.save({"weight": torch.zeros(3)}, path)  # a valid torch file, but not our cache


@pytest.mark.parametrize(
    "damage",
    [_flip_a_weight_byte, _truncate, _garbage, _foreign],
    ids=["flipped-byte", "truncated", "garbage", "foreign"],
)
def test_a_damaged_cache_is_rebuilt_with_a_warning(
    damage,
    cached: tuple[Path, Path],
    model: Path,
    reference: torch.Tensor,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cache_dir, cache_file = cached
    damage(cache_file)
    engine = load(model, cache_dir)
    assert engine.lm_int8_cache_hit is False
    assert "not used" in warnings_of(caplog)
    assert torch.equal(logits(engine), reference)
    assert load(model, cache_dir).lm_int8_cache_hit is True  # rebuilt


def test_an_unwritable_cache_dir_still_loads(
    model: Path, tmp_path: Path, reference: torch.Tensor, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # its "subdirectory" cannot be created, even by root
    engine = load(model, blocker / "int8")
    assert engine.lm_int8_cache_hit is False
    assert "Cannot write the int8 cache" in warnings_of(caplog)
    assert torch.equal(logits(engine), reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "tiny_model"]


def test_fp32_loads_write_only_the_checkpoint_indexes(model: Path, tmp_path: Path) -> None:
    engine = CosyVoiceEngine.load(model, int8_cache_dir=tmp_path / "cache")
    assert engine.lm_int8_cache_hit is None
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        index_path(tmp_path / "cache", model / name).name for name in CHECKPOINT_FILES
    )


def test_the_default_cache_dir_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_int8_cache_dir() == tmp_path / "wyoming-cosyvoice" / "int8"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # the XDG spec says: ignore it
    assert default_int8_cache_dir() == Path.home() / ".cache" / "wyoming-cosyvoice" / "int8"


def test_the_server_caches_under_its_download_dir(tmp_path: Path) -> None:
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.server import int8_cache_dir

    config = load_config(None, [("server.data_dirs", [str(tmp_path)])])
    assert int8_cache_dir(config) == tmp_path / ".cache" / "int8"
    missing = load_config(None, [("server.data_dirs", [str(tmp_path / "missing")])])
    assert int8_cache_dir(missing) is None  # no data dir is created just for a cache


@pytest.mark.parametrize(("profile", "flow_int8"), [("realtime", False), ("fastest", True)])
def test_the_server_loads_the_flow_in_its_profiles_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, profile: str, flow_int8: bool
) -> None:
    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.server import host_for_config

    config = load_config(None, [("server.profile", profile), ("server.warmup", False)])
    loaded: list[dict[str, object]] = []

    def engine_load(model_dir: Path, **options: object) -> object:
        loaded.append(options)
        raise ModelLoadError("stop here")  # only the options matter

    async def build_and_load() -> None:  # the host wants a running event loop
        host = host_for_config(config, tmp_path)
        try:
            with pytest.raises(ModelLoadError):
                host._factory(tmp_path, None)
        finally:
            host.shutdown()

    monkeypatch.setattr(CosyVoiceEngine, "load", engine_load)
    asyncio.run(build_and_load())
    assert loaded and loaded[0]["flow_int8"] is flow_int8 and loaded[0]["lm_int8"] is True


@pytest.fixture
def arm_quantized_engine() -> Iterator[str]:
    """Torch's int8 kernels on aarch64 (the add-on's other platform) are QNNPACK's, not fbgemm's.

    x86 builds ship QNNPACK too, so the packing and the int8 layers the Raspberry Pi runs are
    tested here as well.
    """
    if "qnnpack" not in torch.backends.quantized.supported_engines:
        pytest.skip("this torch build has no QNNPACK")
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = "qnnpack"
    yield before  # the engine the module's ``reference`` logits were computed with
    torch.backends.quantized.engine = before


def test_the_int8_lm_and_flow_work_on_the_arm_engine(
    arm_quantized_engine: str, model: Path, tmp_path: Path, reference: torch.Tensor
) -> None:
    from engine.quantize import next_token_kl
    from engine.types import SynthesisOptions

    cache_dir = tmp_path / "cache"
    for expect_hit in (False, True):  # packed from fresh weights, then from the cache
        engine = CosyVoiceEngine.load(model, lm_int8=True, flow_int8=True, int8_cache_dir=cache_dir)
        assert engine.lm_int8_cache_hit is expect_hit
        assert engine.flow_int8_cache_hit is expect_hit
        # Same int8 weights as fbgemm's path, other activation rounding: close, not equal
        # (equal on aarch64, where the reference was computed with QNNPACK too).
        kl = next_token_kl(reference, logits(engine))
        assert kl.max() <= 1e-2, kl
        assert kl.max() > 0 or arm_quantized_engine == "qnnpack", "QNNPACK did not run"
        options = SynthesisOptions(stream=True, seed=0, force_tokens=30, n_timesteps=2)
        audio = synthesize_all(engine, "Hello there.", options)
        assert audio.numel() > 0 and torch.isfinite(audio).all() and audio.abs().max() > 0
