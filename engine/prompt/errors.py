"""Errors of the custom-voice path (all carry a message meant for the add-on log)."""

from __future__ import annotations

from engine.core.types import EngineError


class VoiceError(EngineError, ValueError):
    """A custom voice's recording or transcript cannot be used (the voice is skipped)."""


class PromptModelError(EngineError):
    """onnxruntime or one of the prompt ONNX models is missing or unusable."""
