"""``python -m engine.bench --synthetic cosyvoice3``: the synthetic Fun-CosyVoice3 directory has
the released files' keys and shapes, loads, and speaks the forced number of tokens; a run on the
tiny model reports every stage, the work and the int8 formats' deviations (no timed
assertions: timings are machine facts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TESTS
from test_bench import REQUIRED_FIELDS, run_bench_json

from engine.bench.synthetic import COSYVOICE3_FILES, ensure_synthetic_cosyvoice3, family_specs
from engine.bench.timers import FIRST_AUDIO_PARTS
from engine.cosyvoice3.flow import ROTARY_KEY
from engine.cosyvoice3.model_dir import load_model_dir

DATA = TESTS / "data" / "cosyvoice3"
TINY = DATA / "tiny"


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """No oversubscription of the shared cores."""


def test_synthetic_cosyvoice3_has_the_released_files_layout() -> None:
    """Keys and shapes of the official modules (the flow without the rotary frequencies the
    engine computes; HiFT's weight norm in the parametrizations layout the official code
    writes)."""
    manifest = json.loads((DATA / "manifest_full.json").read_text(encoding="utf-8"))
    specs = family_specs(COSYVOICE3_FILES, DATA / "cosyvoice3_0.5b.yaml", manifest["qwen2_config"])
    for part in ("llm", "flow", "hift"):
        expected = {e["key"]: e["shape"] for e in manifest["modules"][part]["state_dict"]}
        expected.pop(ROTARY_KEY, None)
        assert {k: list(v) for k, v in specs[f"{part}.pt"].items()} == expected, part


def test_synthetic_cosyvoice3_loads_and_speaks_the_forced_count(tmp_path: Path) -> None:
    backbone = json.loads((TINY / "CosyVoice-BlankEN" / "config.json").read_text())
    model_dir = ensure_synthetic_cosyvoice3(tmp_path, TINY / "cosyvoice3.yaml", backbone)
    assert model_dir.name == "Fun-CosyVoice3-0.5B"
    hift = torch.load(model_dir / "hift.pt", weights_only=True)
    assert any(k.endswith(".parametrizations.weight.original0") for k in hift)
    assert not any(k.endswith(".weight_g") for k in hift)
    models = load_model_dir(model_dir)
    generator = torch.Generator().manual_seed(0)
    tokens = list(models.llm.generate([1, 2, 3], generator=generator, max_tokens=150))
    assert len(tokens) == 150
    stamp = (model_dir / "llm.pt").stat().st_mtime_ns
    again = ensure_synthetic_cosyvoice3(tmp_path, TINY / "cosyvoice3.yaml", backbone)
    assert again == model_dir and (model_dir / "llm.pt").stat().st_mtime_ns == stamp


@pytest.mark.long
# The benchmark measures the machine's bandwidth and GEMM rates first: minutes when the cores
# are shared.
@pytest.mark.timeout(900)
def test_benchmark_reports_every_stage_of_the_int8_tiny_cosyvoice3(tmp_path: Path) -> None:
    """The int8 LM, DiT and causal HiFT load from their prepared files; the streamed HiFT is
    timed (it makes audio without ``inference``), the work counted, each format's deviation
    measured against the float32 models."""
    model_dir = tmp_path / "Fun-CosyVoice3-0.5B"
    shutil.copytree(TINY, model_dir)
    result = run_bench_json(
        *("--repeats", "1", "--threads", "1", "--tokens", "40"),
        *("--flow-weights", "int8", "--hift-weights", "int8"),
        timeout=600,
        model_dir=model_dir,
    )
    missing = [key for key in REQUIRED_FIELDS if result.get(key) is None]
    assert not missing, f"fields missing or null: {missing}"
    assert (result["flow_weights"], result["hift_weights"]) == ("int8", "int8")
    run = result["runs"][0]
    assert sum(run[key] for key in FIRST_AUDIO_PARTS) == pytest.approx(run["first_audio_ms"])
    assert result["hift_ms_per_audio_s"] > 0 and result["hift_gflop_per_audio_s"] > 0
    assert result["estimator_mflop_per_frame_step"] > 0
    assert result["mel_rel_l2_vs_exact"] > 0 and result["wave_rel_l2_vs_exact_hift"] > 0
    assert result["lm_int8_kl_mean"] > 0
