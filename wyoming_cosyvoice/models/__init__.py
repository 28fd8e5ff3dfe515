"""The model: found or downloaded, loaded into an engine with its scheduler, and CosyVoice2's
built-in voices made from CosyVoice-300M-SFT."""
