"""``server.parallel_sentences``: several sentences at once, each on its own engine thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import torch
from fake_surface import FakeSurface

from engine.core import thread_budget
from wyoming_cosyvoice.pipeline.scheduler import _Slots


def run(coro):
    return asyncio.run(coro)


def test_slots_are_handed_out_in_fifo_order_and_an_exclusive_waiter_is_not_overtaken() -> None:
    async def main() -> list[str]:
        slots = _Slots(2)
        order: list[str] = []
        first, second = await slots.acquire(), await slots.acquire()
        assert (first, second) == ([0], [1])

        async def take(name: str, n: int) -> list[int]:
            got = await slots.acquire(n)
            order.append(name)
            return got

        exclusive = asyncio.create_task(take("exclusive", 2))
        later = asyncio.create_task(take("later", 1))
        await asyncio.sleep(0)
        slots.release(first)  # one slot free: not enough for the head, and "later" must wait
        await asyncio.sleep(0)
        assert order == []
        slots.release(second)
        got = await exclusive
        assert got == [0, 1] and order == ["exclusive"]
        slots.release(got)
        assert await later == [0]
        return order

    assert run(main()) == ["exclusive", "later"]


def test_a_cancelled_waiter_gives_its_turn_away() -> None:
    async def main() -> list[int]:
        slots = _Slots(1)
        held = await slots.acquire()
        big = asyncio.create_task(slots.acquire(1))
        small = asyncio.create_task(slots.acquire(1))
        await asyncio.sleep(0)
        big.cancel()
        await asyncio.sleep(0)
        slots.release(held)
        return await asyncio.wait_for(small, 1)

    assert run(main()) == [0]


class MeetingEngine(FakeSurface):
    """A fake engine whose sentences wait until another sentence runs at the same time."""

    def __init__(self, fake: Any) -> None:
        self._fake = fake
        self.threads = fake.threads
        self.speakers = self._fake.speakers
        self.meet = threading.Barrier(2, timeout=10)
        self.seen: list[tuple[str, str, int]] = []  # (text, engine thread, torch threads)
        self.budgets: list[Any] = []  # options.threads of each sentence

    def warmup(self) -> None:
        pass

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Any:
        self.budgets.append(options.threads)

        def chunks() -> Any:
            if text.startswith("Together"):
                self.meet.wait()  # times out (and the request fails) unless both run at once
            for chunk in self._fake.synthesize(text, options, cancel):
                self.seen.append((text, threading.current_thread().name, torch.get_num_threads()))
                yield chunk

        return chunks()


def meeting_server(wy: SimpleNamespace, overrides: dict[str, Any]) -> Any:
    engine = lambda path, threads: MeetingEngine(wy.FakeEngine(path, threads))  # noqa: E731
    return wy.fake_server(overrides, engine=engine)


def test_sentences_side_by_side_share_the_cores_and_one_alone_gets_them_all(
    wy: SimpleNamespace,
) -> None:
    async def main() -> tuple[list, MeetingEngine]:
        async with meeting_server(wy, {"server.parallel_sentences": 2}) as srv:
            texts = ["Together one.", "Together two."]
            replies = await asyncio.gather(*(wy.synthesize(srv.port, t) for t in texts))
            alone = await wy.synthesize(srv.port, "Alone now.")
            return [*replies, alone], srv.engines[0]

    cores = torch.get_num_threads()
    try:
        # The "every core" the engine loads with, whatever CI has.
        thread_budget.configure_threads(3, follow_free_cores=False)
        replies, engine = run(main())
    finally:
        torch.set_num_threads(cores)
    assert all(r.types[-1] == "audio-stop" and r.samples > 0 for r in replies)
    assert {thread for text, thread, _ in engine.seen if text.startswith("Together")} == {
        "engine_0",
        "engine1_0",
    }
    assert engine.threads is None  # loaded (and warmed up) on every core
    # The second slot's sentence always runs on one thread. (How many the first slot's gets
    # depends on whether the other had started or finished before each chunk: the policy's
    # own test covers that.)
    assert {n for _, thread, n in engine.seen if thread == "engine1_0"} == {1}
    # A sentence alone (on the first slot) gets every core back.
    assert {(thread, n) for text, thread, n in engine.seen if text == "Alone now."} == {
        ("engine_0", 3)
    }
    # The engine gets the same policy to ask between LM tokens and flow steps.
    assert len(engine.budgets) == 3 and all(callable(b) for b in engine.budgets)


def test_only_the_first_slot_runs_a_sentence_on_every_core() -> None:
    from wyoming_cosyvoice.pipeline.scheduler import Scheduler

    async def main() -> list[int | None]:
        host = Scheduler(
            "model", engine_factory=lambda *_: None, warmup=False, parallel=2, shared_cores=True
        )
        host._all_threads = 4
        seen = [host._threads_for(0)]  # (nothing taken: not asked in practice)
        first = await host._slots.acquire()
        seen.append(host._threads_for(0))  # alone on slot 0
        second = await host._slots.acquire()
        seen += [host._threads_for(0), host._threads_for(1)]  # side by side
        host._slots.release(first)
        seen.append(host._threads_for(1))  # alone, but on slot 1: stays on one thread
        host._slots.release(second)
        plain = Scheduler("model", engine_factory=lambda *_: None, warmup=False, parallel=2)
        seen.append(plain._threads_for(0))  # not shared: threads are left as they are
        host.shutdown()
        plain.shutdown()
        return seen

    assert run(main()) == [1, 4, 1, 1, 1, None]


def test_an_explicit_thread_count_is_kept_with_parallel_sentences(wy: SimpleNamespace) -> None:
    async def main() -> tuple[int | None, list[Any]]:
        overrides = {"server.parallel_sentences": 2, "server.threads": 2}
        async with meeting_server(wy, overrides) as srv:
            await wy.synthesize(srv.port, "Alone now.")
            return srv.engines[0].threads, srv.engines[0].budgets

    cores = torch.get_num_threads()
    try:
        assert run(main()) == (2, [None])  # no thread budget either: every sentence keeps 2
    finally:
        torch.set_num_threads(cores)


def test_an_exclusive_job_waits_for_every_running_sentence(wy: SimpleNamespace) -> None:
    from engine.core.types import SynthesisOptions
    from wyoming_cosyvoice.pipeline.scheduler import Scheduler

    async def main() -> list[bool]:
        engine = wy.FakeEngine("model", None, delay=0.02)
        host = Scheduler("model", engine_factory=lambda *_: engine, warmup=False, parallel=2)
        await host.load()

        async def sentence(text: str) -> None:
            async def sink(_: Any) -> None:
                pass

            await host.synthesize(
                text,
                SynthesisOptions(speaker=engine.speakers[0]),
                threading.Event(),
                sink,
                load_timeout=5,
            )

        def finished_so_far() -> list[bool]:
            return [call.finished for call in engine.calls]

        running = [asyncio.create_task(sentence(f"Sentence {i} is long enough.")) for i in (1, 2)]
        await wy.until(lambda: len(engine.calls) == 2, "both are speaking")
        seen = await host.run_on_engine(finished_so_far)
        await asyncio.gather(*running)
        assert host.idle
        host.shutdown()
        return seen

    assert run(main()) == [True, True]
