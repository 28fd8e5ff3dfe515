"""CosyVoice2 voices from a recording: the v2 prompt recipe and what it conditions.

Extraction, validation, the voices folder and its cache are v1's (:mod:`engine.prompt`) with the
v2 recipe (:data:`COSYVOICE2`): CAM++ on the 16 kHz signal as in v1; ``speech_tokenizer_v2.onnx``
on the same 128-bin whisper log-mel, 25 tokens a second; the flow's 24 kHz mel (n_fft 1920,
hop 480) resampled from the file's own rate; both cut to ``n = min(frames // 2, tokens)`` tokens
and ``2 n`` frames. A v2 voice's cache is ``NAME.cosyvoice2.prompt.pt`` and records the family,
so v1 and v2 never read each other's features.

Modes, as the official v2 frontend builds them (:func:`conditioning`):

* zero-shot — the LM gets the transcript's ids and the prompt's speech tokens; the flow gets the
  prompt's tokens, mel and speaker embedding;
* cross-lingual (text in another language than the transcript) — the LM gets neither (no
  language tag either: v2 has none); the flow as zero-shot;
* instruct2 (an instruction with the request or in ``NAME.instruct.txt``) — the LM gets the
  instruction ending in ``<|endofprompt|>`` and no prompt speech; the flow as zero-shot.

The v2 LM takes no speaker embedding: only the flow hears who speaks.
"""

from __future__ import annotations

import functools
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core.streaming import FlowPrompt
from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
from engine.family_facts import family_named
from engine.prompt.extract import PromptFeatures, model_input_zero_shot
from engine.prompt.features import V2_PROMPT_MEL
from engine.prompt.onnx_models import PromptModels, SpeechTokenizer
from engine.prompt.recipe import PromptRecipe
from engine.prompt.voices import CustomVoice, VoiceLibrary, is_cross_lingual

V2_SPEECH_TOKENIZER = SpeechTokenizer(
    "speech_tokenizer_v2.onnx", 4, 6561, "the FunAudioLLM/CosyVoice2-0.5B model repository"
)
COSYVOICE2 = PromptRecipe(
    family="cosyvoice2",
    mel=V2_PROMPT_MEL,
    tokenizer=V2_SPEECH_TOKENIZER,
    mel_from_recording=True,
    token_mel_ratio=2,
    cache_suffix=family_named("cosyvoice2").prompt_cache_suffix,
)

ZERO_SHOT, CROSS_LINGUAL, INSTRUCT2 = "zero_shot", "cross_lingual", "instruct2"


def prompt_models(
    model_dir: Path | str, *, threads: int = 1, recipe: PromptRecipe = COSYVOICE2
) -> PromptModels:
    """``campplus.onnx`` and the ``recipe``'s speech tokenizer (``speech_tokenizer_v2.onnx``)
    of a model directory of its family."""
    return PromptModels.from_model_dir(model_dir, threads=threads, kind=recipe.tokenizer)


def voice_library(
    voices_dir: Path | str,
    models: PromptModels | None,
    *,
    reserved: Collection[str] = (),
    release_models: bool = True,
    recipe: PromptRecipe = COSYVOICE2,
) -> VoiceLibrary:
    """A voices folder read with the ``recipe`` (v2's by default; call ``scan()`` to load it)."""
    if models is not None and models.kind != recipe.tokenizer:
        raise ValueError(
            f"{models.tokenizer_path.name} is not the {family_named(recipe.family).label} "
            "speech tokenizer"
        )
    return VoiceLibrary(
        voices_dir, models, reserved=reserved, release_models=release_models, recipe=recipe
    )


@dataclass(frozen=True)
class VoiceConditioning:
    """What conditions the v2 LM and flow for one voice and one text segment."""

    name: str
    mode: str  # ZERO_SHOT, CROSS_LINGUAL or INSTRUCT2
    prompt_text_ids: list[int]  # transcript (zero-shot), instruction (instruct2) or none
    llm_prompt_tokens: list[int]  # the prompt's speech tokens (zero-shot only)
    flow_prompt: FlowPrompt


def flow_prompt(prompt: PromptFeatures) -> FlowPrompt:
    """The flow's conditioning: embedding, 25 Hz prompt tokens and their 2 mel frames each."""
    return FlowPrompt(
        prompt.embedding, prompt.speech_tokens.to(torch.int64), prompt.speech_feat.float()
    )


@functools.lru_cache(maxsize=64)
def _transcript_ids(frontend: CosyVoice2TextFrontend, transcript: str) -> tuple[int, ...]:
    return tuple(frontend.prompt_text_ids(transcript))


def conditioning(
    voice: CustomVoice,
    frontend: CosyVoice2TextFrontend,
    text: str,
    *,
    instruct: str | None = None,
    language: str | None = None,
    family: str = COSYVOICE2.family,
) -> VoiceConditioning:
    """The conditioning for speaking ``text`` (one segment) with a v2 custom voice.

    ``instruct`` (else the voice's own instruction) selects instruct2; otherwise the segment's
    language (``language`` as the caller detected it, else detected here) against the
    transcript's chooses zero-shot or cross-lingual. ``family``: the voices the engine speaks
    with (CosyVoice3 conditions its LM in the same modes, its frontend adding the system prompt).
    """
    if voice.family != family:
        raise ValueError(f"voice {voice.name!r} was prepared for {voice.family}, not {family}")
    flow = flow_prompt(voice.prompt)
    instruction = instruct or voice.instruct
    if instruction:
        return VoiceConditioning(
            voice.name, INSTRUCT2, frontend.instruct_ids(instruction), [], flow
        )
    if is_cross_lingual(voice, text, language):
        return VoiceConditioning(voice.name, CROSS_LINGUAL, [], [], flow)
    return VoiceConditioning(
        voice.name,
        ZERO_SHOT,
        list(_transcript_ids(frontend, voice.transcript)),
        voice.prompt.speech_tokens.reshape(-1).tolist(),
        flow,
    )


def model_input_instruct2(
    text_ids: list[int], instruct_ids: list[int], prompt: PromptFeatures
) -> dict[str, torch.Tensor]:
    """The official ``frontend_instruct2`` ``model_input`` (for parity checks and tools): the
    zero-shot layout with the instruction as prompt text and no LM prompt speech."""
    out = model_input_zero_shot(text_ids, instruct_ids, prompt)
    del out["llm_prompt_speech_token"], out["llm_prompt_speech_token_len"]
    return out
