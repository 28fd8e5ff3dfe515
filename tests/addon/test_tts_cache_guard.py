"""Home Assistant's TTS cache is cleared when the server would now speak a cached message
differently: a changed setting (the server's command line, restarted, as the add-on restarts)
or a re-recorded custom voice (the real voices-folder scans, with the fake engine of
test_loudness). Home Assistant's API is a stand-in on a free port, reached as the add-on
reaches it through the Supervisor (its token in ``SUPERVISOR_TOKEN``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, TINY_MODEL, fake_server, terminate
from test_loudness import RecordingEngine, speechlike, write_wav
from voice_maker_helpers import StandInHomeAssistant

from wyoming_cosyvoice.custom_voices.folder import CustomVoices
from wyoming_cosyvoice.home_assistant import supervisor as home_assistant
from wyoming_cosyvoice.home_assistant.tts_cache_guard import STATE_FILE, TtsCacheGuard

CLEAR = "/api/services/tts/clear_cache"
RECORDED = "Recorded what shapes the audio"  # the guard's debug line once its file is written
# The server's command line, with Home Assistant's API at the stand-in's address (argv[1]) and
# the conftest's fake engine instead of loading the model.
LAUNCHER = """
import sys
sys.path.insert(0, "tests")
from conftest import FakeEngine
from wyoming_cosyvoice.home_assistant import supervisor as home_assistant
from wyoming_cosyvoice.models import model
from wyoming_cosyvoice.__main__ import main
home_assistant.SUPERVISOR_CORE_API = sys.argv[1]
model.engine_loader = lambda config: FakeEngine
sys.exit(main(sys.argv[2:]))
"""


def clears(ha: StandInHomeAssistant) -> list[str]:
    return [path for method, path, _ in ha.calls if method == "POST" and path == CLEAR]


def start_and_wait_for(ha: StandInHomeAssistant, data: Path, log: Path, says: str,
                       *settings: str) -> str:  # fmt: skip
    """Start the server, wait until its log ``says`` something, stop it; its log."""
    args = ["--uri", "tcp://127.0.0.1:0", "--model-dir", str(TINY_MODEL), "--data-dir",
            str(data), "--offline", "--no-warmup", "--debug"]  # fmt: skip
    for setting in settings:
        args += ["--set", setting]
    env = {**os.environ, "PYTHONPATH": str(ROOT), home_assistant.TOKEN_VARIABLE: ha.TOKEN}
    with log.open("w") as out:
        process = subprocess.Popen([sys.executable, "-c", LAUNCHER, ha.url, *args], cwd=ROOT,
                                   env=env, stdout=subprocess.DEVNULL, stderr=out)  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while says not in log.read_text():
                assert process.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        finally:
            terminate(process)
    return log.read_text()


@pytest.mark.long
def test_a_changed_setting_clears_home_assistants_cache_at_the_next_start(tmp_path: Path) -> None:
    unchanged = "Nothing that shapes the audio changed since the last start"
    log = tmp_path / "server.log"
    with StandInHomeAssistant([]) as ha:
        # The first start has nothing to compare with: it records what it runs with. (Each
        # start is stopped once its log says so: the record follows the model's readiness.)
        start_and_wait_for(ha, tmp_path, log, RECORDED)
        assert (tmp_path / STATE_FILE).is_file()
        start_and_wait_for(ha, tmp_path, log, unchanged)
        assert clears(ha) == []
        said = start_and_wait_for(ha, tmp_path, log, RECORDED,
                                  "server.speed=1.25", "server.volume=0.5")  # fmt: skip
        assert "the setting(s) speed, volume changed since the last start" in said
        assert clears(ha) == [CLEAR]
        assert {auth for _, _, auth in ha.calls} == {f"Bearer {ha.TOKEN}"}
        start_and_wait_for(ha, tmp_path, log, unchanged, "server.speed=1.25", "server.volume=0.5")
        assert clears(ha) == [CLEAR]  # once per change


def guard_in(folder: Path, url: str | None) -> TtsCacheGuard:
    api = home_assistant.HomeAssistantApi(url, StandInHomeAssistant.TOKEN) if url else None
    return TtsCacheGuard(folder / STATE_FILE, api)


def test_a_failed_clear_is_tried_again_at_the_next_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def start(url: str | None, speed: float) -> int:
        guard = guard_in(tmp_path, url)
        await guard.check_settings({"speed": speed})
        return guard.clears

    with StandInHomeAssistant([]) as ha:
        assert asyncio.run(start(ha.url, 1.0)) == 0
        ha.status = 500
        with caplog.at_level(logging.WARNING):
            assert asyncio.run(start(ha.url, 1.25)) == 0
        assert "Could not have Home Assistant clear its TTS cache" in caplog.text
        assert "tts.clear_cache" in caplog.text  # what the user can do instead
        ha.status = 200
        assert asyncio.run(start(ha.url, 1.25)) == 1
        assert asyncio.run(start(ha.url, 1.25)) == 0


def test_outside_the_add_on_the_log_says_what_to_clear(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def start(speed: float) -> None:
        await guard_in(tmp_path, None).check_settings({"speed": speed})

    asyncio.run(start(1.0))
    with caplog.at_level(logging.WARNING):
        asyncio.run(start(0.8))
    assert "Home Assistant may replay audio it kept from before" in caplog.text
    assert "Clear TTS cache" in caplog.text and "tts/" in caplog.text
    caplog.clear()
    asyncio.run(start(0.8))
    assert caplog.text == ""  # said once per change


def test_a_corrupt_state_file_is_recorded_afresh(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text("{half")
    guard = guard_in(tmp_path, None)
    asyncio.run(guard.check_settings({"speed": 1.0}))
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"settings": {"speed": 1.0}}


async def scanned_voices(voices: Path, data: Path, ha: StandInHomeAssistant,
                         change: Any = None) -> int:  # fmt: skip
    """Clears asked for by a server's first scan of ``voices`` and, after ``change(voices)``,
    its rescan."""

    def engine(path: Path, threads: int | None) -> RecordingEngine:
        return RecordingEngine(path, threads, {})

    settings = {"server.voices_dir": str(voices), "server.data_dirs": [str(data)]}
    async with fake_server(settings, engine=engine) as server:
        guard = TtsCacheGuard.for_config(server.config, {home_assistant.TOKEN_VARIABLE: ha.TOKEN})
        custom = CustomVoices(server.config, server.running.scheduler, TINY_MODEL,
                              tts_cache=guard).start()  # fmt: skip
        try:
            await custom.rescan()
            if change is not None:
                change(voices)
                await custom.rescan()
        finally:
            await custom.stop()
        return guard.clears


def test_a_re_recorded_voice_clears_home_assistants_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    voices, data = tmp_path / "voices", tmp_path / "data"
    voices.mkdir(), data.mkdir()
    write_wav(voices / "anna.wav", speechlike(5.0))

    def add_bert(folder: Path) -> None:
        write_wav(folder / "bert.wav", speechlike(5.0, seed=2))

    def re_record_anna(folder: Path) -> None:
        write_wav(folder / "anna.wav", speechlike(4.0, seed=3))

    with StandInHomeAssistant([]) as ha:
        monkeypatch.setattr(home_assistant, "SUPERVISOR_CORE_API", ha.url)
        # a new voice has nothing cached under its name
        assert asyncio.run(scanned_voices(voices, data, ha, add_bert)) == 0
        assert asyncio.run(scanned_voices(voices, data, ha, re_record_anna)) == 1
        assert clears(ha) == [CLEAR]
        # re-recorded while the server was stopped: seen at the first scan after the start
        re_record_anna(voices)
        assert asyncio.run(scanned_voices(voices, data, ha)) == 1
        assert asyncio.run(scanned_voices(voices, data, ha)) == 0
