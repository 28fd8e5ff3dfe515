"""Zero-shot prompts: a user's recording + transcript -> the conditioning of a custom voice.

* :mod:`engine.prompt.audio` — WAV reading (stdlib only), mono mix, sinc resampling;
* :mod:`engine.prompt.features` — prompt mel (flow), kaldi fbank (CAM++), whisper log-mel
  (speech tokenizer);
* :mod:`engine.prompt.onnx_models` — ``campplus.onnx`` / ``speech_tokenizer_v1.onnx`` through
  onnxruntime (imported only when a prompt is actually extracted);
* :mod:`engine.prompt.extract` — one recording -> :class:`PromptFeatures`, and the official
  ``model_input`` dicts (for parity tests);
* :mod:`engine.prompt.voices` — the voices folder: validation, the ``NAME.prompt.pt`` cache,
  scanning, and turning a custom voice into the engine's ``Voice``.
"""

from engine.prompt.errors import PromptModelError, VoiceError

__all__ = ["PromptModelError", "VoiceError"]
