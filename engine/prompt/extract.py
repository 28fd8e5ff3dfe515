"""One prompt recording -> the tensors of the v1 zero-shot frontend (v1-release behaviour).

Audio path (tests/data/zero_shot/README.md §5, "PRE"): the file is read, mixed to mono and
resampled to 16 kHz; CAM++ and the speech tokenizer read that 16 kHz signal, and the flow's prompt
mel is computed from it resampled 16k -> 22050 Hz. (Upstream's current code computes the v1 prompt
mel from 24 kHz audio: 93.75 frames/s where v1 was trained on 86.13, a regression we do not copy.)
No 2:1 token/frame trimming: that branch is CosyVoice2-only.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.constants import SAMPLE_RATE
from engine.prompt.audio import resample
from engine.prompt.features import campplus_input, prompt_mel, whisper_log_mel
from engine.prompt.onnx_models import PromptModels

_LOGGER = logging.getLogger(__name__)

PROMPT_RATE = 16000


@dataclass(frozen=True)
class PromptFeatures:
    """What a prompt recording contributes: x-vector, 50 Hz speech tokens, 22050 Hz mel."""

    embedding: torch.Tensor  # float32 (1, 192), raw CAM++ output (normalised inside the models)
    speech_tokens: torch.Tensor  # int32 (1, T')
    speech_feat: torch.Tensor  # float32 (1, T, 80)

    def to_state(self) -> dict[str, torch.Tensor]:
        return {
            "embedding": self.embedding,
            "speech_tokens": self.speech_tokens,
            "speech_feat": self.speech_feat,
        }

    @classmethod
    def from_state(cls, state: dict[str, object]) -> PromptFeatures:
        emb, tok, feat = (state.get(k) for k in ("embedding", "speech_tokens", "speech_feat"))
        if not (
            isinstance(emb, torch.Tensor)
            and isinstance(tok, torch.Tensor)
            and isinstance(feat, torch.Tensor)
        ):
            raise ValueError("prompt state lacks the feature tensors")
        if emb.shape != (1, 192) or tok.dim() != 2 or feat.dim() != 3 or feat.shape[2] != 80:
            raise ValueError("prompt state has unexpected shapes")
        return cls(emb.float(), tok.to(torch.int32), feat.float())


def extract_features(wave_16k: torch.Tensor, models: PromptModels) -> PromptFeatures:
    """float32 (1, N) mono 16 kHz prompt -> :class:`PromptFeatures` (runs both ONNX models)."""
    start = time.perf_counter()
    wave_16k = wave_16k.reshape(1, -1).to(torch.float32)
    with torch.inference_mode():
        tokens = models.speech_tokens(whisper_log_mel(wave_16k))
        embedding = models.embedding(campplus_input(wave_16k))
        feat = prompt_mel(resample(wave_16k, PROMPT_RATE, SAMPLE_RATE))
    _LOGGER.debug(
        "Prompt of %.2f s: %d tokens, %d mel frames in %.2f s",
        wave_16k.shape[1] / PROMPT_RATE,
        tokens.shape[1],
        feat.shape[1],
        time.perf_counter() - start,
    )
    return PromptFeatures(embedding.clone(), tokens.clone(), feat.clone())


def _ids(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([ids], dtype=torch.int32).reshape(1, -1),
        torch.tensor([len(ids)], dtype=torch.int32),
    )


def model_input_zero_shot(
    text_ids: list[int], prompt_text_ids: list[int], prompt: PromptFeatures
) -> dict[str, torch.Tensor]:
    """The official v1 ``frontend_zero_shot`` ``model_input`` (for parity checks and tools)."""
    text, text_len = _ids(text_ids)
    prompt_text, prompt_text_len = _ids(prompt_text_ids)
    n_tok = torch.tensor([prompt.speech_tokens.shape[1]], dtype=torch.int32)
    n_feat = torch.tensor([prompt.speech_feat.shape[1]], dtype=torch.int32)
    # Upstream stores the same tensors under llm_* and flow_*.
    return {
        "text": text,
        "text_len": text_len,
        "prompt_text": prompt_text,
        "prompt_text_len": prompt_text_len,
        "llm_prompt_speech_token": prompt.speech_tokens,
        "llm_prompt_speech_token_len": n_tok,
        "flow_prompt_speech_token": prompt.speech_tokens,
        "flow_prompt_speech_token_len": n_tok,
        "prompt_speech_feat": prompt.speech_feat,
        "prompt_speech_feat_len": n_feat,
        "llm_embedding": prompt.embedding,
        "flow_embedding": prompt.embedding,
    }


def model_input_cross_lingual(
    text_ids: list[int], prompt: PromptFeatures
) -> dict[str, torch.Tensor]:
    """The official v1 ``frontend_cross_lingual``: zero-shot minus prompt text and LM tokens."""
    out = model_input_zero_shot(text_ids, [], prompt)
    for key in (
        "prompt_text",
        "prompt_text_len",
        "llm_prompt_speech_token",
        "llm_prompt_speech_token_len",
    ):
        del out[key]
    return out
