"""CosyVoice3 voices from a recording: CosyVoice2's recipe with the v3 speech tokenizer and the
v3 flow's full-band mel.

What the official v3 frontend changes against v2's (``cosyvoice/cli/frontend.py`` is shared;
the differences are in the directory and its yaml): the speech tokens come from
``speech_tokenizer_v3.onnx`` (the same 128-bin whisper log-mel at 16 kHz, 25 tokens a second,
6561 codes); the flow's prompt mel is the yaml's ``feat_extractor`` with ``fmax: null`` — up to
the Nyquist frequency, 12 kHz, where v2's stops at 8 kHz. CAM++, the cut to ``n`` tokens and
``2 n`` frames and the voices folder are v2's. A v3 voice's cache is
``NAME.cosyvoice3.prompt.pt`` and records the family, so no other family reads it.
"""

from __future__ import annotations

from engine.family_facts import COSYVOICE3 as COSYVOICE3_FAMILY
from engine.prompt.features import MelSpec
from engine.prompt.onnx_models import SpeechTokenizer
from engine.prompt.recipe import PromptRecipe

V3_SPEECH_TOKENIZER = SpeechTokenizer(
    "speech_tokenizer_v3.onnx",
    4,
    6561,
    "the FunAudioLLM/Fun-CosyVoice3-0.5B-2512 model repository",
)
# ``fmax: null``: the mel filters reach half the sample rate.
V3_PROMPT_MEL = MelSpec(sample_rate=24000, n_fft=1920, hop=480, fmax=12000.0)
COSYVOICE3 = PromptRecipe(
    family=COSYVOICE3_FAMILY.name,
    mel=V3_PROMPT_MEL,
    tokenizer=V3_SPEECH_TOKENIZER,
    mel_from_recording=True,
    token_mel_ratio=2,
    cache_suffix=COSYVOICE3_FAMILY.prompt_cache_suffix,
)
