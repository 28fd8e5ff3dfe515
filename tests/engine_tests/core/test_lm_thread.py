"""engine.core.lm_thread.LmTokens: the first tokens inline, the rest in turns with the vocoder
(few cores) or from a background LM thread (more)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from engine.core import lm_thread, thread_budget
from engine.core.lm_thread import LmTokens


def _consume(run: Callable[[], object]) -> None:
    """Run ``run`` in its own thread: torch thread counts set there stay there (mostly)."""
    cores = torch.get_num_threads()
    errors: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as err:  # re-raised in the test's thread
            errors.append(err)

    thread = threading.Thread(target=target, name="consumer")
    thread.start()
    thread.join(timeout=30)
    torch.set_num_threads(cores)  # a set count is also the one new threads start with
    assert not thread.is_alive()
    if errors:
        raise errors[0]


@pytest.fixture
def lm_beside_vocoder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A machine with cores enough that the LM decodes beside the vocoder, not in turns (without
    asking the budget, whose scripted answers the tests count)."""
    monkeypatch.setattr(lm_thread, "lm_takes_turns", lambda budget: False)


@pytest.mark.usefixtures("lm_beside_vocoder")
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


@pytest.fixture
def three_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process configured for three threads (conftest: whatever the machine's load)."""
    monkeypatch.setattr(thread_budget, "_configured", 3)


@pytest.mark.usefixtures("three_threads", "lm_beside_vocoder")
def test_without_a_budget_both_threads_use_the_configured_count() -> None:
    counts: list[int] = []

    def make_tokens() -> Iterator[int]:
        for token in range(8):
            counts.append(torch.get_num_threads())
            yield token

    def run() -> None:
        torch.set_num_threads(1)  # whatever the consumer had: the configured count wins
        list(LmTokens(make_tokens, inline=2))

    _consume(run)
    assert counts == [3] * 8


class _FreeCores:
    """A CPU share monitor whose free cores follow a script, one answer per question."""

    def __init__(self, answers: list[int]) -> None:
        self.answers = iter(answers)
        self.last = answers[-1]

    def free_cores(self) -> int:
        self.last = next(self.answers, self.last)
        return self.last


@pytest.mark.usefixtures("lm_beside_vocoder")
def test_both_threads_shrink_to_the_free_cores_and_grow_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A neighbour takes a core after two tokens and leaves after six: the LM never runs more
    threads than the cores left, and takes them back."""
    monkeypatch.setattr(thread_budget, "_configured", 3)
    monkeypatch.setattr(thread_budget, "_follow_free_cores", True)
    monitor = _FreeCores([3, 3, 1, 1, 1, 1, 2, 3])
    monkeypatch.setattr(thread_budget, "process_monitor", lambda: monitor)
    counts: list[tuple[str, int]] = []

    def make_tokens() -> Iterator[int]:
        for token in range(8):
            counts.append((threading.current_thread().name, torch.get_num_threads()))
            yield token

    _consume(lambda: list(LmTokens(make_tokens, inline=4)))
    assert [n for _, n in counts] == [3, 3, 1, 1, 1, 1, 2, 3]
    assert {name for name, _ in counts[4:]} == {"cosyvoice-lm"}


@pytest.mark.usefixtures("three_threads", "lm_beside_vocoder")
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


@pytest.mark.usefixtures("three_threads", "lm_beside_vocoder")
def test_the_lm_beside_a_busy_vocoder_runs_one_thread_and_the_vocoder_the_rest() -> None:
    """One OpenMP team at a time: while a vocoder computes, the LM thread beside it takes one
    thread and the vocoder the others; while the vocoder waits for tokens, the LM takes all."""
    seen: list[tuple[str, int]] = []
    vocoder_threads: list[int] = []
    go = threading.Semaphore(0)  # the test releases each token after the inline ones

    def make_tokens() -> Iterator[int]:
        for token in range(5):
            if token >= 2:
                go.acquire()
            seen.append((threading.current_thread().name, torch.get_num_threads()))
            yield token

    def run() -> None:
        tokens = iter(LmTokens(make_tokens, inline=2))
        assert [next(tokens), next(tokens)] == [0, 1]  # inline: no LM thread yet
        vocoder_threads.append(thread_budget.threads_now(None))
        with thread_budget.vocoder_busy():
            go.release()
            assert next(tokens) == 2  # made by the LM thread while the vocoder is busy
            vocoder_threads.append(thread_budget.threads_now(None))
        go.release(2)
        # The vocoder waits for tokens: the LM alone. (Token 3's count was set as token 2 was
        # handed over, racing the block's end; token 4's is set after it.)
        assert [next(tokens), next(tokens), next(tokens, None)] == [3, 4, None]
        vocoder_threads.append(thread_budget.threads_now(None))  # the LM thread has ended

    _consume(run)
    assert seen[:3] == [("consumer", 3), ("consumer", 3), ("cosyvoice-lm", 1)]
    assert seen[4] == ("cosyvoice-lm", 3)
    assert vocoder_threads == [3, 2, 3]


@pytest.mark.usefixtures("three_threads")
def test_on_few_cores_the_lm_takes_turns_with_the_vocoder_in_the_consumers_thread() -> None:
    """Up to TURNS_UP_TO_THREADS threads every token comes from the consumer's thread, each only
    when the consumer asks for it (nothing decodes while the vocoder computes), with every
    thread, and the vocoder keeps every thread too."""
    assert thread_budget.TURNS_UP_TO_THREADS >= 3
    made: list[tuple[str, int]] = []
    vocoder_threads: list[int] = []

    def make_tokens() -> Iterator[int]:
        for token in range(6):
            made.append((threading.current_thread().name, torch.get_num_threads()))
            yield token

    def run() -> None:
        tokens = iter(LmTokens(make_tokens, inline=2))
        assert [next(tokens), next(tokens)] == [0, 1]
        with thread_budget.vocoder_busy():  # the first chunk: nothing is decoded meanwhile
            vocoder_threads.append(thread_budget.threads_now(None))
            assert len(made) == 2
        assert next(tokens) == 2
        assert len(made) == 3
        assert list(tokens) == [3, 4, 5]

    _consume(run)
    assert made == [("consumer", 3)] * 6
    assert vocoder_threads == [3]


def test_a_busy_machine_takes_turns_where_a_quiet_one_decodes_beside(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The choice is the thread count free when the first chunk is out: six free cores put the
    LM beside the vocoder, a neighbour that leaves two puts them in turns."""
    monkeypatch.setattr(thread_budget, "_configured", 6)
    monkeypatch.setattr(thread_budget, "_follow_free_cores", True)
    producers: dict[int, list[str]] = {}
    for free in (6, 2):
        monitor = _FreeCores([free])
        monkeypatch.setattr(thread_budget, "process_monitor", lambda m=monitor: m)
        names = producers.setdefault(free, [])

        def make_tokens(names: list[str] = names) -> Iterator[int]:
            for token in range(4):
                names.append(threading.current_thread().name)
                yield token

        _consume(lambda: list(LmTokens(make_tokens, inline=2)))
    assert producers[6] == ["consumer"] * 2 + ["cosyvoice-lm"] * 2
    assert producers[2] == ["consumer"] * 4
