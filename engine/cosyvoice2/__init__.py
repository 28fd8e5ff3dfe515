"""CosyVoice2-0.5B: the Qwen2 speech-token LM, its text frontend, the causal flow and HiFT."""
