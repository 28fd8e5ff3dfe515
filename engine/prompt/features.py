"""The three prompt feature extractors of the frontend (tests/data/zero_shot/README.md §3).

* :func:`prompt_mel` — the flow's 80-bin log-mel (matcha ``mel_spectrogram``) with a model
  family's yaml parameters (:class:`MelSpec`: v1 22050 Hz, v2 24 kHz), layout (1, T, 80);
* :func:`kaldi_fbank` / :func:`campplus_input` — 80-bin Kaldi fbank of 16 kHz audio in [-1, 1]
  (torchaudio ``compliance.kaldi.fbank`` defaults), mean-normalised for CAM++;
* :func:`whisper_log_mel` — whisper's 128-bin log-mel of 16 kHz audio for the speech tokenizer.

Each follows the reference's float32 op order, so outputs match to float32 accumulation noise.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import overload

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MelSpec:
    """A yaml's ``feat_extractor``: window = n_fft, fmin 0, no centring (reflect padding)."""

    sample_rate: int
    n_fft: int
    hop: int
    n_mels: int = 80
    fmax: float = 8000.0


V1_PROMPT_MEL = MelSpec(sample_rate=22050, n_fft=1024, hop=256)
V2_PROMPT_MEL = MelSpec(sample_rate=24000, n_fft=1920, hop=480)

# Kaldi defaults at 16 kHz: 25 ms window, 10 ms shift, FFT rounded up to a power of two.
FBANK_WIN, FBANK_SHIFT, FBANK_FFT, FBANK_BINS, FBANK_LOW_HZ = 400, 160, 512, 80, 20.0
PREEMPH, POVEY_POWER = 0.97, 0.85
# Whisper: 25 ms / 10 ms at 16 kHz, 128 mel bins for the v1 speech tokenizer.
WHISPER_N_FFT, WHISPER_HOP, WHISPER_BINS = 400, 160, 128


# --- Slaney mel filterbank (librosa.filters.mel defaults: Slaney scale, area normalisation) ---

_F_SP = 200.0 / 3  # Hz per mel below 1 kHz
_MIN_LOG_HZ = 1000.0
_MIN_LOG_MEL = _MIN_LOG_HZ / _F_SP
_LOGSTEP = math.log(6.4) / 27.0


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    mel = hz / _F_SP
    log_part = hz >= _MIN_LOG_HZ
    mel[log_part] = _MIN_LOG_MEL + np.log(hz[log_part] / _MIN_LOG_HZ) / _LOGSTEP
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = _F_SP * mel
    log_part = mel >= _MIN_LOG_MEL
    hz[log_part] = _MIN_LOG_HZ * np.exp(_LOGSTEP * (mel[log_part] - _MIN_LOG_MEL))
    return hz


