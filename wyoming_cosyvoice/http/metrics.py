"""``GET /metrics`` (Prometheus text format) and ``GET /stats`` (JSON for the web page and
Home Assistant's REST sensor), read from the server's :class:`~wyoming_cosyvoice.pipeline.metrics.
ServerMetrics`.

Counters and histograms are prometheus_client's, fed as the pipeline reports; what is read at
scrape time (queue, uptime, the recent quantiles, caches, the model) comes from a collector.
Each app has a registry of its own, so several servers in one process keep separate numbers.
Histograms give Prometheus its quantiles over any period; the ``cosyvoice_recent_*`` gauges
give the quantiles of the last requests directly, for clients that cannot compute them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wyoming_cosyvoice import __version__
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.http.errors import HttpError
from wyoming_cosyvoice.pipeline.metrics import (
    OUTCOMES,
    QUANTILES,
    ServerMetrics,
    SpeechReport,
    quantiles,
)
from wyoming_cosyvoice.pipeline.scheduler import Scheduler

FRONT_ENDS = ("wyoming", "http")
# From a fast machine's first chunk to a slow one's whole sentence.
FIRST_AUDIO_BUCKETS = (0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0)
# Real time is 1: below it the audio is made faster than it plays.
REAL_TIME_FACTOR_BUCKETS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0)

# Each CacheNumbers field: (field, family, metric name, help); labelled by the cache's name.
CACHE_METRICS: tuple[tuple[str, type[CounterMetricFamily | GaugeMetricFamily], str, str], ...] = (
    ("hits", CounterMetricFamily, "cosyvoice_cache_hits", "Cache lookups that hit"),
    ("misses", CounterMetricFamily, "cosyvoice_cache_misses", "Cache lookups that missed"),
    ("entries", GaugeMetricFamily, "cosyvoice_cache_entries", "Entries in the cache"),
    ("bytes", GaugeMetricFamily, "cosyvoice_cache_bytes", "Bytes the cache holds"),
    ("max_bytes", GaugeMetricFamily, "cosyvoice_cache_max_bytes", "The cache's byte budget"),
    ("hit_rate", GaugeMetricFamily, "cosyvoice_cache_hit_ratio", "Hits over lookups"),
)


class PrometheusMetrics:
    """The server's metrics in a prometheus_client registry of its own."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "cosyvoice_requests",
            "Requests the speech pipeline ended, by front end and outcome",
            ["front_end", "outcome"],
            registry=self.registry,
        )
        for front_end in FRONT_ENDS:  # every series from the start: 0, not absent
            for outcome in OUTCOMES:
                self.requests.labels(front_end, outcome)
        self.errors = Counter(
            "cosyvoice_errors",
            "Errors sent to clients, by front end and error code",
            ["front_end", "code"],
            registry=self.registry,
        )
        self.audio = Counter(
            "cosyvoice_audio_seconds", "Seconds of audio made", registry=self.registry
        )
        self.first_audio = Histogram(
            "cosyvoice_first_audio_seconds",
            "Time from a request's first sentence to its audio",
            buckets=FIRST_AUDIO_BUCKETS,
            registry=self.registry,
        )
        self.real_time_factor = Histogram(
            "cosyvoice_real_time_factor",
            "Seconds spent making a request's audio per second of it",
            buckets=REAL_TIME_FACTOR_BUCKETS,
            registry=self.registry,
        )
        self.process = ProcessCollector(registry=self.registry)  # resident memory, CPU, start
        self.state = ServerState(config, scheduler)
        self.registry.register(self.state)
        scheduler.metrics.subscribe(self)

    # --- what the pipeline reports (metrics.MetricsListener) ----------------------------------

    def speech_done(self, report: SpeechReport) -> None:
        self.requests.labels(report.front_end, report.outcome).inc()
        self.audio.inc(report.audio_s)
        if report.timed:
            assert report.first_audio_s is not None and report.real_time_factor is not None
            self.first_audio.observe(report.first_audio_s)
            self.real_time_factor.observe(report.real_time_factor)

    def error_sent(self, front_end: str, code: str) -> None:
        self.errors.labels(front_end, code).inc()

    # --- reading ---------------------------------------------------------------------------

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def resident_memory_bytes(self) -> int | None:
        """The process's resident memory (Linux; None where /proc is missing)."""
        samples = _samples(self.process.collect(), "process_resident_memory_bytes")
        return int(samples[0][1]) if samples else None

    def stats(self) -> dict[str, Any]:
        """The numbers a user watches, as JSON: totals, recent quantiles, the last requests."""
        metrics = self.state.metrics
        requests = {outcome: 0 for outcome in OUTCOMES}
        for labels, value in _samples(self.requests.collect(), "cosyvoice_requests_total"):
            requests[labels["outcome"]] += int(value)
        errors = _samples(self.errors.collect(), "cosyvoice_errors_total")
        return {
            "model": self.state.config.model,
            "profile": self.state.config.profile.name,
            "ready": self.state.ready,
            "uptime_s": round(metrics.uptime_s, 1),
            "queued": self.state.scheduler.waiting,
            "resident_memory_bytes": self.resident_memory_bytes(),
            "requests": {"total": sum(requests.values()), **requests},
            "errors": int(sum(value for _, value in errors)),
            "first_audio_s": _percentiles(metrics.recent_first_audio()),
            "real_time_factor": _percentiles(metrics.recent_real_time_factors()),
            "recent": [_recent(report) for report in metrics.recent],
            "caches": {
                name: {**asdict(numbers), "hit_rate": numbers.hit_rate}
                for name, numbers in metrics.cache_numbers().items()
            },
        }


