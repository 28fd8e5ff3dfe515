"""Paced streaming hops: each chunk no larger than the listener's buffer can cover, on a
simulated machine whose chunks cost a fixed part plus a part per token (a fake clock)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from engine.core.pacing import ChunkCosts, ChunkPacer, paces
from engine.core.types import LOW_LATENCY_SCHEDULE, SynthesisOptions
from engine.cosyvoice2.streaming import stream_audio

SAMPLE_RATE = 1000  # samples a second: one sample a millisecond keeps the arithmetic plain
TOKEN_S = 0.04  # audio seconds of a speech token (CosyVoice2's)
CHUNK = 25  # tokens of an attention chunk


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedSpeech:
    """A stream whose chunks cost ``fixed`` seconds plus ``per_token`` a token and give each
    token's audio, the first chunk less ``held_back`` seconds (a vocoder's cross-fade)."""

    lookahead = 0

    def __init__(self, clock: Clock, fixed: float, per_token: float, held_back: float) -> None:
        self.clock, self.fixed, self.per_token, self.held_back = clock, fixed, per_token, held_back
        self.first = True

    def push(self, tokens: list[int], *, finalize: bool = False) -> torch.Tensor:
        self.clock.now += self.fixed + self.per_token * len(tokens)
        seconds = len(tokens) * TOKEN_S - (self.held_back if self.first else 0.0)
        self.first = False
        return torch.zeros(1, round(seconds * SAMPLE_RATE))


def _tokens(clock: Clock, n: int, prefill: float) -> Iterator[int]:
    clock.now += prefill  # the LM's prefill before the first token
    yield from range(n)


def _chunk_hops(first: int) -> Iterator[int]:
    """A growing schedule on attention chunks: ``first``, then 25, 50, 100, 100…"""
    yield first
    yield from itertools.chain((25, 50), itertools.repeat(100))


def _stall(arrivals: list[float], durations: list[float]) -> float:
    stall, plays_until = 0.0, arrivals[0] + durations[0]
    for at, duration in zip(arrivals[1:], durations[1:], strict=True):
        stall += max(0.0, at - plays_until)
        plays_until = max(plays_until, at) + duration
    return stall


def _stream(paced: bool, *, first: int, per_token: float, n_tokens: int = 200) -> dict:
    clock = Clock()
    speech = SimulatedSpeech(clock, fixed=0.05, per_token=per_token, held_back=0.16)
    pacer = ChunkPacer(
        _chunk_hops(first), paced=paced, step=CHUNK, smallest=CHUNK, token_s=TOKEN_S,
        sample_rate=SAMPLE_RATE, clock=clock,
    )  # fmt: skip
    arrivals, durations = [], []
    for audio in stream_audio(_tokens(clock, n_tokens, prefill=0.7), speech, pacer):  # type: ignore[arg-type]
        arrivals.append(clock.now)
        durations.append(audio.shape[1] / SAMPLE_RATE)
    return {"stall": _stall(arrivals, durations), "hops": pacer.chosen, "end": arrivals[-1]}


def test_unpaced_hops_are_the_schedules() -> None:
    run = _stream(False, first=22, per_token=0.027)
    assert run["hops"][:4] == [22, 25, 50, 100]


def test_paced_hops_keep_a_machine_near_real_time_from_stalling() -> None:
    """A token costs 0.027 s for its 0.04 s of audio: the schedule's doubling hops stall
    (each costs more than the last left to play); paced ones keep within the buffer."""
    unpaced = _stream(False, first=22, per_token=0.027)
    paced = _stream(True, first=22, per_token=0.027)
    assert unpaced["stall"] > 0.3
    assert paced["stall"] < 0.05
    assert min(paced["hops"][1:]) == CHUNK and max(paced["hops"]) > CHUNK  # grows as it can
    assert all(hop % CHUNK == 0 for hop in paced["hops"][1:])
    assert paced["end"] < unpaced["end"] * 1.15  # more chunks, not much more work


def test_paced_hops_never_exceed_the_schedule_or_its_growth() -> None:
    """On a fast machine pacing changes nothing: the schedule's hops are the largest."""
    fast = _stream(True, first=22, per_token=0.002)
    assert fast["hops"][:4] == [22, 25, 50, 100]


def test_where_nothing_fits_the_smallest_chunk_is_cut() -> None:
    """Just faster than real time (0.925 s for a 1 s chunk): no chunk fits the short buffer,
    and the smallest makes the listener wait least."""
    near = _stream(True, first=22, per_token=0.035, n_tokens=300)
    assert near["hops"][1:5] == [CHUNK] * 4
    assert near["stall"] < 0.5 * _stream(False, first=22, per_token=0.035, n_tokens=300)["stall"]


def test_slower_than_real_time_keeps_the_schedules_hops() -> None:
    """Where even the schedule's hop takes longer to make than to play, the listener waits
    whatever the hop, and small chunks would only add their fixed costs."""
    slow = _stream(True, first=22, per_token=0.06, n_tokens=300)
    assert slow["hops"] == _stream(False, first=22, per_token=0.06, n_tokens=300)["hops"]


def test_cost_fit_recovers_a_fixed_and_per_token_part() -> None:
    costs = ChunkCosts()
    for tokens in (14, 25, 50, 25):
        costs.add(tokens, 0.2 + 0.02 * tokens)
    fixed, per_token = costs.fit() or (0.0, 0.0)
    assert fixed == pytest.approx(0.2)
    assert per_token == pytest.approx(0.02)


def test_cost_fit_of_one_size_counts_it_all_per_token() -> None:
    costs = ChunkCosts()
    costs.add(25, 0.75)
    assert costs.fit() == (0.0, pytest.approx(0.03))


def test_a_flat_noisy_fit_still_charges_for_tokens() -> None:
    """Two chunks costing the same whatever their size must not make tokens free."""
    costs = ChunkCosts()
    costs.add(41, 0.5)
    costs.add(21, 0.5)
    fixed, per_token = costs.fit() or (0.0, 0.0)
    assert per_token >= 0.5 * 0.5 / 21
    assert fixed + per_token * 21 == pytest.approx(0.5, abs=0.1)


def test_a_paced_hop_grows_from_the_last_one_as_the_schedule_grows() -> None:
    """A fit read from small chunks says least about much larger ones: however much audio
    waits, the hop after a paced 21 is at most twice that."""
    clock = Clock()
    pacer = ChunkPacer(
        iter([21, 100, 100, 100]), paced=True, growth=2.0, smallest=21, token_s=0.02,
        sample_rate=SAMPLE_RATE, clock=clock,
    )  # fmt: skip
    assert pacer.first() == 21
    pacer.started()
    clock.now = 0.4
    pacer.delivered(190, tokens=41)  # 0.19 s to play, 0.4 s to make
    assert pacer.next() == 21  # the buffer covers no more than the smallest
    clock.now = 0.7
    pacer.delivered(10_000, tokens=21)  # then plenty waits
    assert pacer.next() == 42


def test_a_fixed_seed_is_cut_at_the_schedules_hops() -> None:
    """Where the seams fall changes the audio, and a fixed seed asks for the same audio."""
    paced = replace(LOW_LATENCY_SCHEDULE, paced=True)
    assert paces(SynthesisOptions(schedule=paced))
    assert not paces(SynthesisOptions(schedule=paced, seed=7))
    assert not paces(SynthesisOptions(seed=None))  # the schedule's own say
