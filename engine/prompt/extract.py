"""One prompt recording -> the tensors of a family's zero-shot frontend (:class:`PromptRecipe`).

v1 audio path (tests/data/zero_shot/README.md §5, "PRE", the v1 release): the file is read,
mixed to mono and resampled to 16 kHz; CAM++ and the speech tokenizer read that 16 kHz signal,
and the flow's prompt mel is computed from it resampled 16k -> 22050 Hz. (Upstream's current code
computes the v1 prompt mel from 24 kHz audio: 93.75 frames/s where v1 was trained on 86.13, a
regression we do not copy.) No token/frame trimming in v1.

v2 (tests/data/cosyvoice2/README.md, "Prompt features"): the same 16 kHz signal for CAM++ and
the 25 Hz tokenizer; the 24 kHz mel is resampled from the file's own rate; tokens and mel are
then cut to ``n = min(frames // 2, tokens)`` tokens and ``2 n`` frames.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.prompt.audio import PromptRecording, resample
from engine.prompt.features import campplus_input, prompt_mel, whisper_log_mel
from engine.prompt.onnx_models import PromptModels
from engine.prompt.recipe import COSYVOICE1, PromptRecipe

_LOGGER = logging.getLogger(__name__)

PROMPT_RATE = 16000


@dataclass(frozen=True)
class PromptFeatures:
    """What a prompt recording contributes: x-vector, speech tokens, the flow's prompt mel."""

    embedding: torch.Tensor  # float32 (1, 192), raw CAM++ output (normalised inside the models)
    speech_tokens: torch.Tensor  # int32 (1, T'): 50 Hz (v1) or 25 Hz (v2)
    speech_feat: torch.Tensor  # float32 (1, T, 80): 22050 Hz (v1) or 24 kHz (v2) mel frames

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


def extract_features(
    wave_16k: torch.Tensor,
    models: PromptModels,
    recipe: PromptRecipe = COSYVOICE1,
    *,
    recording: PromptRecording | None = None,
) -> PromptFeatures:
    """float32 (1, N) mono 16 kHz prompt -> :class:`PromptFeatures` (runs both ONNX models).

    ``recording``: the same audio at the file's rate, which the mel is resampled from when the
    recipe says so (otherwise, or without it, from the 16 kHz signal).
    """
    if models.kind != recipe.tokenizer:
        raise ValueError(f"{models.tokenizer_path.name} is not the {recipe.family} tokenizer")
    start = time.perf_counter()
    wave_16k = wave_16k.reshape(1, -1).to(torch.float32)
    if recipe.mel_from_recording and recording is not None:
        mel_audio = recording.at(recipe.mel.sample_rate)
    else:
        mel_audio = resample(wave_16k, PROMPT_RATE, recipe.mel.sample_rate)
    with torch.inference_mode():
        tokens = models.speech_tokens(whisper_log_mel(wave_16k))
        embedding = models.embedding(campplus_input(wave_16k))
        feat = prompt_mel(mel_audio, recipe.mel)
    if recipe.token_mel_ratio is not None:
        tokens, feat = align_tokens_and_mel(tokens, feat, recipe.token_mel_ratio)
    _LOGGER.debug(
        "Prompt of %.2f s: %d tokens, %d mel frames in %.2f s",
        wave_16k.shape[1] / PROMPT_RATE,
        tokens.shape[1],
        feat.shape[1],
        time.perf_counter() - start,
    )
    return PromptFeatures(embedding.clone(), tokens.clone(), feat.clone())


def extract_recording(
    recording: PromptRecording, models: PromptModels, recipe: PromptRecipe = COSYVOICE1
) -> PromptFeatures:
    """:func:`extract_features` of a loaded recording (resampled to 16 kHz here)."""
    return extract_features(recording.at(PROMPT_RATE), models, recipe, recording=recording)


def align_tokens_and_mel(
    tokens: torch.Tensor, feat: torch.Tensor, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(1, T') tokens and (1, T, 80) mel cut to n = min(T // ratio, T') tokens, ratio·n frames."""
    n = min(feat.shape[1] // ratio, tokens.shape[1])
    return tokens[:, :n], feat[:, : ratio * n]


def _ids(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        torch.tensor([ids], dtype=torch.int32).reshape(1, -1),
        torch.tensor([len(ids)], dtype=torch.int32),
    )


def model_input_zero_shot(
    text_ids: list[int], prompt_text_ids: list[int], prompt: PromptFeatures
) -> dict[str, torch.Tensor]:
    """The official ``frontend_zero_shot`` ``model_input`` (for parity checks and tools)."""
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
