"""The low-latency stream schedule: close to the whole-utterance audio, seamless, right length.

Both runs get the same tokens and the same flow noise: one global noise tensor over the whole
utterance, from which each chunk takes the frames it covers (the first 34 are pinned to the
previous chunk's by the flow cache anyway). HiFT's random phases and noise are zero, so the only
differences left are the ones chunking itself causes: the flow encoder sees one window of tokens,
the chunk seams are cross-faded, and the sine source restarts per chunk as upstream does.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import DATA

from engine.core.constants import HOP, MEL_CACHE, MEL_OVERLAP, SOURCE_CACHE, tokens_to_frames
from engine.core.streaming import FlowPrompt
from engine.core.types import LOW_LATENCY_SCHEDULE, OFFICIAL_SCHEDULE, StreamSchedule
from engine.cosyvoice1.model_dir import load_model_dir
from engine.cosyvoice1.streaming import (
    ChunkVocoder,
    check_schedule,
    hop_sizes,
    stream_audio,
    whole_audio,
)

N_TOKENS = 260
# Log-spectrogram SNR of streamed vs whole audio. On the tiny random model the official schedule
# reaches 11.3 dB and ours 10.5 dB: its more numerous seams may cost at most 2 dB more than the
# official schedule's, and never fall below 8 dB.
MAX_SNR_LOSS_VS_OFFICIAL_DB = 2.0
MIN_SPECTRAL_SNR_DB = 8.0


class SlicedNoise:
    """Flow noise as consecutive slices of one long tensor; HiFT noise all zero."""

    def __init__(self, total_frames: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.z = torch.randn(1, 80, total_frames + 4 * MEL_OVERLAP, generator=gen)
        self.offset = 0

    def flow_noise(self, shape: tuple[int, ...]) -> torch.Tensor:
        frames = shape[2]
        out = self.z[:, :, self.offset : self.offset + frames].clone()
        # The next chunk starts with the 34 frames this one ends with (the token overlap).
        self.offset += frames - MEL_OVERLAP
        return out

    def hift_noise(self, n_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(1, 9, 1), torch.zeros(1, 9, n_samples)


@pytest.fixture(scope="module")
def models():
    return load_model_dir(DATA / "tiny_model")


def _run(models, schedule: StreamSchedule) -> tuple[np.ndarray, list[np.ndarray]]:
    tokens = torch.randint(0, 4096, (N_TOKENS,), generator=torch.Generator().manual_seed(3))
    prompt = FlowPrompt(torch.randn(1, 192, generator=torch.Generator().manual_seed(4)))
    frames = tokens_to_frames(N_TOKENS)
    with torch.inference_mode():
        whole = whole_audio(
            tokens.tolist(), ChunkVocoder(models.flow, models.hift, prompt, SlicedNoise(frames))
        )
        chunks = list(
            stream_audio(
                iter(tokens.tolist()),
                ChunkVocoder(models.flow, models.hift, prompt, SlicedNoise(frames)),
                schedule,
            )
        )
    return whole[0].numpy(), [c[0].numpy() for c in chunks]


@pytest.fixture(scope="module")
def runs(models):
    return _run(models, LOW_LATENCY_SCHEDULE)


@pytest.fixture(scope="module")
def official_runs(models):
    return _run(models, OFFICIAL_SCHEDULE)


def expected_stream_length(n_tokens: int, schedule: StreamSchedule) -> int:
    """Samples the orchestration must emit for ``n_tokens`` under ``schedule``."""
    hops, total, remaining, first = hop_sizes(schedule), 0, n_tokens, True
    hop = next(hops)
    while remaining >= hop + schedule.overlap:
        frames = tokens_to_frames(hop + schedule.overlap) - MEL_OVERLAP
        total += (frames + (0 if first else MEL_CACHE)) * HOP - SOURCE_CACHE
        remaining -= hop
        first, hop = False, next(hops)
    return total + (tokens_to_frames(remaining) + (0 if first else MEL_CACHE)) * HOP


def _log_spectrogram(x: np.ndarray) -> np.ndarray:
    spec = torch.stft(
        torch.from_numpy(x), 1024, 256, window=torch.hann_window(1024), return_complex=True
    ).abs()
    return np.log(spec.numpy() + 1e-5)


def test_first_chunk_is_early(runs) -> None:
    _, chunks = runs
    first_tokens = LOW_LATENCY_SCHEDULE.first_hop + LOW_LATENCY_SCHEDULE.overlap
    assert first_tokens < OFFICIAL_SCHEDULE.first_hop + OFFICIAL_SCHEDULE.overlap
    # 41 tokens → 70 frames, 34 held back for the fade, 5120 samples held for HiFT's fade.
    assert len(chunks[0]) == (tokens_to_frames(first_tokens) - MEL_OVERLAP) * HOP - SOURCE_CACHE


def test_hops_grow_to_the_maximum() -> None:
    hops = hop_sizes(LOW_LATENCY_SCHEDULE)
    seq = [next(hops) for _ in range(6)]
    assert seq == sorted(seq) and seq[0] == LOW_LATENCY_SCHEDULE.first_hop
    assert seq[-1] == LOW_LATENCY_SCHEDULE.max_hop


def test_stream_length_is_exact(runs) -> None:
    whole, chunks = runs
    total = sum(len(c) for c in chunks)
    assert total == expected_stream_length(N_TOKENS, LOW_LATENCY_SCHEDULE)
    # Per-chunk frame flooring may cost at most one frame per chunk versus the whole utterance.
    assert abs(total - len(whole)) <= HOP * len(chunks)


def _spectral_snr_db(whole: np.ndarray, chunks: list[np.ndarray]) -> float:
    stream = np.concatenate(chunks)
    n = min(len(whole), len(stream))
    ref, test = _log_spectrogram(whole[:n]), _log_spectrogram(stream[:n])
    return float(10 * np.log10(np.sum(ref**2) / np.sum((ref - test) ** 2)))


def test_stream_is_close_to_whole_audio(runs, official_runs) -> None:
    ours = _spectral_snr_db(*runs)
    official = _spectral_snr_db(*official_runs)
    assert ours >= MIN_SPECTRAL_SNR_DB, ours
    assert ours >= official - MAX_SNR_LOSS_VS_OFFICIAL_DB, (ours, official)


def test_no_clicks_at_chunk_boundaries(runs) -> None:
    _, chunks = runs
    stream = np.concatenate(chunks)
    steps = np.abs(np.diff(stream))
    ceiling = np.max(steps)  # the signal's own largest sample-to-sample step
    boundary = np.cumsum([len(c) for c in chunks])[:-1]
    for b in boundary:
        assert abs(stream[b] - stream[b - 1]) <= ceiling
        # and not an outlier in its neighbourhood either
        local = steps[max(0, b - 512) : b + 512]
        assert abs(stream[b] - stream[b - 1]) <= np.percentile(local, 99.9)


@pytest.mark.parametrize(
    "bad",
    [
        StreamSchedule(first_hop=10),
        StreamSchedule(overlap=10),
        StreamSchedule(first_hop=50, max_hop=30),
    ],
)
def test_bad_schedules_are_rejected(bad: StreamSchedule) -> None:
    with pytest.raises(ValueError):
        check_schedule(bad)