@functools.lru_cache(maxsize=8)
def slaney_mel_filters(
    sr: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> torch.Tensor:
    """(n_mels, n_fft//2 + 1) float32 triangular filters, each with unit area in Hz.

    Computed in float64, stored to float32, then scaled by the area norm in float64 and
    rounded again — the two roundings the reference does (its weight matrix is float32).
    """
    fmax = sr / 2.0 if fmax is None else fmax
    fft_hz = np.arange(n_fft // 2 + 1) * (1.0 / (n_fft * (1.0 / sr)))
    edges = np.array([fmin, fmax], dtype=np.float64)
    mel_min, mel_max = _hz_to_mel(edges)
    mels = np.linspace(mel_min, mel_max, n_mels + 2)
    mel_hz = _mel_to_hz(mels)
    fdiff = np.diff(mel_hz)
    ramps = mel_hz[:, None] - fft_hz[None, :]
    weights = np.zeros((n_mels, n_fft // 2 + 1), dtype=np.float32)
    for i in range(n_mels):
        lower = -ramps[i] / fdiff[i]
        upper = ramps[i + 2] / fdiff[i + 1]
        weights[i] = np.maximum(0.0, np.minimum(lower, upper))
    enorm = 2.0 / (mel_hz[2 : n_mels + 2] - mel_hz[:n_mels])
    weights = (weights.astype(np.float64) * enorm[:, None]).astype(np.float32)
    return torch.from_numpy(weights)


# --- prompt mel for the flow ------------------------------------------------------------------


def prompt_mel(wave: torch.Tensor, spec: MelSpec = V1_PROMPT_MEL) -> torch.Tensor:
    """float32 (1, N) audio at ``spec.sample_rate`` -> (1, T, n_mels) natural-log mel.

    T = (N - hop) // hop + 1: the signal is reflect-padded by (n_fft - hop) / 2 on each side.
    """
    y = wave.reshape(1, -1).to(torch.float32)
    pad = (spec.n_fft - spec.hop) // 2
    if y.shape[1] <= pad:
        raise ValueError(f"prompt too short for the mel extractor ({y.shape[1]} samples)")
    y = F.pad(y.unsqueeze(1), (pad, pad), mode="reflect").squeeze(1)
    stft = torch.stft(
        y,
        spec.n_fft,
        hop_length=spec.hop,
        win_length=spec.n_fft,
        window=torch.hann_window(spec.n_fft),
        center=False,
        normalized=False,
        onesided=True,
        return_complex=True,
    )
    parts = torch.view_as_real(stft)
    mag = torch.sqrt(parts.pow(2).sum(-1) + 1e-9)
    basis = slaney_mel_filters(spec.sample_rate, spec.n_fft, spec.n_mels, 0.0, spec.fmax)
    mel = torch.matmul(basis, mag)
    return torch.log(torch.clamp(mel, min=1e-5)).transpose(1, 2)


# --- Kaldi fbank for CAM++ ---------------------------------------------------------------------


@overload
def _kaldi_mel(hz: torch.Tensor) -> torch.Tensor: ...
@overload
def _kaldi_mel(hz: float) -> float: ...
def _kaldi_mel(hz: torch.Tensor | float) -> torch.Tensor | float:
    if isinstance(hz, torch.Tensor):
        return 1127.0 * (1.0 + hz / 700.0).log()
    return 1127.0 * math.log(1.0 + hz / 700.0)


@functools.lru_cache(maxsize=2)
def kaldi_mel_banks(
    num_bins: int = FBANK_BINS,
    n_fft: int = FBANK_FFT,
    sample_rate: int = 16000,
    low_hz: float = FBANK_LOW_HZ,
) -> torch.Tensor:
    """(num_bins, n_fft//2 + 1) float32 triangles on the Kaldi mel scale; last column zero."""
    n_bins = n_fft // 2
    high_hz = sample_rate / 2.0
    mel_low, mel_high = _kaldi_mel(low_hz), _kaldi_mel(high_hz)
    delta = (mel_high - mel_low) / (num_bins + 1)
    # Integer tensor times Python floats: float32 arithmetic, as in the reference.
    index = torch.arange(num_bins).unsqueeze(1)
    left = mel_low + index * delta
    center = mel_low + (index + 1.0) * delta
    right = mel_low + (index + 2.0) * delta
    mel = _kaldi_mel((sample_rate / n_fft) * torch.arange(n_bins)).unsqueeze(0)
    up = (mel - left) / (center - left)
    down = (right - mel) / (right - center)
    banks = torch.max(torch.zeros(1), torch.min(up, down))
    return F.pad(banks, (0, 1), mode="constant", value=0.0)


@functools.lru_cache(maxsize=1)
def povey_window(size: int = FBANK_WIN) -> torch.Tensor:
    return torch.hann_window(size, periodic=False).pow(POVEY_POWER)


def kaldi_fbank(wave_16k: torch.Tensor) -> torch.Tensor:
    """float32 (1, N) or (N,) 16 kHz audio in [-1, 1] -> (T, 80) log fbank, T = 1 + (N-400)//160."""
    x = wave_16k.reshape(-1).to(torch.float32)
    if x.numel() < FBANK_WIN:
        raise ValueError(f"prompt too short for the fbank ({x.numel()} samples, need 400)")
    frames = x.as_strided((1 + (x.numel() - FBANK_WIN) // FBANK_SHIFT, FBANK_WIN), (FBANK_SHIFT, 1))
    frames = frames - frames.mean(dim=1, keepdim=True)  # remove DC offset
    # Pre-emphasis with the first sample repeated as its own predecessor.
    previous = F.pad(frames.unsqueeze(0), (1, 0), mode="replicate").squeeze(0)[:, :-1]
    frames = frames - PREEMPH * previous
    frames = frames * povey_window().unsqueeze(0)
    frames = F.pad(
        frames.unsqueeze(0), (0, FBANK_FFT - FBANK_WIN), mode="constant", value=0.0
    ).squeeze(0)
    power = torch.fft.rfft(frames).abs().pow(2.0)
    mel = torch.mm(power, kaldi_mel_banks().T)
    eps = torch.tensor(torch.finfo(torch.float32).eps)
    return torch.max(mel, eps).log()


def campplus_input(wave_16k: torch.Tensor) -> torch.Tensor:
    """The CAM++ feed (1, T, 80): fbank minus its per-utterance mean."""
    feat = kaldi_fbank(wave_16k)
    return (feat - feat.mean(dim=0, keepdim=True)).unsqueeze(0)


# --- whisper log-mel for the speech tokenizer -------------------------------------------------


def whisper_log_mel(wave_16k: torch.Tensor, n_mels: int = WHISPER_BINS) -> torch.Tensor:
    """float32 (1, N) 16 kHz audio -> (1, n_mels, N//160) whisper log-mel."""
    audio = wave_16k.reshape(1, -1).to(torch.float32)
    if audio.shape[1] <= WHISPER_N_FFT // 2:
        raise ValueError(f"prompt too short for the whisper mel ({audio.shape[1]} samples)")
    stft = torch.stft(
        audio,
        WHISPER_N_FFT,
        WHISPER_HOP,
        window=torch.hann_window(WHISPER_N_FFT),
        return_complex=True,
    )  # center=True, reflect padding
    power = stft[..., :-1].abs() ** 2  # the last (half-padded) frame is dropped
    filters = slaney_mel_filters(16000, WHISPER_N_FFT, n_mels)
    log_spec = torch.clamp(filters @ power, min=1e-10).log10()
    # Floor 80 dB below the loudest value of the whole utterance.
    log_spec = torch.maximum(log_spec, log_spec.max() - 8.0)
    return (log_spec + 4.0) / 4.0
