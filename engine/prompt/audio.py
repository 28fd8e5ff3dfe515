"""Prompt audio: WAV reading (stdlib only), mono mix and band-limited sinc resampling.

The official frontend reads prompts with soundfile as float32 (PCM scaled by 1/2^(bits-1)),
averages the channels and resamples with ``torchaudio.transforms.Resample`` defaults
(tests/data/zero_shot/README.md §2.2). We do the same without soundfile/torchaudio: ``wave`` for
integer PCM, our own RIFF chunk walk for IEEE-float and WAVE_FORMAT_EXTENSIBLE files, and a sinc
kernel built exactly like the reference (including its float32 phase step, which makes the kernel
bit-exact).
"""

from __future__ import annotations

import functools
import io
import logging
import math
import struct
import wave
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.prompt.errors import VoiceError

_LOGGER = logging.getLogger(__name__)

_PCM, _FLOAT, _EXTENSIBLE = 1, 3, 0xFFFE
# Sinc resampler defaults of the reference (lowpass_filter_width, rolloff).
_WIDTH = 6
_ROLLOFF = 0.99


@dataclass(frozen=True)
class WavInfo:
    """Header facts of a WAV file."""

    sample_rate: int
    channels: int
    frames: int
    fmt: str  # e.g. "pcm16", "float32"

    @property
    def duration_s(self) -> float:
        return self.frames / self.sample_rate


