"""The quality check of a recording offered as a new voice from the web page.

The engine takes any recording it can use (:mod:`engine.prompt.validate`: 3–30 s with some
sound in it). A clip made with a laptop or phone microphone fails in other ways first: it is
clipped, the speaker is far away, a fan or the television plays behind. Such a clip still makes
a voice, a poor one, and the user only hears it later. So before a voice is saved its recording
is measured and, if it would make a poor voice, refused with the reason and what to do:

* **length**: the engine's 3 to 30 s (advice above 15 s: every sentence spoken with the voice
  reads the whole prompt, so a long one is slower);
* **clipped**: more than 0.1 % of the samples at full scale;
* **too quiet**: the speech below -40 dBFS. The speech level is the 90th percentile of the
  20 ms frame levels, so pauses do not pull it down;
* **noisy**: the pauses less than 15 dB below the speech. The noise level is the 10th
  percentile of the frame levels: the quietest frames of a recording are its pauses, and what
  is heard there is what lies under the speech too.

Frame levels are RMS around the frame's mean (a DC offset is no sound) of the 16 kHz mono
signal the engine reads; clipping is counted on the file's own samples, before resampling
smooths it away.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from engine.prompt.audio import decode_wav, resample, to_mono
from engine.prompt.errors import VoiceError
from engine.prompt.validate import MAX_SECONDS, MIN_SECONDS, check_audio

RATE = 16000  # what the engine analyses a recording at, and what speech-to-text gets
FRAME = 320  # 20 ms at 16 kHz
MIN_RATE = 16000
CLIP_LEVEL = 0.999
MAX_CLIPPED_PERCENT = 0.1
MIN_SPEECH_DBFS = -40.0
MIN_SNR_DB = 15.0
LONG_SECONDS = 15.0
SPEECH_PERCENTILE, NOISE_PERCENTILE = 90, 10
FLOOR_DBFS = -100.0  # digital silence, as a number


class UnreadableAudio(ValueError):
    """The upload is not a WAV file this server reads."""


class RecordingRejected(ValueError):
    """A recording that would make a poor voice; the message says why and what to do."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason  # too_short, too_long, low_rate, clipped, too_quiet, noisy, unusable


@dataclass(frozen=True)
class ClipReport:
    """What was measured; every level in dBFS."""

    duration_s: float
    sample_rate: int
    channels: int
    speech_dbfs: float
    noise_dbfs: float
    snr_db: float
    clipped_percent: float
    advice: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        fields = asdict(self)
        fields["advice"] = list(self.advice)
        return {k: round(v, 2) if isinstance(v, float) else v for k, v in fields.items()}


@dataclass(frozen=True)
class CheckedRecording:
    report: ClipReport
    audio_16k: np.ndarray  # float32 mono at 16 kHz


def _dbfs(level: float) -> float:
    return max(FLOOR_DBFS, 20.0 * math.log10(level)) if level > 0 else FLOOR_DBFS


def frame_levels(mono_16k: np.ndarray) -> np.ndarray:
    """RMS around each 20 ms frame's mean."""
    n = len(mono_16k) // FRAME
    return mono_16k[: n * FRAME].reshape(n, FRAME).std(axis=1)


def measure(samples: np.ndarray, rate: int) -> tuple[ClipReport, np.ndarray]:
    """The report of (channels, frames) float samples at ``rate``, and the 16 kHz mono audio."""
    channels, frames = samples.shape
    mono = to_mono(samples)
    audio_16k = resample(mono, rate, RATE).reshape(-1).numpy().astype(np.float32)
    levels = frame_levels(audio_16k) if len(audio_16k) >= FRAME else np.zeros(1)
    speech = _dbfs(float(np.percentile(levels, SPEECH_PERCENTILE)))
    noise = _dbfs(float(np.percentile(levels, NOISE_PERCENTILE)))
    clipped = 100.0 * float((np.abs(samples) >= CLIP_LEVEL).any(axis=0).mean())
    duration = frames / rate
    advice = []
    if duration > LONG_SECONDS:
        advice.append(f"The recording is {duration:.0f} s long; every sentence spoken with the "
                      "voice reads it all, so 5–10 s speaks faster.")  # fmt: skip
    report = ClipReport(duration, rate, channels, speech, noise, speech - noise, clipped,
                        tuple(advice))  # fmt: skip
    return report, audio_16k


def refusal(report: ClipReport) -> RecordingRejected | None:
    """Why the measured recording would make a poor voice, or None."""
    r = report
    if r.sample_rate < MIN_RATE:
        return RecordingRejected(
            f"The recording's sample rate is {r.sample_rate} Hz; a voice needs {MIN_RATE} Hz or "
            "more. Record again, or export the file at 44100 or 48000 Hz.", "low_rate")  # fmt: skip
    if r.duration_s < MIN_SECONDS:
        return RecordingRejected(
            f"The recording is {r.duration_s:.1f} s long; record at least {MIN_SECONDS:g} s "
            "(5–10 s of clear speech works best).", "too_short")  # fmt: skip
    if r.duration_s > MAX_SECONDS:
        return RecordingRejected(
            f"The recording is {r.duration_s:.1f} s long; the limit is {MAX_SECONDS:g} s. "
            "Record 5–10 s, or cut the file shorter.", "too_long")  # fmt: skip
    if r.clipped_percent > MAX_CLIPPED_PERCENT:
        return RecordingRejected(
            f"The recording is distorted: {r.clipped_percent:.1f} % of it is at the loudest "
            "level the microphone can take. Move back from the microphone, speak more softly "
            "or turn its volume down.", "clipped")  # fmt: skip
    if r.speech_dbfs < MIN_SPEECH_DBFS:
        if r.speech_dbfs <= FLOOR_DBFS:
            return RecordingRejected(
                "The recording is silent. Check that the right microphone is chosen and that "
                "it is not muted.", "too_quiet")  # fmt: skip
        return RecordingRejected(
            f"The recording is too quiet: the speech is at {r.speech_dbfs:.0f} dBFS and needs "
            f"{MIN_SPEECH_DBFS:.0f} dBFS or more. Speak closer to the microphone or turn its "
            "volume up.", "too_quiet")  # fmt: skip
    if r.snr_db < MIN_SNR_DB:
        return RecordingRejected(
            f"There is too much background noise: the pauses are only {r.snr_db:.0f} dB "
            f"quieter than the speech ({MIN_SNR_DB:.0f} dB are needed). Record in a quiet room, "
            "away from fans, music and the television, with short pauses between phrases.",
            "noisy")  # fmt: skip
    return None


def check_recording(data: bytes) -> CheckedRecording:
    """Measure a WAV upload; raises :class:`UnreadableAudio` or :class:`RecordingRejected`.

    CPU work of a few tens of milliseconds for 30 s of audio: callers on an event loop run it
    in a thread.
    """
    try:
        samples, info = decode_wav(data)
    except VoiceError as err:
        raise UnreadableAudio(
            f"{err}. Upload a WAV file (16/24/32-bit PCM or 32-bit float); the web page "
            "converts other formats itself") from err  # fmt: skip
    if not np.isfinite(samples).all():
        raise RecordingRejected("The recording holds no real audio (NaN or infinite samples).",
                                "unusable")  # fmt: skip
    report, audio_16k = measure(samples, info.sample_rate)
    if (problem := refusal(report)) is not None:
        raise problem
    try:  # the engine's own rules, so that a saved voice is always offered
        check_audio(torch.from_numpy(audio_16k), "new voice")
    except VoiceError as err:
        raise RecordingRejected(f"The recording cannot make a voice: {err}.", "unusable") from err
    return CheckedRecording(report, audio_16k)
