"""CosyVoice v1 (CosyVoice-300M, -SFT, -Instruct) text-to-speech in PyTorch.

Public surface::

    from engine import CosyVoiceEngine, SynthesisOptions
    engine = CosyVoiceEngine.load("data/CosyVoice-300M-SFT")
    for chunk in engine.synthesize("你好。", SynthesisOptions(speaker="中文女")):
        play(chunk.pcm16)

Names are imported lazily so that light users (the text frontend, the server's start-up)
do not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "CosyVoiceEngine": "engine.engine",
    "AudioChunk": "engine.types",
    "SynthesisOptions": "engine.types",
    "StreamSchedule": "engine.types",
    "LOW_LATENCY_SCHEDULE": "engine.types",
    "OFFICIAL_SCHEDULE": "engine.types",
    "EngineError": "engine.types",
    "ModelLoadError": "engine.types",
    "UnknownSpeakerError": "engine.types",
    "SynthesisCancelled": "engine.types",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
