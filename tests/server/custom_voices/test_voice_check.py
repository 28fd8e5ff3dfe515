"""The voice maker's quality check on generated recordings: a good clip passes with its
measurements, and each way a clip goes wrong is refused with its reason and what to do."""

from __future__ import annotations

import numpy as np
import pytest
from voice_signals import float_wav_bytes, speech_like, wav_bytes, white_noise

from wyoming_cosyvoice.custom_voices.voice_check import (
    MAX_CLIPPED_PERCENT,
    MIN_SNR_DB,
    MIN_SPEECH_DBFS,
    RecordingRejected,
    UnreadableAudio,
    check_recording,
)


def refused(samples: np.ndarray, rate: int = 24000) -> RecordingRejected:
    with pytest.raises(RecordingRejected) as caught:
        check_recording(wav_bytes(samples, rate))
    return caught.value


def test_a_good_recording_passes_with_its_measurements() -> None:
    checked = check_recording(wav_bytes(speech_like(5.0), 24000))
    r = checked.report
    assert (r.duration_s, r.sample_rate, r.channels, r.clipped_percent) == (5.0, 24000, 1, 0.0)
    assert -20 < r.speech_dbfs < -6  # syllables peaking at -6 dBFS
    assert r.noise_dbfs < -60 and r.snr_db > 40  # a -70 dBFS noise floor in the pauses
    assert r.advice == ()
    # the audio the engine and speech-to-text get: 16 kHz mono, the whole clip
    assert checked.audio_16k.dtype == np.float32 and len(checked.audio_16k) == 5 * 16000


@pytest.mark.parametrize("rate", [16000, 22050, 44100, 48000])
def test_good_recordings_at_every_usual_rate_and_layout_pass(rate: int) -> None:
    mono = speech_like(4.0, rate)
    assert check_recording(wav_bytes(mono, rate)).report.sample_rate == rate
    stereo = np.stack([mono, 0.8 * mono], axis=1)
    assert check_recording(wav_bytes(stereo, rate)).report.channels == 2
    assert check_recording(float_wav_bytes(mono, rate)).report.duration_s == pytest.approx(4.0)


def test_length_limits() -> None:
    assert refused(speech_like(2.9)).reason == "too_short"
    assert "2.9 s long; record at least 3 s" in str(refused(speech_like(2.9)))
    assert check_recording(wav_bytes(speech_like(3.1), 24000)).report.duration_s == 3.1
    long = refused(speech_like(30.5))
    assert long.reason == "too_long" and "the limit is 30 s" in str(long)
    # accepted, with advice: every sentence spoken with the voice reads the whole prompt
    advice = check_recording(wav_bytes(speech_like(20.0), 24000)).report.advice
    assert len(advice) == 1 and "5–10 s speaks faster" in advice[0]


def test_clipped_recording_is_refused() -> None:
    clipped = refused(np.clip(4 * speech_like(), -1, 1))
    assert clipped.reason == "clipped" and "Move back from the microphone" in str(clipped)
    # a clip normalised to full scale touches it at its peak only: not distorted
    normalised = speech_like()
    normalised /= np.abs(normalised).max()
    report = check_recording(wav_bytes(normalised, 24000)).report
    assert 0 < report.clipped_percent <= MAX_CLIPPED_PERCENT


def test_quiet_recording_is_refused_with_its_level() -> None:
    quiet = refused(0.005 * speech_like())  # speech about -53 dBFS
    assert quiet.reason == "too_quiet" and "too quiet" in str(quiet)
    assert f"needs {MIN_SPEECH_DBFS:.0f} dBFS" in str(quiet)
    # just above the threshold passes
    loud_enough = check_recording(wav_bytes(0.05 * speech_like(), 24000)).report
    assert MIN_SPEECH_DBFS < loud_enough.speech_dbfs < MIN_SPEECH_DBFS + 10
    silent = refused(np.zeros(5 * 24000))
    assert silent.reason == "too_quiet" and "silent" in str(silent)


def test_noisy_recording_is_refused() -> None:
    speech = speech_like(5.0, 24000)
    noisy = refused(speech + white_noise(5.0, 24000, rms=0.1))  # pauses ~ 10 dB down
    assert noisy.reason == "noisy" and "background noise" in str(noisy)
    some_noise = check_recording(wav_bytes(speech + white_noise(5.0, 24000, rms=0.01), 24000))
    assert MIN_SNR_DB < some_noise.report.snr_db < 35  # a fan in the room: still fine


def test_low_sample_rate_is_refused() -> None:
    low = refused(speech_like(5.0, 8000), rate=8000)
    assert low.reason == "low_rate" and "8000 Hz" in str(low)


@pytest.mark.parametrize("data", [b"", b"hello", b"ID3\x03\x00" + bytes(500),
                                  b"RIFF\x10\x00\x00\x00WAVEjunk"])  # fmt: skip
def test_what_is_not_a_wav_file_is_unreadable(data: bytes) -> None:
    with pytest.raises(UnreadableAudio, match="Upload a WAV file"):
        check_recording(data)


def test_not_a_number_is_refused() -> None:
    samples = speech_like(4.0, 16000).astype(np.float32)
    samples[100] = np.nan
    with pytest.raises(RecordingRejected, match="no real audio"):
        check_recording(float_wav_bytes(samples, 16000))
