"""Stopping the model host: every sentence is cancelled at once, whoever asked for it.

The Wyoming handler and the HTTP API both speak through ``Scheduler.synthesize``; a stop
cancels their sentences there, running or queued, and refuses new ones. The real process on
SIGTERM is tested in test_hardening_faults.py.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from engine.core.types import SynthesisCancelled

LONG = "A sentence long enough to take a while. " * 10


def test_cancel_all_stops_running_and_queued_sentences_and_refuses_new_ones(
    wy: SimpleNamespace,
) -> None:
    hold = threading.Event()  # never set: the speaking sentence ends only by the cancel

    async def main() -> tuple[list[Any], bool, Any, list[Any]]:
        engine = lambda p, t: wy.FakeEngine(p, t, hold=hold)  # noqa: E731
        async with wy.fake_server(engine=engine) as srv:
            host = srv.running.scheduler
            options = srv.config.profile.options(
                speaker="英文男", seed=0, instruct=None, force_tokens=None
            )
            first_audio = asyncio.Event()

            async def on_chunk(chunk: Any) -> None:
                first_audio.set()

            # Two requests: one speaking, one queued behind it for the single engine slot.
            sentences = [
                asyncio.create_task(
                    host.synthesize(LONG, options, threading.Event(), on_chunk, load_timeout=60)
                )
                for _ in range(2)
            ]
            await asyncio.wait_for(first_audio.wait(), 60)
            cancelled = host.cancel_all()
            outcomes = await asyncio.wait_for(
                asyncio.gather(*sentences, return_exceptions=True), 60
            )
            idle = await host.wait_idle(60)
            with pytest.raises(SynthesisCancelled):
                await host.synthesize(
                    "Too late.", options, threading.Event(), on_chunk, load_timeout=60
                )
            return outcomes, idle, cancelled, srv.engines[0].calls

    outcomes, idle, cancelled, calls = asyncio.run(main())
    assert cancelled == 2
    assert all(isinstance(o, SynthesisCancelled) for o in outcomes), outcomes
    assert idle
    # The speaking one stopped mid-sentence; the queued one never reached the engine.
    assert len(calls) == 1 and not calls[0].finished


def test_wait_idle_reports_a_computation_that_does_not_end(wy: SimpleNamespace) -> None:
    entered, release = threading.Event(), threading.Event()

    def computation() -> None:
        entered.set()
        release.wait(600)

    async def main() -> tuple[bool, bool]:
        async with wy.fake_server() as srv:
            host = srv.running.scheduler
            busy = asyncio.create_task(host.run_on_engine(computation))
            assert await asyncio.to_thread(entered.wait, 60)
            stuck = await host.wait_idle(0.2)  # the computation runs until released
            release.set()
            await asyncio.wait_for(busy, 60)
            return stuck, await host.wait_idle(60)

    stuck, idle = asyncio.run(main())
    assert stuck is False and idle is True
