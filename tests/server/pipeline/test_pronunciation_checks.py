"""The scheduler hands the settings' pronunciations to the engine once it has loaded, on the
engine thread, logs a WARNING per line the engine cannot apply and keeps the checks for the
HTTP API; with none set it does not ask."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import TINY_MODEL, FakeEngine

from engine.text.pronunciations import PronunciationCheck
from wyoming_cosyvoice.pipeline.scheduler import Scheduler

LINES = ("Niamh = Neev", "Michael = M AY1 K AH0 L", "no equals sign")


class Recording(FakeEngine):
    """Checks lines as a v1 model does, remembering what it was given and on which thread."""

    def __init__(self, model_dir: Path, threads: int | None = None) -> None:
        super().__init__(model_dir, threads)
        self.given: list[tuple[tuple[str, ...], str]] = []

    def use_pronunciations(self, lines: Sequence[str]) -> list[PronunciationCheck]:
        self.given.append((tuple(lines), threading.current_thread().name))
        return super().use_pronunciations(lines)


def _loaded(lines: Sequence[str]) -> tuple[Scheduler, Recording]:
    async def load() -> tuple[Scheduler, Recording]:
        made = Scheduler(TINY_MODEL, engine_factory=Recording, warmup=False,
                         pronunciations=lines)  # fmt: skip
        try:
            engine = await made.load()
        finally:
            made.shutdown()
        assert isinstance(engine, Recording)
        return made, engine

    return asyncio.run(load())


def test_lines_the_engine_cannot_apply_are_logged_and_kept(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="wyoming_cosyvoice.pipeline.scheduler")
    scheduler, engine = _loaded(LINES)
    assert [lines for lines, _ in engine.given] == [LINES]
    assert engine.given[0][1].startswith("engine")  # the engine thread, not the event loop
    assert [c.problem is None for c in scheduler.pronunciation_checks] == [True, False, False]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert warnings[0].startswith("pronunciation 'Michael = M AY1 K AH0 L' is not applied: ")
    assert "add a respelling" in warnings[0]
    assert warnings[1] == ("pronunciation 'no equals sign' is not applied: no '=': write it "
                           "as  word = pronunciation")  # fmt: skip
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "Pronunciations applied: 1 of 3 ('Niamh')" in infos


def test_no_lines_no_call(caplog: pytest.LogCaptureFixture) -> None:
    scheduler, engine = _loaded(())
    assert engine.given == [] and scheduler.pronunciation_checks == []
    assert not any("ronunciation" in r.getMessage() for r in caplog.records)
