"""Prepared phrases through the real server: ``cache.prepare_phrases`` are spoken into the
repeat cache while the engine is idle, so their first request is a hit; a request arriving
meanwhile pre-empts the preparation, which resumes at the next idle time.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import FakeEngine, until
from wyoming.event import Event
from wyoming.info import Describe

from wyoming_cosyvoice.config import ConfigError, load_config
from wyoming_cosyvoice.pipeline import prepared_phrases


def run(coro: Any) -> Any:
    return asyncio.run(coro)


@pytest.fixture(autouse=True)
def short_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prepared_phrases, "IDLE_S", 0.1)


@pytest.mark.parametrize("server", [{}, {"server.speed": 1.25, "server.seed": 7}])
def test_prepared_phrases_are_hits_at_their_first_request(
    wy: SimpleNamespace, server: dict[str, Any]
) -> None:
    """Prepared as a request that names no voice has them: with the server's voice, profile
    (auto chooses by the text), speed and seed."""
    phrases = ["Good night.", "The door is open. Please lock it."]

    async def main() -> tuple[list[str], Any, dict[str, int], list[str]]:
        async with wy.fake_server({"cache.prepare_phrases": phrases, **server}) as srv:
            preparer = srv.running.preparer
            await until(lambda: preparer.prepared == 2, "both are prepared")
            prepared = [call.text for call in srv.engines[0].calls]
            counts = dict(srv.running.scheduler.repeat_cache.stats())
            reply = await wy.synthesize(srv.port, "The door is open. Please lock it.")
            await wy.synthesize(srv.port, "Good night.")
            after = [call.text for call in srv.engines[0].calls]
            return prepared, reply, counts, after

    prepared, reply, counts, after = run(main())
    assert prepared == after == ["Good night.", "The door is open.", "Please lock it."]
    assert counts["hits"] == counts["misses"] == 0  # preparing is not a request
    assert counts["entries"] == 3
    expected = sum(FakeEngine.expected_samples(s) for s in prepared[1:])
    assert reply.types[-1] == "audio-stop" and reply.samples == expected


def test_a_request_pre_empts_a_phrase_being_prepared(wy: SimpleNamespace) -> None:
    phrase = "A long phrase that takes the engine a while to prepare."

    hold = threading.Event()  # the phrase cannot end unless it gives way

    async def main() -> tuple[Any, list[Any], int]:
        engine = lambda p, t: FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server({"cache.prepare_phrases": [phrase]}, engine=engine) as srv:
            calls = srv.engines[0].calls
            await until(lambda: len(calls) == 1 and calls[0].chunks > 0, "the phrase is spoken")
            asking = asyncio.create_task(wy.synthesize(srv.port, "Someone is at the door."))
            await until(calls[0].ended.is_set, "the phrase gives way")
            hold.set()
            reply = await asking
            at_reply = list(calls)
            await until(lambda: srv.running.preparer.prepared == 1, "the phrase is prepared")
            return reply, at_reply, len(calls)

    reply, at_reply, total = run(main())
    assert reply.types[-1] == "audio-stop"
    assert [c.text for c in at_reply] == [phrase, "Someone is at the door."]
    assert not at_reply[0].finished  # the preparation gave way
    assert total == 3  # and was spoken again, whole, once the engine was idle


def test_a_phrase_waits_until_the_engine_is_idle(
    wy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request under way when the model becomes ready is spoken first, whole; the phrase
    starts only once nothing has been asked for a while."""
    monkeypatch.setattr(prepared_phrases, "IDLE_S", 0.5)
    text = "First of three. Second of three. Third of three."

    loaded = threading.Event()

    def engine(path: Any, threads: int | None) -> FakeEngine:
        assert loaded.wait(60), "the test never let the load finish"
        return FakeEngine(path, threads, delay=0.02)

    async def main() -> tuple[Any, list[str]]:
        settings = {"cache.prepare_phrases": ["Good night."]}
        async with wy.fake_server(settings, engine=engine, wait_ready=False) as srv:
            async with wy.connect(srv.port) as client:
                # Under way when the model is ready: the info answer means it was read.
                await client.write_event(Event("synthesize", {"text": text}))
                await client.write_event(Describe().event())
                await wy.read_until(client, ("info",))
                loaded.set()
                reply = await wy.read_until(client, ("audio-stop", "error"))
            await until(lambda: srv.running.preparer.prepared == 1, "the phrase is prepared")
            return reply, [call.text for call in srv.engines[0].calls]

    reply, spoken = run(main())
    assert reply.types[-1] == "audio-stop"
    assert spoken == ["First of three.", "Second of three.", "Third of three.", "Good night."]


def test_phrases_without_a_cache_are_not_prepared(wy: SimpleNamespace) -> None:
    async def main() -> tuple[Any, int]:
        settings = {"cache.prepare_phrases": ["Good night."], "cache.max_mb": 0}
        async with wy.fake_server(settings) as srv:
            # No preparer: nothing can ever speak the phrases, no wait would show more.
            return srv.running.preparer, len(srv.engines[0].calls)

    preparer, calls = run(main())
    assert preparer is None and calls == 0


@pytest.mark.parametrize(
    ("value", "problem"),
    [("Good night.", None), ([1], "non-empty string"), ({"a": 1}, "list of texts")],
)
def test_prepare_phrases_is_a_list_of_texts(value: Any, problem: str | None) -> None:
    if problem is None:
        assert load_config(None, [("cache.prepare_phrases", value)]).cache.prepare_phrases == (
            "Good night.",
        )
        return
    with pytest.raises(ConfigError, match=problem) as err:
        load_config(None, [("cache.prepare_phrases", value)])
    assert err.value.key.startswith("cache.prepare_phrases")


def test_the_add_on_options_reach_the_cache_settings() -> None:
    from wyoming_cosyvoice.__main__ import build_parser, config_from_args
    from wyoming_cosyvoice.home_assistant import addon

    def config_of(options: dict[str, Any]) -> Any:
        args = addon.options_to_args(options)  # a missing option is the server's default
        return config_from_args(build_parser().parse_args(args)).cache

    default = config_of({})
    assert default.max_mb == 64 and default.prepare_phrases == ()
    phrases = ["Good night.", ' Say "hi": now\\n ', "晚安。", " "]
    chosen = config_of({"repeat_cache_mb": 0, "prepared_phrases": phrases})
    assert chosen.max_mb == 0
    assert chosen.prepare_phrases == ("Good night.", 'Say "hi": now\\n', "晚安。")
    with pytest.raises(ValueError, match="prepared_phrases"):
        addon.options_to_args({"prepared_phrases": ["Good night.", 1]})
