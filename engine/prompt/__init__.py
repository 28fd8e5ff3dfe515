"""Zero-shot prompts: a user's recording + transcript -> the conditioning of a custom voice.

Shared by the model families; what differs between them is a :mod:`engine.prompt.recipe`
(v1's is there, v2's in :mod:`engine.cosyvoice2.prompt`).

* :mod:`engine.prompt.audio` — WAV reading (stdlib only), mono mix, sinc resampling;
* :mod:`engine.prompt.features` — prompt mel (flow), kaldi fbank (CAM++), whisper log-mel
  (speech tokenizer);
* :mod:`engine.prompt.onnx_models` — ``campplus.onnx`` and the family's speech tokenizer through
  onnxruntime (imported only when a prompt is actually extracted);
* :mod:`engine.prompt.recipe` — a family's extraction: mel, tokenizer, token/mel cut, cache name;
* :mod:`engine.prompt.extract` — one recording -> :class:`PromptFeatures`, and the official
  ``model_input`` dicts (for parity tests);
* :mod:`engine.prompt.voices` — the voices folder: validation, the per-family cache
  (``NAME.prompt.pt`` for v1), scanning, and turning a custom voice into v1's ``Voice``.
"""

from engine.prompt.errors import PromptModelError, VoiceError

__all__ = ["PromptModelError", "VoiceError"]
