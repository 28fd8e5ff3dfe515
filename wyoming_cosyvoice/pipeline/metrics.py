"""The server's own numbers: how each request went, the last requests' timings, caches.

The speech pipeline (:mod:`.speech`) reports every request that reached it as one
:class:`SpeechReport` when it ends; the front ends report each error they sent a client. One
:class:`ServerMetrics` per server (the scheduler holds it: every front end shares it), so
several servers in one process keep separate numbers. It needs no third-party package: the
HTTP API exports it (``/metrics`` in Prometheus text format, ``/stats`` as JSON) by
subscribing a :class:`MetricsListener`.

A real-time factor is the seconds spent making a request's audio (its sentences' time in the
engine's queue and the engine) over the seconds of audio made: below 1 the machine speaks
faster than real time. Time spent waiting for a slow client or for more streamed text is not
in it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.core.types import SynthesisCancelled

_LOGGER = logging.getLogger(__name__)
RECENT_REQUESTS = 50  # the sliding window of the recent quantiles and the web page's chart
QUANTILES = (0.5, 0.9, 0.99)
OUTCOMES = ("ok", "error", "cancelled", "stalled")
CACHE_FIELDS = ("hits", "misses", "entries", "bytes", "max_bytes")


@dataclass(frozen=True)
class SpeechReport:
    """One request the speech pipeline ended: who asked, how it ended, how fast it was."""

    front_end: str  # "wyoming" or "http"
    outcome: str  # one of OUTCOMES
    profile: str
    audio_s: float  # seconds of audio made
    engine_s: float  # seconds its sentences spent queued for and inside the engine
    first_audio_s: float | None  # from its first sentence to its first audio
    finished_at: float = field(default_factory=time.time)  # Unix time

    @property
    def real_time_factor(self) -> float | None:
        return self.engine_s / self.audio_s if self.audio_s > 0 else None

    @property
    def timed(self) -> bool:
        """A finished request with audio: its first audio and real-time factor count."""
        return self.outcome == "ok" and self.audio_s > 0 and self.first_audio_s is not None


def speech_outcome(error: BaseException | None, stalled: bool) -> str:
    """How a speech ended, from what stopped it (None: it said everything)."""
    if error is None:
        return "ok"
    if stalled:
        return "stalled"
    if isinstance(error, (asyncio.CancelledError, SynthesisCancelled)):
        return "cancelled"
    return "error"


class CacheSource(Protocol):
    """A cache that reports ``stats()``: hits, misses, entries, bytes and max_bytes, as a
    mapping or as attributes of those names."""

    def stats(self) -> object: ...


@dataclass(frozen=True)
class CacheNumbers:
    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int

    @classmethod
    def of(cls, stats: object) -> CacheNumbers:
        def read(name: str) -> int:
            value = stats[name] if isinstance(stats, Mapping) else getattr(stats, name)
            return int(value)

        return cls(*(read(name) for name in CACHE_FIELDS))

    @property
    def hit_rate(self) -> float | None:
        """Hits over lookups; None before the first lookup."""
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else None


class MetricsListener(Protocol):
    """Told of every report as it comes (the HTTP API's Prometheus counters, histograms)."""

    def speech_done(self, report: SpeechReport) -> None: ...

    def error_sent(self, front_end: str, code: str) -> None: ...


class ServerMetrics:
    """What the pipeline and the front ends report, kept for the exporters to read."""

    def __init__(self, window: int = RECENT_REQUESTS) -> None:
        self.started = time.monotonic()
        self.recent: deque[SpeechReport] = deque(maxlen=window)  # timed requests, oldest first
        self._listeners: list[MetricsListener] = []
        self._caches: dict[str, CacheSource] = {}

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    def subscribe(self, listener: MetricsListener) -> None:
        self._listeners.append(listener)

    def speech_done(self, report: SpeechReport) -> None:
        if report.timed:
            self.recent.append(report)
        self._tell(lambda listener: listener.speech_done(report))

    def error_sent(self, front_end: str, code: str) -> None:
        """A front end sent a client an error (a refused request, or a failed synthesis)."""
        self._tell(lambda listener: listener.error_sent(front_end, code))

    def _tell(self, call: Callable[[MetricsListener], None]) -> None:
        for listener in self._listeners:
            try:
                call(listener)
            except Exception:  # counting must never fail a request
                _LOGGER.exception("A metrics listener failed")

    def add_cache(self, source: CacheSource, name: str = "repeat") -> None:
        """Report ``source.stats()`` as the cache ``name`` (registering a name again replaces
        its source)."""
        self._caches[name] = source

    def cache_numbers(self) -> dict[str, CacheNumbers]:
        return {name: CacheNumbers.of(source.stats()) for name, source in self._caches.items()}

    def recent_first_audio(self) -> list[float]:
        return [r.first_audio_s for r in self.recent if r.first_audio_s is not None]

    def recent_real_time_factors(self) -> list[float]:
        return [r.real_time_factor for r in self.recent if r.real_time_factor is not None]


def quantiles(values: list[float]) -> dict[float, float]:
    """QUANTILES of ``values`` (linear interpolation); empty without values."""
    if not values:
        return {}
    return dict(zip(QUANTILES, (float(v) for v in np.quantile(values, QUANTILES)), strict=True))
