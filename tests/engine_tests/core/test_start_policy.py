"""The gapless start policy, driven by a fake clock: no stall after release, no needless wait."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from engine.core.start_policy import estimate_speech_seconds, hold_until_gapless
from engine.core.types import AudioChunk

SR = 22050


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def produce(clock: FakeClock, chunk_s: list[float], rtf: float) -> Iterator[AudioChunk]:
    """Chunks that each take ``rtf`` times their duration to compute."""
    for seconds in chunk_s:
        clock.now += seconds * rtf
        yield AudioChunk(np.zeros(int(seconds * SR), dtype=np.float32))


def playback(arrivals: list[float], durations: list[float]) -> tuple[float, float]:
    """(start time, total stall) of a player starting at the first released chunk."""
    play_end, stall = arrivals[0], 0.0
    for arrival, duration in zip(arrivals, durations, strict=True):
        if arrival > play_end:
            stall += arrival - play_end
            play_end = arrival
        play_end += duration
    return arrivals[0], stall


def run(policy: str, rtf: float, chunk_s: list[float]) -> tuple[float, float]:
    clock = FakeClock()
    chunks = produce(clock, chunk_s, rtf)
    if policy == "gapless":
        chunks = hold_until_gapless(chunks, sum(chunk_s), clock=clock)
    arrivals, durations = [], []
    for chunk in chunks:
        arrivals.append(clock.now)
        durations.append(chunk.duration_s)
    assert abs(sum(durations) - sum(chunk_s)) < 1e-3  # nothing lost or duplicated
    return playback(arrivals, durations)


CHUNKS = [0.27, 1.0, 2.0, 2.0, 2.0, 0.7]


def test_gapless_never_stalls_when_slower_than_real_time() -> None:
    eager_start, eager_stall = run("eager", 3.0, CHUNKS)
    gapless_start, gapless_stall = run("gapless", 3.0, CHUNKS)
    assert eager_stall > 5.0  # the eager player waits a lot at RTF 3
    assert gapless_stall == 0.0
    assert gapless_start > eager_start


def test_gapless_starts_at_once_when_faster_than_real_time() -> None:
    assert run("gapless", 0.5, CHUNKS) == run("eager", 0.5, CHUNKS)


def test_gapless_releases_everything_when_the_estimate_is_too_long() -> None:
    clock = FakeClock()
    out = list(hold_until_gapless(produce(clock, [0.5, 0.5], 3.0), 100.0, clock=clock))
    assert len(out) == 2


def test_speech_length_estimate() -> None:
    assert estimate_speech_seconds("anything", forced_tokens=400) == 8.0
    zh = estimate_speech_seconds("您好，您咨询的壳子有现货。")
    en = estimate_speech_seconds("The temperature is twenty one degrees.")
    assert 2.0 < zh < 3.5 and 1.5 < en < 3.0
