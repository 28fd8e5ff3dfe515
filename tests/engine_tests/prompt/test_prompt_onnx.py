"""ONNX plumbing with the tiny stand-in models, and the official zero-shot ``model_input``.

The tiny models (tests/data/zero_shot/onnx, README §4.1) have the real call signatures: CAM++
input 0 (1, T, 80) -> (1, 192); tokenizer inputs 0 (1, 128, T) float32 and 1 (1,) int32 ->
int64 (1, 1, T'). Parity target: the PRE (v1-release) frontend, ``frontend.pt: pre/*``.
"""

from __future__ import annotations

import builtins
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TESTS
from parity import EMBEDDING_ATOL, PROMPT_MEL_ATOL

from engine.prompt.audio import load_prompt_16k
from engine.prompt.errors import PromptModelError
from engine.prompt.extract import (
    extract_features,
    model_input_cross_lingual,
    model_input_zero_shot,
)
from engine.prompt.onnx_models import PromptModels
from engine.text.tokenizer import get_tokenizer

DATA = TESTS / "data" / "zero_shot"


pytestmark = pytest.mark.usefixtures("single_torch_thread")
ONNX = DATA / "onnx"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
TTS_TEXT = "CosyVoice is a multilingual voice generation model."


@pytest.fixture(scope="module")
def models() -> PromptModels:
    return PromptModels(ONNX / "tiny_campplus.onnx", ONNX / "tiny_speech_tokenizer_v1.onnx")


@pytest.fixture(scope="module")
def frontend_fx() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "frontend.pt", weights_only=True)


@pytest.fixture(scope="module")
def feat_fx() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "features.pt", weights_only=True)


@pytest.mark.parity
def test_campplus_embedding_equals_the_fixture(models, feat_fx, frontend_fx) -> None:
    emb = models.embedding(feat_fx["fbank/feat_cms"].unsqueeze(0))
    assert emb.dtype == torch.float32 and emb.shape == (1, 192)
    assert torch.allclose(emb, frontend_fx["onnx/campplus/output0"], atol=EMBEDDING_ATOL, rtol=0)


@pytest.mark.parity
def test_speech_tokens_equal_the_fixture_and_are_int32(models, feat_fx, frontend_fx) -> None:
    tokens = models.speech_tokens(feat_fx["whisper/log_mel"])
    assert tokens.dtype == torch.int32 and tokens.shape == (1, 125)  # (250 - 1)//2 + 1
    assert torch.equal(tokens.long(), frontend_fx["onnx/speech_tokenizer/output0"].reshape(1, -1))
    assert int(tokens.min()) >= 0 and int(tokens.max()) < 4096


def test_inputs_are_fed_by_position(models) -> None:
    # The stand-in's names are placeholders; positions are the contract.
    session = models._session(models.tokenizer_path)
    names = [i.name for i in session.get_inputs()]
    types = [i.type for i in session.get_inputs()]
    assert names == ["feats", "feats_length"] and types[1] == "tensor(int32)"


def _full_model_input(models: PromptModels, kind: str) -> dict[str, torch.Tensor]:
    wave_16k, _ = load_prompt_16k(DATA / "prompt16k_pcm16.wav")
    prompt = extract_features(wave_16k, models)
    tokenizer = get_tokenizer()  # the fixture passes both texts un-normalised
    text_ids = tokenizer.encode(TTS_TEXT)
    if kind == "zero_shot":
        return model_input_zero_shot(text_ids, tokenizer.encode(PROMPT_TEXT), prompt)
    return model_input_cross_lingual(text_ids, prompt)


@pytest.mark.parity
@pytest.mark.parametrize("kind", ["zero_shot", "cross_lingual"])
def test_model_input_reproduces_the_v1_release_frontend(models, frontend_fx, kind: str) -> None:
    ours = _full_model_input(models, kind)
    prefix = f"pre/{kind}/"
    expected = {k[len(prefix) :]: v for k, v in frontend_fx.items() if k.startswith(prefix)}
    assert sorted(ours) == sorted(expected)
    for key, want in expected.items():
        got = ours[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if key == "prompt_speech_feat":
            assert float((got - want).abs().max()) <= PROMPT_MEL_ATOL, key
        elif key.endswith("embedding"):
            assert torch.allclose(got, want, atol=EMBEDDING_ATOL, rtol=0), key
        else:
            assert torch.equal(got, want), key
    # v1: no 2:1 trimming; 125 tokens against 215 mel frames (22.05 kHz, not HEAD's 234).
    assert ours["flow_prompt_speech_token_len"].tolist() == [125]
    assert ours["prompt_speech_feat_len"].tolist() == [215]


def test_float_wav_gives_the_same_prompt(models) -> None:
    a = extract_features(load_prompt_16k(DATA / "prompt16k_pcm16.wav")[0], models)
    b = extract_features(load_prompt_16k(DATA / "prompt16k_float32.wav")[0], models)
    assert all(
        torch.equal(x, y) for x, y in zip(a.to_state().values(), b.to_state().values(), strict=True)
    )


def test_missing_model_files_are_clear_errors(tmp_path: Path) -> None:
    shutil.copy(ONNX / "tiny_campplus.onnx", tmp_path / "campplus.onnx")
    models = PromptModels.from_model_dir(tmp_path)
    with pytest.raises(PromptModelError, match="speech_tokenizer_v1.onnx"):
        models.speech_tokens(torch.zeros(1, 128, 10))
    (tmp_path / "speech_tokenizer_v1.onnx").write_bytes(b"not a model")
    with pytest.raises(PromptModelError, match="cannot load"):
        models.speech_tokens(torch.zeros(1, 128, 10))


def test_missing_onnxruntime_is_a_clear_error(monkeypatch) -> None:
    real_import = builtins.__import__

    def no_ort(name: str, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError("No module named 'onnxruntime'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ort)
    models = PromptModels(ONNX / "tiny_campplus.onnx", ONNX / "tiny_speech_tokenizer_v1.onnx")
    with pytest.raises(PromptModelError, match=r"pip install"):
        models.embedding(torch.zeros(1, 10, 80))


def test_tokenizer_refuses_more_than_30_s(models) -> None:
    with pytest.raises(PromptModelError, match="at most 30 s"):
        models.speech_tokens(torch.zeros(1, 128, 3001))
