"""The voices' learnt levels kept across restarts: through the real server (Wyoming over TCP,
with the fake engine), restarted on the same data directory; a re-recorded voice starts over
from its new recording, and a corrupt or unwritable file costs only what was learnt."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import TINY_MODEL, FakeEngine, fake_server, synthesize
from test_loudness import (
    MAX_STEP_DB,
    RATE,
    SENTENCES,
    TARGET,
    TEXT,
    floats,
    loudness_of,
    sentence_gains,
    speechlike,
    write_wav,
)

from wyoming_cosyvoice.voices.catalog import Voice
from wyoming_cosyvoice.voices.loudness import LEVELS_DIR, STORE_FORMAT, LevelStore, VoiceLevels


class LoudEngine(FakeEngine):
    AMPLITUDE = 0.6  # about −8 LUFS: 10 dB over the target


def made_by_loud_engine() -> list[np.ndarray]:
    engine, speaker = LoudEngine(TINY_MODEL, delay=0), SimpleNamespace(speaker="中文男")
    return [np.concatenate([c.samples for c in engine.synthesize(s, speaker)]) for s in SENTENCES]


async def gains_of_requests(data: Path, requests: int) -> list[list[float]]:
    """Each request's sentence gains, on a server whose data directory is ``data``."""
    made = made_by_loud_engine()
    async with fake_server({"server.data_dirs": [str(data)]}, engine=LoudEngine) as server:
        replies = [await synthesize(server.port, TEXT, {"name": "zh-male"})
                   for _ in range(requests)]  # fmt: skip
    return [sentence_gains(floats(r.audio), made) for r in replies]


def store_file(data: Path) -> Path:
    return data / LEVELS_DIR / f"{TINY_MODEL.name}.json"


def test_a_restart_keeps_what_was_learnt_of_a_voice(tmp_path: Path) -> None:
    learnt = TARGET - (-8.2)  # the loud engine's level brought to the target
    before = asyncio.run(gains_of_requests(tmp_path, 2))
    assert before[0][0] == pytest.approx(0.0, abs=1e-3)  # a new voice: the model's own level
    assert before[1] == pytest.approx([learnt] * len(SENTENCES), abs=0.5)
    saved = json.loads(store_file(tmp_path).read_text())
    assert saved["format"] == STORE_FORMAT and set(saved["voices"]) == {"中文男"}

    (after,) = asyncio.run(gains_of_requests(tmp_path, 1))
    # The first sentence after the restart is at the learnt gain, not at the model's level.
    assert after == pytest.approx(before[1], abs=0.01)


GOOD_ENTRY = '{"recording": null, "recording_lufs": null, "gain_db": 0, "blocks_lufs": [-20]}'


@pytest.mark.parametrize("content", [
    b"{not json", b"[]", b'{"format": 1, "voices": {"x": 3}}', b'{"format": 999, "voices": {}}',
    b"\xff\xfe", f'{{"format": 1, "voices": {{"中文男": {GOOD_ENTRY}}}}}'[:-9].encode(),
    f'{{"format": 1, "voices": {{"中文男": {GOOD_ENTRY.replace("0", "NaN", 1)}}}}}'.encode(),
    f'{{"format": 1, "voices": {{"中文男": {GOOD_ENTRY.replace("-20", "true")}}}}}'.encode(),
])  # fmt: skip
def test_a_corrupt_file_is_learnt_again_and_replaced(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = store_file(tmp_path)
    path.parent.mkdir()
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, "wyoming_cosyvoice.voices.loudness"):
        gains = asyncio.run(gains_of_requests(tmp_path, 1))[0]
    assert gains[0] == pytest.approx(0.0, abs=1e-3)  # nothing usable was read
    assert np.diff(gains) == pytest.approx([-MAX_STEP_DB] * 3, abs=0.01)  # learnt as new
    assert "Ignoring the saved voice levels" in caplog.text
    assert "中文男" in json.loads(path.read_text())["voices"]  # replaced by a good file


def test_an_unwritable_data_directory_costs_only_the_saving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store_file(tmp_path).parent.write_text("a file where the folder would be")
    with caplog.at_level(logging.WARNING, "wyoming_cosyvoice.voices.loudness"):
        first, second = asyncio.run(gains_of_requests(tmp_path, 2))
    assert second == pytest.approx([TARGET - (-8.2)] * len(SENTENCES), abs=0.5)
    assert caplog.text.count("Cannot save the voice levels") == 1


def test_no_data_directory_no_file(tmp_path: Path) -> None:
    asyncio.run(gains_of_requests(tmp_path / "absent", 1))
    assert not (tmp_path / "absent").exists()  # a state file makes no data dir of its own


def test_a_re_recorded_voice_starts_from_its_new_recording(tmp_path: Path) -> None:
    voice = Voice("anna", "anna", ("en_US",), "anna", custom=True)
    recording = tmp_path / "anna.wav"
    store = LevelStore(tmp_path / "levels.json")

    async def learn(quieter_db: float) -> float:
        """A server's first gain for anna, after it heard the model speak her
        ``quieter_db`` under her recording."""
        levels = VoiceLevels(TARGET, 1.0, (tmp_path, None), store)
        request = levels.request()
        first = await request.sentence(voice, RATE)
        spoken = speechlike(6.0, seed=1) * 10 ** (-quieter_db / 20)
        first._raw = [spoken.astype(np.float32)]
        await request.finished(first)
        levels.close()
        return first.gain_db

    write_wav(recording, speechlike(5.0))
    from_recording = TARGET - loudness_of(speechlike(5.0))
    assert asyncio.run(learn(6.0)) == pytest.approx(from_recording, abs=0.05)
    # restarted: anna's speech was measured 6 dB under her recording, and that is kept
    restarted = VoiceLevels(TARGET, 1.0, (tmp_path, None), store)
    measured = TARGET - (loudness_of(speechlike(6.0, seed=1)) - 6.0)
    assert abs(measured - from_recording) > 5.0
    assert restarted.voice_gain_db(voice) == pytest.approx(measured, abs=0.05)

    write_wav(recording, speechlike(5.0) * 0.1)  # re-recorded 20 dB quieter
    again = VoiceLevels(TARGET, 1.0, (tmp_path, None), store)
    first = asyncio.run(again.request().sentence(voice, RATE))
    assert first.gain_db == pytest.approx(from_recording + 20.0, abs=0.1)  # the new recording's


def test_the_levels_are_saved_while_serving_too(tmp_path: Path) -> None:
    """Not only at a clean stop: a killed server keeps what it saved before."""

    async def main() -> dict[str, object]:
        async with fake_server({"server.data_dirs": [str(tmp_path)]}, engine=LoudEngine) as server:
            assert (await synthesize(server.port, TEXT, {"name": "zh-male"})).error() is None
            # (a sentence's measuring, its save included, ends before the next is spoken)
            return json.loads(store_file(tmp_path).read_text())

    assert "中文男" in asyncio.run(main())["voices"]
