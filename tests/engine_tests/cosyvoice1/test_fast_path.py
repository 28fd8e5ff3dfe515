"""Fast-path options: guidance off runs one batch row; deviations are measured, not assumed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import DATA

from engine.bench.deviation import lm_int8_kl, mel_relative_l2
from engine.cosyvoice1.model_dir import load_model_dir


@pytest.fixture(scope="module")
def models():
    return load_model_dir(DATA / "tiny_model")


def test_guidance_off_equals_the_conditional_row(models) -> None:
    """cfg_rate 0 skips the unconditional row; the result is the CFG-0 combination."""
    seen_rows: list[int] = []
    tokens = torch.randint(0, 4096, (1, 50), generator=torch.Generator().manual_seed(1))
    emb = models.speakers["中文女"].reshape(1, -1)
    z = torch.randn(1, 80, 86, generator=torch.Generator().manual_seed(2))
    empty_tokens, empty_feat = torch.zeros(1, 0, dtype=torch.int64), torch.zeros(1, 0, 80)
    with torch.inference_mode():
        fast, _ = models.flow.inference(
            tokens,
            empty_tokens,
            empty_feat,
            emb,
            None,
            noise=z.clone(),
            n_timesteps=3,
            cfg_rate=0.0,
            step_callback=lambda step, x, t, dphi: seen_rows.append(dphi.shape[0]),
        )
        # The same maths through the batch-2 path: a tiny rate keeps the second row alive.
        slow, _ = models.flow.inference(
            tokens,
            empty_tokens,
            empty_feat,
            emb,
            None,
            noise=z.clone(),
            n_timesteps=3,
            cfg_rate=1e-12,
        )
    assert seen_rows == [1, 1, 1]
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_fewer_steps_move_the_mel_measurably(models) -> None:
    emb = models.speakers["中文女"].reshape(1, -1)
    exact = mel_relative_l2(models.flow, emb, n_timesteps=10, cfg_rate=0.7, n_tokens=40)
    five = mel_relative_l2(models.flow, emb, n_timesteps=5, cfg_rate=0.7, n_tokens=40)
    no_cfg = mel_relative_l2(models.flow, emb, n_timesteps=10, cfg_rate=0.0, n_tokens=40)
    assert exact == 0.0
    assert 0.0 < five < 1.0 and 0.0 < no_cfg < 1.0


def test_int8_kl_is_reported(models) -> None:
    emb = models.speakers["中文女"].reshape(1, -1)
    kl = lm_int8_kl(models.llm, [50260, 1234, 567], emb, n_steps=10)
    assert 0.0 < kl["lm_int8_kl_mean"] <= kl["lm_int8_kl_max"] < 1e-2


def test_the_engine_runs_hift_in_bfloat16_only_where_the_cpu_supports_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from engine.bench.deviation import hift_relative_l2, random_tokens_mel
    from engine.core import cpu
    from engine.cosyvoice1.engine import CosyVoiceEngine

    model, cache = DATA / "tiny_model", tmp_path / "cache"
    exact = CosyVoiceEngine.load(model, cache_dir=cache)
    assert exact.hift_dtype == "float32"
    if cpu.bf16_native():
        approx = CosyVoiceEngine.load(model, hift_bf16=True, cache_dir=cache)
        assert approx.hift_dtype == "bfloat16"
        embedding = exact.models.speakers[exact.speakers[0]].reshape(1, -1)
        mel = random_tokens_mel(
            exact.models.flow, embedding, n_timesteps=2, cfg_rate=0.7, n_tokens=30
        )
        assert 0 < hift_relative_l2(approx.models.hift, exact.models.hift, mel) < 0.05
    monkeypatch.setattr(cpu, "bf16_native", lambda: False)
    with caplog.at_level(logging.WARNING):
        fallback = CosyVoiceEngine.load(model, hift_bf16=True, cache_dir=cache)
    assert fallback.hift_dtype == "float32"
    assert "no fast bfloat16 convolutions" in caplog.text
