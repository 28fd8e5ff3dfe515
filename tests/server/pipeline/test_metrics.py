"""``/metrics`` and ``/stats`` through the real server: requests over Wyoming TCP and HTTP, then
a scrape parsed by prometheus_client's own text parser.

The fake engine (conftest) makes ``SAMPLES_PER_CHAR`` samples per character, so the seconds of
audio counted are exact; timings are only checked for consistency between the two endpoints.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import ROOT, FakeEngine, connect, read_until, synthesize
from prometheus_client.parser import text_string_to_metric_families
from test_http import RATE, BackgroundServer

from engine.core.types import SynthesisCancelled
from wyoming_cosyvoice.pipeline.metrics import ServerMetrics, SpeechReport, speech_outcome

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(srv: BackgroundServer) -> Samples:
    """Every sample of ``GET /metrics``, keyed by (name, labels)."""
    with srv.client() as client:
        response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def labels_of(samples: Samples, name: str) -> list[dict[str, str]]:
    return [dict(labels) for (found, labels) in samples if found == name]


def stats(srv: BackgroundServer) -> dict[str, Any]:
    with srv.client() as client:
        response = client.get("/stats")
    assert response.status_code == 200
    return dict(response.json())


def scrape_until(srv: BackgroundServer, condition: Callable[[Samples], bool]) -> Samples:
    """Scrape until ``condition`` holds (a deadline against hangs, not a timing check)."""
    deadline = time.monotonic() + 30
    while not condition(samples := scrape(srv)):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return samples


def speak_wyoming(srv: BackgroundServer, text: str, voice: dict[str, Any] | None = None) -> Any:
    return asyncio.run(synthesize(srv.wyoming_port, text, voice))


def audio_seconds(*sentences: str) -> float:
    return sum(FakeEngine.expected_samples(s) for s in sentences) / RATE


# --- through the server ---------------------------------------------------------------------


def test_requests_over_wyoming_and_http_are_counted_with_their_timings() -> None:
    with BackgroundServer({"server.profile": "fast"}) as srv:
        before = scrape(srv)
        for front_end in ("wyoming", "http"):
            assert value(before, "cosyvoice_requests_total", front_end=front_end, outcome="ok") == 0
        assert value(before, "cosyvoice_first_audio_seconds_count") == 0
        assert labels_of(before, "cosyvoice_recent_first_audio_seconds") == []
        assert stats(srv)["first_audio_s"] == {"p50": None, "p90": None, "p99": None}

        reply = speak_wyoming(srv, "Hello there. How are you?")
        assert reply.samples / RATE == audio_seconds("Hello there.", "How are you?")
        with srv.client() as client:
            assert client.post("/tts", json={"text": "Hi there."}).status_code == 200
            speech = {"input": "Two more. Sentences here.", "voice": "en-male"}
            assert client.post("/v1/audio/speech", json=speech).status_code == 200

        after = scrape(srv)
        assert value(after, "cosyvoice_requests_total", front_end="wyoming", outcome="ok") == 1
        assert value(after, "cosyvoice_requests_total", front_end="http", outcome="ok") == 2
        assert value(after, "cosyvoice_first_audio_seconds_count") == 3
        assert value(after, "cosyvoice_real_time_factor_count") == 3
        spoken = (
            ("Hello there.", "How are you?"),
            ("Hi there.",),
            ("Two more.", "Sentences here."),
        )
        made = sum(audio_seconds(*sentences) for sentences in spoken)
        assert value(after, "cosyvoice_audio_seconds_total") == pytest.approx(made)
        assert value(after, "cosyvoice_recent_requests") == 3
        assert {q["quantile"] for q in labels_of(after, "cosyvoice_recent_real_time_factor")} == {
            "0.5",
            "0.9",
            "0.99",
        }
        assert value(after, "cosyvoice_queued_sentences") == 0
        assert value(after, "cosyvoice_ready") == 1
        assert value(after, "process_resident_memory_bytes") > 0
        assert value(after, "cosyvoice_uptime_seconds") >= value(before, "cosyvoice_uptime_seconds")
        (info,) = labels_of(after, "cosyvoice_server_info")
        assert info["model"] == srv.config.model and info["profile"] == "fast"
        assert info["family"] == "sft" and info["sample_rate"] == str(RATE)
        assert value(after, "cosyvoice_errors_total") is None  # no error series yet

        # /stats tells the same story, request by request, oldest first
        body = stats(srv)
        assert body["requests"] == {"total": 3, "ok": 3, "error": 0, "cancelled": 0, "stalled": 0}
        assert body["errors"] == 0 and body["queued"] == 0 and body["ready"] is True
        assert body["profile"] == "fast" and body["resident_memory_bytes"] > 0
        recent = body["recent"]
        assert [r["front_end"] for r in recent] == ["wyoming", "http", "http"]
        assert [r["audio_s"] for r in recent] == [
            round(audio_seconds(*sentences), 3) for sentences in spoken
        ]
        assert all(r["first_audio_s"] > 0 and r["real_time_factor"] > 0 for r in recent)
        first_audio = [r["first_audio_s"] for r in recent]
        histogram_sum = value(after, "cosyvoice_first_audio_seconds_sum")
        assert histogram_sum == pytest.approx(sum(first_audio), abs=2e-3)
        assert min(first_audio) <= body["first_audio_s"]["p50"] <= max(first_audio)
        p50 = value(after, "cosyvoice_recent_first_audio_seconds", quantile="0.5")
        assert body["first_audio_s"]["p50"] == pytest.approx(p50, abs=1e-3)


def test_errors_are_counted_by_front_end_and_code() -> None:
    with BackgroundServer({"limits.max_text_chars": 100}) as srv:
        # Wyoming: refused before any synthesis (too long), then failures inside it
        assert speak_wyoming(srv, "x" * 101).error().code == "LimitExceededError"
        assert speak_wyoming(srv, "Hi.", {"name": "nobody"}).error().code == "VoiceNotFoundError"
        assert speak_wyoming(srv, "This will FAIL after a chunk.").error().code == "SynthesisError"
        # HTTP: refused (413, 404), failed before the first audio (500) and mid-stream
        with srv.client() as client:
            assert client.post("/tts", json={"text": "x" * 101}).status_code == 413
            assert client.post("/tts", json={"text": "Hi.", "voice": "nobody"}).status_code == 404
            crashed = client.post("/v1/audio/speech", json={"input": "CRASH now."})
            assert crashed.status_code == 500
            with pytest.raises(httpx.HTTPError):  # the body is cut after the first chunk
                with client.stream(
                    "POST",
                    "/tts",
                    json={"text": "It will FAIL, after a first chunk.", "stream": True},
                ) as cut:
                    assert cut.status_code == 200
                    for _ in cut.iter_bytes():
                        pass
        samples = scrape_until(
            srv,
            lambda found: (
                value(found, "cosyvoice_errors_total", front_end="http", code="synthesis_failed")
                == 1
            ),
        )

        errors = {
            (e["front_end"], e["code"]): value(samples, "cosyvoice_errors_total", **e)
            for e in labels_of(samples, "cosyvoice_errors_total")
        }
        assert errors == {
            ("wyoming", "LimitExceededError"): 1,
            ("wyoming", "VoiceNotFoundError"): 1,
            ("wyoming", "SynthesisError"): 1,
            ("http", "text_too_long"): 1,
            ("http", "voice_not_found"): 1,
            ("http", "internal_error"): 1,
            ("http", "synthesis_failed"): 1,
        }
        # Refused requests never reached the pipeline; the failed ones ended in error.
        assert value(samples, "cosyvoice_requests_total", front_end="wyoming", outcome="error") == 2
        assert value(samples, "cosyvoice_requests_total", front_end="http", outcome="error") == 2
        for front_end in ("wyoming", "http"):
            assert (
                value(samples, "cosyvoice_requests_total", front_end=front_end, outcome="ok") == 0
            )
        assert value(samples, "cosyvoice_first_audio_seconds_count") == 0  # failures not timed
        body = stats(srv)
        assert body["errors"] == 7 and body["requests"]["error"] == 4 and body["recent"] == []


def test_a_client_that_leaves_counts_as_cancelled() -> None:
    hold = threading.Event()  # never set: the request cannot end but by the client leaving

    def slow(path: Path, threads: int | None) -> FakeEngine:
        return FakeEngine(path, threads, hold=hold)

    async def leave_after_the_first_audio(port: int) -> None:
        from wyoming.event import Event

        async with connect(port) as client:
            await client.write_event(Event("synthesize", {"text": "A long sentence. " * 20}))
            await read_until(client, ("audio-chunk",))

    with BackgroundServer(engine_factory=slow) as srv:
        asyncio.run(leave_after_the_first_audio(srv.wyoming_port))
        samples = scrape_until(
            srv,
            lambda found: (
                value(found, "cosyvoice_requests_total", front_end="wyoming", outcome="cancelled")
                == 1
            ),
        )
        assert value(samples, "cosyvoice_requests_total", front_end="wyoming", outcome="ok") == 0
        assert value(samples, "cosyvoice_errors_total") is None  # the client left: no error
        assert stats(srv)["recent"] == []  # an unfinished request's timings are not counted


class GatedEngine(FakeEngine):
    """Holds each sentence at its first chunk until ``gate`` opens."""

    gate = threading.Event()

    def synthesize(self, text: str, options: Any, cancel: threading.Event | None = None) -> Any:
        self.gate.wait(60)
        yield from super().synthesize(text, options, cancel)


def test_queue_depth_counts_sentences_waiting_for_the_engine() -> None:
    GatedEngine.gate = threading.Event()
    with BackgroundServer(engine_factory=GatedEngine) as srv:

        def post(text: str) -> None:
            with srv.client() as client:
                assert client.post("/tts", json={"text": text}).status_code == 200

        posts = [threading.Thread(target=post, args=(text,)) for text in ("One.", "Two.", "3.")]
        try:
            for thread in posts:
                thread.start()
            # one sentence holds the engine (at the gate), the other two wait for it
            samples = scrape_until(
                srv, lambda found: value(found, "cosyvoice_queued_sentences") == 2
            )
            assert value(samples, "cosyvoice_requests_total", front_end="http", outcome="ok") == 0
            assert stats(srv)["queued"] == 2
        finally:
            GatedEngine.gate.set()
            for thread in posts:
                thread.join(60)
        samples = scrape_until(
            srv,
            lambda found: (
                value(found, "cosyvoice_requests_total", front_end="http", outcome="ok") == 3
            ),
        )
        assert value(samples, "cosyvoice_queued_sentences") == 0


def test_each_server_keeps_its_own_numbers() -> None:
    with BackgroundServer() as first, BackgroundServer() as second:
        speak_wyoming(first, "Only the first server hears this.")
        assert (
            value(scrape(first), "cosyvoice_requests_total", front_end="wyoming", outcome="ok") == 1
        )
        assert (
            value(scrape(second), "cosyvoice_requests_total", front_end="wyoming", outcome="ok")
            == 0
        )
        assert stats(second)["requests"]["total"] == 0


@dataclass
class StandInStats:
    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int


class StandInCache:
    """What the repeat cache offers the metrics: ``stats()``."""

    def __init__(self, **numbers: int) -> None:
        self.numbers = numbers

    def stats(self) -> dict[str, int]:
        return dict(self.numbers)


class StandInCacheOfAttributes:
    def stats(self) -> StandInStats:
        return StandInStats(hits=0, misses=0, entries=0, bytes=0, max_bytes=1 << 20)


def test_a_registered_cache_is_exported_as_it_changes() -> None:
    with BackgroundServer() as srv:
        # The server's own repeat cache is registered; a stand-in replaces it under its name.
        assert labels_of(scrape(srv), "cosyvoice_cache_hits_total") == [{"cache": "repeat"}]
        assert list(stats(srv)["caches"]) == ["repeat"]
        cache = StandInCache(hits=3, misses=1, entries=4, bytes=4000, max_bytes=64 << 20)
        srv.running.scheduler.metrics.add_cache(cache)
        srv.running.scheduler.metrics.add_cache(StandInCacheOfAttributes(), name="phrases")

        samples = scrape(srv)
        repeat = {"cache": "repeat"}
        assert value(samples, "cosyvoice_cache_hits_total", **repeat) == 3
        assert value(samples, "cosyvoice_cache_misses_total", **repeat) == 1
        assert value(samples, "cosyvoice_cache_entries", **repeat) == 4
        assert value(samples, "cosyvoice_cache_bytes", **repeat) == 4000
        assert value(samples, "cosyvoice_cache_max_bytes", **repeat) == 64 << 20
        assert value(samples, "cosyvoice_cache_hit_ratio", **repeat) == 0.75
        assert value(samples, "cosyvoice_cache_max_bytes", cache="phrases") == 1 << 20
        assert value(samples, "cosyvoice_cache_hit_ratio", cache="phrases") is None  # no lookups
        assert stats(srv)["caches"]["phrases"]["hit_rate"] is None

        cache.numbers.update(hits=9, entries=5)  # read at every scrape, not copied once
        assert value(scrape(srv), "cosyvoice_cache_hits_total", **repeat) == 9
        assert stats(srv)["caches"]["repeat"] == {
            "hits": 9,
            "misses": 1,
            "entries": 5,
            "bytes": 4000,
            "max_bytes": 64 << 20,
            "hit_rate": 0.9,
        }


# --- the recorder on its own ------------------------------------------------------------------


def report(
    first_audio_s: float | None = 0.5,
    *,
    outcome: str = "ok",
    audio_s: float = 2.0,
    engine_s: float = 1.0,
) -> SpeechReport:
    return SpeechReport(
        front_end="wyoming",
        outcome=outcome,
        profile="fast",
        audio_s=audio_s,
        engine_s=engine_s,
        first_audio_s=first_audio_s,
    )


def test_the_recent_window_keeps_the_last_finished_requests_with_audio() -> None:
    metrics = ServerMetrics(window=3)
    for first_audio in (1.0, 2.0, 3.0, 4.0, 5.0):
        metrics.speech_done(report(first_audio, engine_s=first_audio))
    metrics.speech_done(report(9.0, outcome="error"))
    metrics.speech_done(report(9.0, outcome="cancelled"))
    metrics.speech_done(report(None, audio_s=0.0))  # nothing to speak
    assert metrics.recent_first_audio() == [3.0, 4.0, 5.0]
    assert metrics.recent_real_time_factors() == [1.5, 2.0, 2.5]


def test_a_failing_listener_does_not_fail_the_request() -> None:
    class Broken:
        def speech_done(self, report: SpeechReport) -> None:
            raise RuntimeError("broken exporter")

        def error_sent(self, front_end: str, code: str) -> None:
            raise RuntimeError("broken exporter")

    heard: list[str] = []

    class Counting:
        def speech_done(self, report: SpeechReport) -> None:
            heard.append(report.outcome)

        def error_sent(self, front_end: str, code: str) -> None:
            heard.append(code)

    metrics = ServerMetrics()
    metrics.subscribe(Broken())
    metrics.subscribe(Counting())
    metrics.speech_done(report())
    metrics.error_sent("http", "text_too_long")
    assert heard == ["ok", "text_too_long"] and len(metrics.recent) == 1


@pytest.mark.parametrize(
    ("error", "stalled", "outcome"),
    [
        (None, False, "ok"),
        (asyncio.CancelledError(), False, "cancelled"),
        (SynthesisCancelled("the client left"), False, "cancelled"),
        (TimeoutError("the client stopped reading"), True, "stalled"),
        (ValueError("bad text"), False, "error"),
    ],
)
def test_how_a_speech_ended(error: BaseException | None, stalled: bool, outcome: str) -> None:
    assert speech_outcome(error, stalled) == outcome


# --- the documented Home Assistant sensors ----------------------------------------------------


def documented_rest_sensors() -> list[dict[str, Any]]:
    """The ``platform: rest`` sensors of the YAML examples in the add-on DOCS and the API docs."""
    import re

    import yaml

    sensors = []
    for doc in ("addon/DOCS.md", "docs/http-api.md"):
        text = (ROOT / doc).read_text("utf-8")
        for block in re.findall(r"```yaml\n(.*?)```", text, re.S):
            if "platform: rest" in block:
                sensors += yaml.safe_load(block)["sensor"]
    return sensors


def render(template: str, stats: dict[str, Any]) -> str:
    """A template as Home Assistant renders it for a REST sensor (plain Jinja suffices here)."""
    import jinja2

    return jinja2.Environment().from_string(template).render(value_json=stats)


def test_the_documented_home_assistant_sensors_read_stats() -> None:
    sensors = [s for s in documented_rest_sensors() if s["resource"].endswith("/stats")]
    assert len(sensors) >= 3  # the add-on's and the API docs' examples
    with BackgroundServer() as srv:
        for sensor in sensors:  # before any request: unavailable, not a made-up 0
            assert render(sensor["availability"], stats(srv)) == "False"
        speak_wyoming(srv, "Hello there.")
        body = stats(srv)
        for sensor in sensors:
            assert render(sensor["availability"], body) == "True"
            state = float(render(sensor["value_template"], body))
            assert state in (body["first_audio_s"]["p50"], body["real_time_factor"]["p50"])
            assert set(sensor.get("json_attributes", [])) <= set(body)
