"""Fun-CosyVoice3: the third model family, built on the core and CosyVoice2's classes."""
