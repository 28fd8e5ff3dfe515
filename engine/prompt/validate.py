"""Checks on a custom voice's recording and transcript, with messages meant for the user."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from engine.prompt.errors import VoiceError

_LOGGER = logging.getLogger(__name__)

MIN_SECONDS = 3.0
MAX_SECONDS = 30.0  # the v1 speech tokenizer cannot take more
# A 20 ms frame counts as sound when its AC level (std) is above -50 dBFS; a prompt needs at
# least MIN_SOUND_SECONDS of such frames. Std, not RMS, so a DC offset is not "sound".
SOUND_DBFS = -50.0
MIN_SOUND_SECONDS = 1.0
FRAME = 320  # 20 ms at 16 kHz
CLIP_LEVEL, CLIP_FRACTION = 0.999, 0.01
MAX_TRANSCRIPT_CHARS = 1000


def _dbfs(level: float) -> float:
    return 20.0 * math.log10(level) if level > 0 else -math.inf


def check_audio(wave_16k: torch.Tensor, name: str) -> float:
    """Raise VoiceError unless the 16 kHz mono prompt is usable; returns its duration (s)."""
    x = wave_16k.reshape(-1)
    if not bool(torch.isfinite(x).all()):
        raise VoiceError("the recording is not real audio (it contains NaN/inf samples)")
    seconds = x.numel() / 16000
    if seconds < MIN_SECONDS:
        raise VoiceError(
            f"recording is {seconds:.1f} s long; it needs at least "
            f"{MIN_SECONDS:g} s (3-10 s of clear speech works best)"
        )
    if seconds > MAX_SECONDS + 1e-3:  # resampling may round the length up by a sample
        raise VoiceError(
            f"recording is {seconds:.1f} s long; the limit is {MAX_SECONDS:g} s "
            "(3-10 s of clear speech works best)"
        )
    peak = float(x.abs().max())
    n = x.numel() // FRAME
    levels = x[: n * FRAME].reshape(n, FRAME).std(dim=1)
    sound = float((levels >= 10 ** (SOUND_DBFS / 20)).sum()) * FRAME / 16000
    if sound < MIN_SOUND_SECONDS:
        if peak < 10 ** (SOUND_DBFS / 20):
            raise VoiceError(f"the recording is silent (peak {_dbfs(peak):.0f} dBFS)")
        if float(levels.max()) < 1e-6:
            raise VoiceError("the recording is silent (a constant signal, no sound)")
        raise VoiceError(
            f"the recording has only {sound:.1f} s above {SOUND_DBFS:g} dBFS; "
            "record the speaker closer to the microphone or louder"
        )
    clipped = float((x.abs() >= CLIP_LEVEL).float().mean())
    if clipped > CLIP_FRACTION:
        _LOGGER.warning(
            "Custom voice %r: %.1f%% of the samples are clipped; the cloned voice "
            "may sound distorted",
            name,
            100 * clipped,
        )
    return seconds


def read_transcript(path: Path, *, what: str = "transcript") -> str:
    """The stripped text of ``path`` (UTF-8, BOM allowed); VoiceError if missing/empty."""
    if not path.is_file():
        raise VoiceError(
            f"{what} {path.name} is missing: put the exact words spoken in the recording into it"
        )
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as err:
        raise VoiceError(f"{what} {path.name} is not UTF-8 text") from err
    except OSError as err:
        raise VoiceError(f"cannot read {what} {path.name}: {err.strerror or err}") from err
    text = " ".join(text.split())  # line breaks and runs of spaces -> one space
    if not text:
        raise VoiceError(f"{what} {path.name} is empty")
    if not any(ch.isalnum() for ch in text):
        raise VoiceError(f"{what} {path.name} has no words in it")
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise VoiceError(
            f"{what} {path.name} is {len(text)} characters long; the limit is "
            f"{MAX_TRANSCRIPT_CHARS}"
        )
    return text


def check_transcript_length(transcript: str, seconds: float, name: str) -> None:
    """Warn (only) when the transcript cannot plausibly be what the recording says."""
    # ~15 chars/s is fast English speech; CJK runs ~8 chars/s. 3x that is certainly wrong.
    if len(transcript) > 45 * seconds:
        _LOGGER.warning(
            "Custom voice %r: the transcript (%d characters) looks too long for "
            "%.1f s of audio; it must be exactly what is said in the recording",
            name,
            len(transcript),
            seconds,
        )
