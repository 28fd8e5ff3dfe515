"""Generated recordings for the voice maker's tests: speech-like, and each way a clip goes wrong.

``speech_like`` is a harmonic voice (a gliding 130 Hz fundamental with 15 harmonics) cut into
180 ms syllables, four a second, with a longer pause now and then, over a faint noise floor:
what a quiet room's recording looks like to frame levels (loud syllables, quiet gaps).
"""

from __future__ import annotations

import io
import wave

import numpy as np


def speech_like(seconds: float = 5.0, rate: int = 24000, peak: float = 0.5,
                noise: float = 3e-4, seed: int = 0) -> np.ndarray:  # fmt: skip
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(130 + 25 * np.sin(2 * np.pi * 0.5 * t)) / rate
    voiced = sum(np.sin(h * phase) / h for h in range(1, 16))
    envelope = np.zeros_like(t)
    for start in np.arange(0.3, seconds - 0.3, 0.25):
        if int(start) % 3 == 2 and start % 1 > 0.5:
            continue  # a pause between phrases
        syllable = (t >= start) & (t < start + 0.18)
        envelope[syllable] = np.sin(np.pi * (t[syllable] - start) / 0.18)
    x = voiced * envelope
    return peak * x / np.abs(x).max() + noise * rng.standard_normal(len(t))


def white_noise(seconds: float, rate: int, rms: float, seed: int = 1) -> np.ndarray:
    return rms * np.random.default_rng(seed).standard_normal(int(seconds * rate))


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM; ``samples`` (frames,) or (frames, channels), clipped to [-1, 1]."""
    frames = samples if samples.ndim == 2 else samples[:, None]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(frames.shape[1])
        wav.setsampwidth(2)
        wav.setframerate(rate)
        wav.writeframes(np.round(np.clip(frames, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()


def float_wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """32-bit IEEE float mono (format tag 3), which the ``wave`` module cannot write."""
    data = samples.astype("<f4").tobytes()
    fmt = (3).to_bytes(2, "little") + (1).to_bytes(2, "little") + rate.to_bytes(4, "little")
    fmt += (rate * 4).to_bytes(4, "little") + (4).to_bytes(2, "little") + (32).to_bytes(2, "little")
    chunks = b"fmt " + len(fmt).to_bytes(4, "little") + fmt
    chunks += b"data" + len(data).to_bytes(4, "little") + data
    return b"RIFF" + (4 + len(chunks)).to_bytes(4, "little") + b"WAVE" + chunks
