"""``server.parallel_sentences``: several sentences at once, each on its own engine thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from wyoming_cosyvoice.server import _Slots


def run(coro):  # noqa: ANN001, ANN201
    return asyncio.run(coro)


def test_slots_are_handed_out_in_fifo_order_and_an_exclusive_waiter_is_not_overtaken() -> None:
    async def main() -> list[str]:
        slots = _Slots(2)
        order: list[str] = []
        first, second = await slots.acquire(), await slots.acquire()
        assert (first, second) == ([0], [1]) and slots.busy == 2

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


class MeetingEngine:
    """A fake engine whose sentences wait until another sentence runs at the same time."""

    def __init__(self, fake: Any) -> None:
        self._fake = fake
        self.speakers, self.kind = self._fake.speakers, self._fake.kind
        self.meet = threading.Barrier(2, timeout=10)
        self.seen: list[tuple[str, str, int]] = []  # (text, thread, torch threads)

    def warmup(self) -> None:
        pass

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Any:
        def chunks() -> Any:
            if text.startswith("Together"):
                self.meet.wait()
            for chunk in self._fake.synthesize(text, options, cancel):
                self.seen.append((text, threading.current_thread().name, torch.get_num_threads()))
                yield chunk

        return chunks()


def test_two_sentences_run_side_by_side_on_one_torch_thread_each(wy: SimpleNamespace) -> None:
    cores = torch.get_num_threads()
    if cores < 2:
        pytest.skip("needs a machine with two CPU threads for torch")

    async def main() -> tuple[list, MeetingEngine]:
        overrides = {"server.parallel_sentences": 2}
        engine = lambda path, threads: MeetingEngine(wy.FakeEngine(path, threads))  # noqa: E731
        async with wy.fake_server(overrides, engine=engine) as srv:
            texts = ["Together one.", "Together two."]
            replies = await asyncio.gather(*(wy.synthesize(srv.port, t) for t in texts))
            alone = await wy.synthesize(srv.port, "Alone now.")
            return [*replies, alone], srv.engines[0]

    try:
        replies, engine = run(main())
    finally:
        torch.set_num_threads(cores)
    assert all(r.types[-1] == "audio-stop" and r.samples > 0 for r in replies)
    together = [s for s in engine.seen if s[0].startswith("Together")]
    assert {thread for _, thread, _ in together} == {"engine_0", "engine1_0"}
    assert {threads for *_, threads in together} == {1}  # two at once: one thread each
    alone = [s for s in engine.seen if s[0] == "Alone now."]
    assert alone and {(thread, threads) for _, thread, threads in alone} == {("engine_0", cores)}