class ServerState:
    """A collector of what is read at scrape time: model, readiness, uptime, the queue, the
    recent quantiles and the caches."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler) -> None:
        self.config, self.scheduler = config, scheduler

    @property
    def metrics(self) -> ServerMetrics:
        return self.scheduler.metrics

    @property
    def ready(self) -> bool:
        return self.scheduler.engine is not None

    def collect(self) -> Iterator[Metric]:
        yield InfoMetricFamily(
            "cosyvoice_server", "The server: version, model, default profile", value=self._info()
        )
        yield GaugeMetricFamily(
            "cosyvoice_ready", "1 once the model has loaded", value=int(self.ready)
        )
        yield GaugeMetricFamily(
            "cosyvoice_uptime_seconds",
            "Seconds since the server started",
            value=self.metrics.uptime_s,
        )
        yield GaugeMetricFamily(
            "cosyvoice_queued_sentences",
            "Sentences waiting for the engine (behind the ones it speaks)",
            value=self.scheduler.waiting,
        )
        yield GaugeMetricFamily(
            "cosyvoice_recent_requests",
            "Finished requests with audio in the recent window",
            value=len(self.metrics.recent),
        )
        yield _quantile_gauge(
            "cosyvoice_recent_first_audio_seconds",
            "First audio of the recent requests, by quantile",
            self.metrics.recent_first_audio(),
        )
        yield _quantile_gauge(
            "cosyvoice_recent_real_time_factor",
            "Real-time factor of the recent requests, by quantile",
            self.metrics.recent_real_time_factors(),
        )
        yield from self._caches()

    def _info(self) -> dict[str, str]:
        engine = self.scheduler.engine
        return {
            "version": __version__,
            "model": self.config.model,
            "profile": self.config.profile.name,
            "family": engine.kind if engine is not None else "",
            "sample_rate": str(self.scheduler.sample_rate),
        }

    def _caches(self) -> Iterator[Metric]:
        caches = self.metrics.cache_numbers()
        if not caches:
            return
        for field, family_type, name, documentation in CACHE_METRICS:
            family = family_type(name, documentation, labels=["cache"])
            for cache, numbers in caches.items():
                if (value := getattr(numbers, field)) is not None:
                    family.add_metric([cache], value)
            yield family


def _quantile_gauge(name: str, documentation: str, values: list[float]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, documentation, labels=["quantile"])
    for q, value in quantiles(values).items():
        gauge.add_metric([str(q)], value)
    return gauge


def _percentiles(values: list[float]) -> dict[str, float | None]:
    """{"p50": …, "p90": …, "p99": …}; None without requests (a REST sensor shows unknown)."""
    found = quantiles(values)
    return {f"p{round(q * 100)}": _rounded(found.get(q)) for q in QUANTILES}


def _recent(report: SpeechReport) -> dict[str, Any]:
    return {
        "at": round(report.finished_at, 3),
        "front_end": report.front_end,
        "profile": report.profile,
        "first_audio_s": _rounded(report.first_audio_s),
        "real_time_factor": _rounded(report.real_time_factor),
        "audio_s": _rounded(report.audio_s),
    }


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _samples(families: Iterable[Metric], name: str) -> list[tuple[dict[str, str], float]]:
    return [(s.labels, s.value) for family in families for s in family.samples if s.name == name]


@contextlib.contextmanager
def counting_errors(metrics: ServerMetrics, front_end: str = "http") -> Iterator[None]:
    """Count the HttpError a speech route answers with (its code, else its status)."""
    try:
        yield
    except HttpError as err:
        metrics.error_sent(front_end, err.code or f"http_{err.status}")
        raise


def metrics_routes(config: ServerConfig, scheduler: Scheduler) -> list[Route]:
    """``GET /metrics`` and ``GET /stats`` over a new registry for ``scheduler``'s metrics."""
    exported = PrometheusMetrics(config, scheduler)

    async def metrics(request: Request) -> Response:
        return Response(exported.exposition(), media_type=CONTENT_TYPE_LATEST)

    async def stats(request: Request) -> Response:
        return JSONResponse(exported.stats(), headers={"Cache-Control": "no-store"})

    return [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
    ]
