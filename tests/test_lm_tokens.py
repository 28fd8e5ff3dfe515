"""engine.tokens.LmTokens: the first tokens inline, the rest from a background LM thread."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import torch

from engine.tokens import LmTokens


def _consume(run: Callable[[], object]) -> None:
    """Run ``run`` in its own thread: torch thread counts set there stay there (mostly)."""
    cores = torch.get_num_threads()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as err:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(err)

    thread = threading.Thread(target=target, name="consumer")
    thread.start()
    thread.join(timeout=30)
    torch.set_num_threads(cores)  # a set count is also the one new threads start with
    assert not thread.is_alive()
    if errors:
        raise errors[0]


def test_tokens_come_in_order_inline_then_from_the_lm_thread() -> None:
    producers: list[str] = []

    def make_tokens() -> Iterator[int]:
        for token in range(10):
            producers.append(threading.current_thread().name)
            yield token

    got: list[int] = []
    _consume(lambda: got.extend(LmTokens(make_tokens, inline=3)))
    assert got == list(range(10))
    assert producers[:3] == ["consumer"] * 3
    assert set(producers[3:]) == {"cosyvoice-lm"}


def test_the_lm_thread_follows_the_consumers_thread_count() -> None:
    """A server that starts a second sentence gives the first one thread from its next chunk
    on: the first sentence's LM thread must follow, not keep both cores."""
    n_tokens, switch_after = 12, 4
    consumed = threading.Semaphore(0)
    counts: list[int] = []

    def make_tokens() -> Iterator[int]:
        for token in range(n_tokens):
            if token > 0:
                consumed.acquire()  # one token ahead at most: the switch becomes visible
            counts.append(torch.get_num_threads())
            yield token

    def run() -> None:
        torch.set_num_threads(3)
        for token in LmTokens(make_tokens, inline=2):
            if token == switch_after:
                torch.set_num_threads(1)
            consumed.release()

    _consume(run)
    assert len(counts) == n_tokens
    assert counts[:switch_after + 1] == [3] * (switch_after + 1)  # inline, then the LM thread
    assert counts[-4:] == [1] * 4


def test_a_thread_budget_is_applied_before_every_token_in_both_threads() -> None:
    counts: list[tuple[str, int]] = []
    pattern = [2, 1, 3]
    answers = itertools.cycle(pattern)

    def make_tokens() -> Iterator[int]:
        for token in range(10):
            counts.append((threading.current_thread().name, torch.get_num_threads()))
            yield token

    got: list[int] = []
    _consume(lambda: got.extend(LmTokens(make_tokens, inline=3, threads=lambda: next(answers))))
    assert got == list(range(10))
    assert [n for _, n in counts] == [pattern[i % 3] for i in range(10)]
    assert [name for name, _ in counts] == ["consumer"] * 3 + ["cosyvoice-lm"] * 7
