"""How a model family turns a prompt recording into features (:class:`PromptRecipe`).

Every family reads the same 16 kHz signal for CAM++ and its speech tokenizer; they differ in the
flow's prompt mel, the tokenizer, and whether tokens and mel are cut to a fixed ratio. The
recipe's ``family`` keys the voice cache, so a family never reads features another one made.
v1's recipe is here; each later family defines its own beside its model code.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.family_facts import PROMPT_CACHE_ENDING, family_named
from engine.prompt.features import V1_PROMPT_MEL, MelSpec
from engine.prompt.onnx_models import V1_SPEECH_TOKENIZER, SpeechTokenizer

CACHE_ENDING = PROMPT_CACHE_ENDING


@dataclass(frozen=True)
class PromptRecipe:
    """A model family's prompt extraction."""

    family: str  # written into the voice cache and checked when it is read
    mel: MelSpec  # the flow's prompt mel
    tokenizer: SpeechTokenizer
    # True: the mel's audio is resampled from the recording's own rate (the v2 frontend);
    # False: from the 16 kHz signal (the v1 release resampled 16 kHz -> 22050 Hz).
    mel_from_recording: bool
    # Mel frames per speech token the flow expects: tokens and mel are cut to the longest
    # prefix with exactly this ratio (v2: 2). None: both kept as extracted (v1 stretches).
    token_mel_ratio: int | None
    cache_suffix: str  # NAME + this is the voice's cache file

    def __post_init__(self) -> None:
        # The voices folder scan and the server's change watch skip files with this ending.
        if not self.cache_suffix.endswith(CACHE_ENDING):
            raise ValueError(f"a prompt cache suffix must end in {CACHE_ENDING}")


COSYVOICE1 = PromptRecipe(
    family="cosyvoice1",
    mel=V1_PROMPT_MEL,
    tokenizer=V1_SPEECH_TOKENIZER,
    mel_from_recording=False,
    token_mel_ratio=None,
    cache_suffix=family_named("cosyvoice").prompt_cache_suffix,
)
