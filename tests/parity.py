"""Tolerances the v1 and CosyVoice2 parity tests share.

Each is four times the official implementation's own spread on the stored reference inputs (across
1, 2 and 4 threads, ATen's default and AVX2 kernels, oneDNN and MKL capped at SSE, the CPUs the
reference data was made and checked on, and an emulated Arm Cortex-A76), rounded up to two
digits. The measurements are in the tolerance tables of tests/data/README.md and
tests/data/cosyvoice2/README.md.
"""

from __future__ import annotations

import itertools
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# A test marked as a whole, or one of its parameters marked.
PARITY_MARK = re.compile(r"^@pytest\.mark\.parity$|marks=pytest\.mark\.parity\b", re.MULTILINE)


def parity_files() -> list[str]:
    """The test files that hold parity tests, relative to tests/ (the subset runs without
    collecting the rest of the suite, whose test-only packages a board may not have)."""
    return sorted(
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if PARITY_MARK.search(path.read_text(encoding="utf-8"))
    )


# F0 in Hz, relative: 1.7e-5 across x86 kernel paths, 2.1e-5 on emulated aarch64.
F0_RTOL = 8.4e-5
# The harmonic source of one HiFT call on a stored mel (|source| <= 1): 5.2e-5 (v1, ATen's
# default kernels), 4.3e-5 (v2), 4.2e-5 on an AVX-512 Xeon; it grows with the call's length.
SOURCE_ATOL = 2.1e-4
# The waveform of one HiFT call on a stored mel of about a second: 1.0e-5 across x86 kernel
# paths, 1.03e-5 on emulated aarch64.
HIFT_AUDIO_ATOL = 4.2e-5
# Whole utterances and stream chunks: the official waveform drifts as small f0 differences
# accumulate in the harmonic phase, up to 3.8e-5 per second of audio (1 vs 2 threads, 143-212
# CosyVoice2 tokens); the stored cases reach 3.8e-5 over a 4 s chunk.
WAVEFORM_ATOL_PER_SECOND = 1.6e-4


def waveform_atol(samples: int, sample_rate: int) -> float:
    """The tolerance of a waveform compared with the official one: it grows with its length."""
    return max(HIFT_AUDIO_ATOL, WAVEFORM_ATOL_PER_SECOND * samples / sample_rate)


def stream_atols(chunk_samples: list[int], sample_rate: int) -> list[float]:
    """The tolerance of each chunk of a stream: the harmonic phase carries from one chunk to the
    next (HiFT's cached source), so a chunk's drift grows with the audio up to its end, not with
    its own length (on aarch64 the official last chunk of noprompt180, 0.36 s at 7.2 s, is 6.1e-5
    from the stored one)."""
    ends = itertools.accumulate(chunk_samples)
    return [waveform_atol(end, sample_rate) for end in ends]


# Prompt features on emulated aarch64 (x86 kernel paths moved them less): the prompt mels
# 1.14e-5, the whisper log-mel 1.40e-5.
PROMPT_MEL_ATOL = 4.6e-5
WHISPER_LOG_MEL_ATOL = 5.6e-5
# Kaldi fbank (and the CAM++ feed made from it): 1.34e-5 with ATen's default kernels, 6.39e-5
# on emulated aarch64.
FBANK_ATOL = 2.6e-4
# The CAM++ stand-in's embedding of a prompt: 1.4e-6 across x86 kernel paths, 2.06e-6 on
# emulated aarch64.
EMBEDDING_ATOL = 8.3e-6
