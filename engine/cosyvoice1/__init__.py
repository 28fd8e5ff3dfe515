"""CosyVoice v1 (CosyVoice-300M, -SFT, -Instruct): its engine, speech-token LM, flow and
streaming."""
