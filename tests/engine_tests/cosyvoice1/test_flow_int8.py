"""The opt-in int8 flow (``flow_weights: int8``, the fast profiles) on the tiny model.

Every test that loads through the engine copies the tiny model into its tmp_path, where its
prepared files are written, so nothing is written outside tmp_path.
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DATA
from torch import nn

from engine.core.constants import N_MELS, tokens_to_frames
from engine.core.prepared import PREPARED_DIR
from engine.core.quantize import Int8Linear, flow_int8_layer_names, quantize_flow_int8
from engine.cosyvoice1.engine import CosyVoiceEngine
from engine.cosyvoice1.model_dir import load_model_dir

TINY = DATA / "tiny_model"


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Tiny tensors: a second thread only contends."""


@pytest.fixture(scope="module")
def fp32_flow() -> nn.Module:
    return load_model_dir(TINY).flow


def mel(flow: nn.Module, n_tokens: int = 30) -> torch.Tensor:
    """10 steps with guidance (the exact settings), fixed tokens, speaker and noise."""
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, flow.input_embedding.num_embeddings, (1, n_tokens), generator=gen)
    noise = torch.randn(1, N_MELS, tokens_to_frames(n_tokens), generator=gen)
    embedding = torch.randn(1, 192, generator=gen)
    with torch.inference_mode():
        out, _ = flow.inference(
            tokens,
            torch.zeros(1, 0, dtype=torch.int64),
            torch.zeros(1, 0, N_MELS),
            embedding,
            None,
            noise=noise,
            n_timesteps=10,
            cfg_rate=0.7,
        )
    return out


def test_the_encoder_blocks_and_every_estimator_linear_are_quantised(fp32_flow: nn.Module) -> None:
    names = flow_int8_layer_names(fp32_flow)
    flow = quantize_flow_int8(copy.deepcopy(fp32_flow))
    assert all(isinstance(flow.get_submodule(name), Int8Linear) for name in names)
    estimator_floats = [
        n for n, m in flow.decoder.estimator.named_modules() if isinstance(m, nn.Linear)
    ]
    assert estimator_floats == []
    for block in flow.encoder.encoders:
        attention = block.self_attn
        assert isinstance(attention.linear_qkv, Int8Linear)  # q, k, v fused as in the LM
        assert type(attention.linear_pos) is nn.Linear  # applied to the positional table
    # Outside the blocks and the estimator: small layers, left float32.
    assert type(flow.encoder_proj) is nn.Linear


def test_int8_flow_mel_stays_close_to_float32(fp32_flow: nn.Module) -> None:
    reference = mel(fp32_flow)
    int8 = mel(quantize_flow_int8(copy.deepcopy(fp32_flow)))
    deviation = float((int8 - reference).norm() / reference.norm())
    # Measured 0.020 here (0.006-0.008 on the full-size model); 0 would mean nothing changed.
    assert 0 < deviation < 0.05


@pytest.fixture
def model(tmp_path: Path) -> Path:
    target = tmp_path / "tiny_model"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    return target


def load(model: Path, **weights: bool) -> CosyVoiceEngine:
    return CosyVoiceEngine.load(model, flow_int8=True, cache_dir=model.parent / "cache", **weights)


def test_the_int8_flow_is_prepared_once_and_gives_the_same_mel(model: Path) -> None:
    fresh = load(model)
    assert fresh.prepared_at_load == ("llm.fp32", "flow.int8", "hift.fp32")
    again = load(model)
    assert again.prepared_at_load == ()
    assert torch.equal(mel(again.models.flow), mel(fresh.models.flow))

    both = load(model, lm_int8=True)
    assert both.prepared_at_load == ("llm.int8",)
    assert sorted(p.name for p in (model / PREPARED_DIR).iterdir()) == [
        "flow.int8.safetensors",
        "hift.fp32.safetensors",
        "llm.fp32.safetensors",
        "llm.int8.safetensors",
    ]


def test_a_prepared_load_never_reads_the_float_checkpoint(model: Path) -> None:
    expected = mel(load(model).models.flow)
    # Same size and mtime, but the float32 estimator weights are NaN: the load must not notice.
    flow_pt = model / "flow.pt"
    st = flow_pt.stat()
    state = torch.load(flow_pt, weights_only=True)
    poisoned = 0
    for key, value in state.items():
        if key.startswith("decoder.estimator.") and key.endswith(".weight") and value.dim() == 2:
            value.fill_(float("nan"))
            poisoned += 1
    assert poisoned
    torch.save(state, flow_pt)
    # The premise: a change the prepared file's size+mtime key cannot see.
    assert flow_pt.stat().st_size == st.st_size, "torch.save wrote a different size"
    os.utime(flow_pt, ns=(st.st_atime_ns, st.st_mtime_ns))
    engine = load(model)
    assert engine.prepared_at_load == ()
    assert torch.equal(mel(engine.models.flow), expected)
