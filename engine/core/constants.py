"""Audio and token-rate constants that the official runtime hard-codes for CosyVoice v1."""

SAMPLE_RATE = 22050  # output sample rate (Hz)
TOKEN_RATE = 50  # speech tokens per second
HOP = 256  # samples per mel frame (HiFT: 8 * 8 upsampling * iSTFT hop 4)
N_MELS = 80
SPEECH_VOCAB = 4096  # speech token ids 0..4095
EOS_TOKEN = SPEECH_VOCAB  # the LM's extra output class


def tokens_to_frames(n_tokens: int) -> int:
    """Mel frames for ``n_tokens`` speech tokens: floor(n / 50 * 22050 / 256), as upstream."""
    return int(n_tokens / TOKEN_RATE * SAMPLE_RATE / HOP)


TOKEN_OVERLAP = 20  # tokens shared by consecutive streaming chunks
MEL_OVERLAP = tokens_to_frames(TOKEN_OVERLAP)  # 34 frames cross-faded between chunks
MEL_CACHE = 20  # mel frames of HiFT context carried to the next chunk
SOURCE_CACHE = MEL_CACHE * HOP  # 5120 source samples pinned across chunks
