"""Text frontend for CosyVoice-300M v1: normalisation, splitting, whisper BPE tokenizer."""

from engine.text.errors import TextInputError

__all__ = ["TextInputError"]