def _chunks(data: bytes) -> dict[bytes, tuple[int, int]]:
    """RIFF chunk id -> (offset, size) of its payload (first occurrence)."""
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise VoiceError("not a WAV file (no RIFF/WAVE header)")
    found: dict[bytes, tuple[int, int]] = {}
    pos = 12
    while pos + 8 <= len(data):
        cid, size = data[pos : pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        # Writers that stream audio leave the data size at 0 or 0xFFFFFFFF: take the rest.
        if cid == b"data" and (size == 0 or pos + 8 + size > len(data)):
            size = len(data) - pos - 8
        found.setdefault(cid, (pos + 8, size))
        pos += 8 + size + (size & 1)  # chunks are word-aligned
    if b"fmt " not in found or b"data" not in found:
        raise VoiceError("broken WAV file (no fmt or data chunk)")
    return found


def _decode(raw: bytes, tag: int, bits: int, channels: int) -> np.ndarray:
    """Interleaved sample bytes -> float32 (channels, frames), soundfile's scaling."""
    width = bits // 8
    usable = len(raw) - len(raw) % (width * channels)
    raw = raw[:usable]
    if tag == _FLOAT and bits in (32, 64):
        samples = np.frombuffer(raw, dtype="<f4" if bits == 32 else "<f8").astype(np.float64)
    elif tag == _PCM and bits == 8:
        samples = (np.frombuffer(raw, dtype=np.uint8).astype(np.float64) - 128.0) / 128.0
    elif tag == _PCM and bits in (16, 32):
        dtype = "<i2" if bits == 16 else "<i4"
        samples = np.frombuffer(raw, dtype=dtype).astype(np.float64) / float(2 ** (bits - 1))
    elif tag == _PCM and bits == 24:
        b = np.frombuffer(raw, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend
        samples = ints.astype(np.float64) / float(2**23)
    else:
        kind = "float" if tag == _FLOAT else "PCM" if tag == _PCM else f"format 0x{tag:04x}"
        raise VoiceError(
            f"unsupported WAV encoding ({kind}, {bits} bit); use 16/24/32-bit PCM or 32-bit float"
        )
    return samples.reshape(-1, channels).T.astype(np.float32)


def _read_riff(data: bytes, max_seconds: float | None) -> tuple[np.ndarray, WavInfo]:
    """Any WAV the ``wave`` module refuses: IEEE float, WAVE_FORMAT_EXTENSIBLE."""
    chunks = _chunks(data)
    off, size = chunks[b"fmt "]
    if size < 16:
        raise VoiceError("broken WAV file (short fmt chunk)")
    tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, off)
    if tag == _EXTENSIBLE:
        if size < 40:
            raise VoiceError("broken WAV file (short WAVE_FORMAT_EXTENSIBLE fmt chunk)")
        # The sub-format GUID starts with the plain format tag.
        tag = struct.unpack_from("<H", data, off + 24)[0]
    if channels < 1 or rate < 1 or bits not in (8, 16, 24, 32, 64):
        raise VoiceError(f"broken WAV header ({channels} channels, {rate} Hz, {bits} bit)")
    doff, dsize = chunks[b"data"]
    frames = dsize // (channels * bits // 8)
    info = WavInfo(rate, channels, frames, f"{'float' if tag == _FLOAT else 'pcm'}{bits}")
    _check_length(info, max_seconds)
    return _decode(data[doff : doff + dsize], tag, bits, channels), info


def _check_length(info: WavInfo, max_seconds: float | None) -> None:
    # Checked on the header so a long file is refused before it is decoded.
    if max_seconds is not None and info.duration_s > max_seconds:
        raise VoiceError(
            f"recording is {info.duration_s:.1f} s long; the limit is "
            f"{max_seconds:g} s (3-10 s of clear speech works best)"
        )


def read_wav(path: Path | str, max_seconds: float | None = None) -> tuple[np.ndarray, WavInfo]:
    """(float32 samples (channels, frames) in [-1, 1], header info); VoiceError if unusable."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as err:
        raise VoiceError(f"cannot read {path.name}: {err.strerror or err}") from err
    return decode_wav(data, max_seconds)


def decode_wav(data: bytes, max_seconds: float | None = None) -> tuple[np.ndarray, WavInfo]:
    """:func:`read_wav` for a WAV file's bytes (an upload, before it is saved)."""
    try:
        with wave.open(io.BytesIO(data), "rb") as wav:
            info = WavInfo(
                wav.getframerate(),
                wav.getnchannels(),
                wav.getnframes(),
                f"pcm{8 * wav.getsampwidth()}",
            )
            _check_length(info, max_seconds)
            raw = wav.readframes(info.frames)
            samples = _decode(raw, _PCM, 8 * wav.getsampwidth(), info.channels)
    except (wave.Error, EOFError, struct.error):
        # Float and extensible WAVs (and broken ones): walk the chunks ourselves.
        samples, info = _read_riff(data, max_seconds)
    if samples.shape[1] == 0:
        raise VoiceError("the WAV file holds no audio samples")
    return samples, info


def to_mono(samples: np.ndarray | torch.Tensor) -> torch.Tensor:
    """(channels, N) -> float32 (1, N): the channel mean, as the official loader does."""
    x = torch.as_tensor(samples, dtype=torch.float32)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    return x.mean(dim=0, keepdim=True)


@functools.lru_cache(maxsize=8)
def sinc_kernel(orig_freq: int, new_freq: int) -> tuple[torch.Tensor, int, int, int]:
    """(kernel (n, 1, 2·width + o), width, o, n) for resampling o:n (rates divided by gcd).

    A Hann-windowed sinc at 0.99 × the lower Nyquist, 6 zero crossings. The phase offsets
    -j/n are deliberately computed in float32 (the reference builds them with the default
    dtype) and everything else in float64, then the kernel is rounded to float32: this is
    what makes it bit-identical to the reference kernel (pure float64 is 1.3e-5 off).
    """
    g = math.gcd(orig_freq, new_freq)
    o, n = orig_freq // g, new_freq // g
    base = min(o, n) * _ROLLOFF
    width = math.ceil(_WIDTH * o / base)
    idx = torch.arange(-width, width + o, dtype=torch.float64).view(1, 1, -1) / o
    phase = (torch.arange(0, -n, -1) / n).to(torch.float32)  # int64 / int -> float32
    t = ((phase.double().view(-1, 1, 1) + idx) * base).clamp(-_WIDTH, _WIDTH)
    window = torch.cos(t * math.pi / _WIDTH / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones((), dtype=torch.float64), torch.sin(t) / t)
    kernel = sinc * (window * (base / o))
    return kernel.to(torch.float32), width, o, n


def resample(wave_: torch.Tensor, orig_freq: int, new_freq: int) -> torch.Tensor:
    """Resample (..., N) float32 audio from ``orig_freq`` to ``new_freq`` Hz."""
    if orig_freq == new_freq:
        return wave_
    kernel, width, o, n = sinc_kernel(orig_freq, new_freq)
    shape = wave_.shape
    x = wave_.reshape(-1, shape[-1]).to(torch.float32)
    length = x.shape[-1]
    x = torch.nn.functional.pad(x, (width, width + o))
    # Each output phase j is one kernel row; stride o walks whole input periods.
    y = torch.nn.functional.conv1d(x.unsqueeze(1), kernel, stride=o)  # (B, n, frames)
    y = y.transpose(1, 2).reshape(x.shape[0], -1)
    target = -(-n * length // o)  # ceil(n·N/o)
    return y[:, :target].reshape(*shape[:-1], -1)


@dataclass(frozen=True)
class PromptRecording:
    """A prompt WAV mixed to mono, at the file's own rate."""

    mono: torch.Tensor  # float32 (1, N)
    info: WavInfo

    def at(self, rate: int) -> torch.Tensor:
        """float32 (1, M) at ``rate`` Hz (resampled from the file's rate, as the reference does)."""
        return resample(self.mono, self.info.sample_rate, rate)


def load_prompt(
    path: Path | str, max_seconds: float | None = None, min_rate: int = 16000
) -> PromptRecording:
    """A prompt WAV as mono float32; VoiceError if unusable or below ``min_rate``."""
    samples, info = read_wav(path, max_seconds)
    if info.sample_rate < min_rate:
        raise VoiceError(
            f"sample rate {info.sample_rate} Hz is too low; record at "
            f"{min_rate} Hz or more (44100 or 48000 is fine)"
        )
    return PromptRecording(to_mono(samples), info)


def load_prompt_16k(
    path: Path | str, max_seconds: float | None = None, min_rate: int = 16000
) -> tuple[torch.Tensor, WavInfo]:
    """A prompt WAV as float32 (1, N) mono at 16 kHz (what CAM++ and the tokenizer read)."""
    recording = load_prompt(path, max_seconds, min_rate)
    if recording.info.sample_rate != 16000:
        _LOGGER.debug(
            "Resampling %s from %d Hz to 16000 Hz", Path(path).name, recording.info.sample_rate
        )
    return recording.at(16000), recording.info
