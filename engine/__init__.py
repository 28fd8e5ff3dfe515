"""CosyVoice text-to-speech in PyTorch: v1 (CosyVoice-300M, -SFT, -Instruct) and CosyVoice2-0.5B.

Public surface::

    from engine import SynthesisOptions, load_engine
    engine = load_engine("data/CosyVoice-300M-SFT")  # the family is read from the directory
    for chunk in engine.synthesize("你好。", SynthesisOptions(speaker="中文女")):
        play(chunk.pcm16)  # at chunk.sample_rate (engine.sample_rate): 22050 or 24000 Hz

``CosyVoiceEngine`` (v1) and ``CosyVoice2Engine`` have the same surface; ``model_family``
says which one a directory needs.

Names are imported lazily so that light users (the text frontend, the server's start-up)
do not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CosyVoiceEngine": "engine.cosyvoice1.engine",
    "CosyVoice2Engine": "engine.cosyvoice2.engine",
    "load_engine": "engine.family",
    "model_family": "engine.family",
    "AudioChunk": "engine.core.types",
    "SynthesisOptions": "engine.core.types",
    "StreamSchedule": "engine.core.types",
    "LOW_LATENCY_SCHEDULE": "engine.core.types",
    "OFFICIAL_SCHEDULE": "engine.core.types",
    "EngineError": "engine.core.types",
    "ModelLoadError": "engine.core.types",
    "UnknownSpeakerError": "engine.core.types",
    "SynthesisCancelled": "engine.core.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
