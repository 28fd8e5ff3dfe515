"""Fun-CosyVoice3: the LM, text frontend, flow and vocoder of the third model family."""
