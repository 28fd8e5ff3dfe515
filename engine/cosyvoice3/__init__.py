"""Fun-CosyVoice3-0.5B: CosyVoice2's design with a DiT flow and a causal HiFT vocoder."""
