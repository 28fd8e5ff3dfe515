"""``python -m engine.bench`` on CosyVoice2: the synthetic full-size model's layout, a synthetic
model that runs to the forced token count, and a run on the tiny model that reports v1's fields
(no timed assertions: timings are machine facts)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from test_bench import REQUIRED_FIELDS, run_bench_json

from engine.bench.synthetic import (
    COSYVOICE2_STOP_CLASSES,
    EOS_BIAS,
    cosyvoice2_specs,
    ensure_synthetic_cosyvoice2,
)
from engine.bench.timers import FIRST_AUDIO_PARTS
from engine.bench.work import lm_weight_bytes_per_token
from engine.cosyvoice2.model_dir import load_model_dir

DATA = ROOT / "tests" / "data" / "cosyvoice2"
TINY = DATA / "tiny"


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """No oversubscription of the shared cores."""


def test_synthetic_cosyvoice2_has_the_released_files_layout() -> None:
    """Keys and shapes equal the released files' (HiFT's weight norm in the parametrizations
    layout the official code writes)."""
    manifest = json.loads((DATA / "manifest_full.json").read_text(encoding="utf-8"))
    specs = cosyvoice2_specs(DATA / "cosyvoice2_0.5b.yaml", manifest["qwen2_config"])
    for part in ("llm", "flow", "hift"):
        expected = {e["key"]: e["shape"] for e in manifest["modules"][part]["state_dict"]}
        assert {k: list(v) for k, v in specs[f"{part}.pt"].items()} == expected, part


def test_synthetic_cosyvoice2_runs_to_the_forced_token_count(tmp_path: Path) -> None:
    """The generator on the tiny config: the engine loads it, and sampling never draws one of
    the three stop tokens, so the LM makes exactly the forced number of tokens."""
    backbone = json.loads((TINY / "CosyVoice-BlankEN" / "config.json").read_text())
    model_dir = ensure_synthetic_cosyvoice2(tmp_path, TINY / "cosyvoice2.yaml", backbone)
    state = torch.load(model_dir / "llm.pt", weights_only=True)
    assert (state["llm_decoder.bias"][-COSYVOICE2_STOP_CLASSES:] == EOS_BIAS).all()
    assert state["llm_decoder.bias"][-COSYVOICE2_STOP_CLASSES - 1] != EOS_BIAS
    hift = torch.load(model_dir / "hift.pt", weights_only=True)
    assert any(k.endswith(".parametrizations.weight.original0") for k in hift)
    assert not any(k.endswith(".weight_g") for k in hift)
    models = load_model_dir(model_dir)
    generator = torch.Generator().manual_seed(0)
    tokens = list(models.llm.generate([1, 2, 3], generator=generator, max_tokens=150))
    assert len(tokens) == 150
    stamp = (model_dir / "llm.pt").stat().st_mtime_ns
    again = ensure_synthetic_cosyvoice2(tmp_path, TINY / "cosyvoice2.yaml", backbone)
    assert again == model_dir and (model_dir / "llm.pt").stat().st_mtime_ns == stamp


def test_lm_weight_bytes_leave_out_the_unused_text_head() -> None:
    # Every float32 weight of the Qwen2 stack (its blocks and final norm) and of the speech-token
    # head; not the text embedding (a step reads one row) nor the backbone's text head.
    models = load_model_dir(TINY)
    backbone = models.llm.backbone
    stack = sum(p.numel() for p in backbone.parameters())
    stack -= backbone.embed_tokens.weight.numel()
    head = models.llm.llm_decoder
    expected = 4 * (stack + head.weight.numel() + head.bias.numel())
    assert lm_weight_bytes_per_token(models.llm) == expected


@pytest.mark.long
def test_benchmark_runs_on_the_tiny_cosyvoice2(tmp_path: Path) -> None:
    """A prompt voice of 5 s; the first chunk is one attention chunk plus the look-ahead; the
    default token count is 8 s at 25 tokens a second; the stream's flow cost per chunk is
    reported for every chunk."""
    model_dir = tmp_path / "CosyVoice2-0.5B"
    shutil.copytree(TINY, model_dir)
    # The LM in int8, as served.
    result = run_bench_json("--repeats", "1", "--threads", "1", timeout=600, model_dir=model_dir)
    missing = [key for key in REQUIRED_FIELDS if result.get(key) is None]
    assert not missing, f"fields missing or null: {missing}"
    assert result["tokens"] == 200 and result["audio_s"] == pytest.approx(8.0)
    run = result["runs"][0]
    # the default first hop (21 units of 20 ms: 11 tokens) and the 3-token look-ahead
    assert run["first_chunk_tokens"] == 11 + 3
    assert sum(run[key] for key in FIRST_AUDIO_PARTS) == pytest.approx(run["first_audio_ms"])
    assert len(result["stream_flow_ms_per_audio_s_by_chunk"]) == result["chunks"]
    assert result["lm_int8_kl_mean"] > 0  # the int8 LM was compared with the float32 one
