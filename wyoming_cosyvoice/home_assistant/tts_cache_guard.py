"""Home Assistant's TTS cache, cleared when this server would now speak a cached message
differently.

Home Assistant keeps the audio of the messages it had spoken (``tts.speak`` calls and an Assist
pipeline's ready-made answers; an LLM's streamed replies are not kept) in files keyed on the
message, language, voice and speaker only, and plays such a file again instead of asking the
server. What else shapes the audio is invisible to that key: the model, the default voice (a
call may name none), the speed, the loudness target and the volume, and a custom voice's
recording, transcript and instruction. When one of those changed since it was last seen, the
server asks Home Assistant to clear its TTS cache (its ``tts.clear_cache`` action, through the
Supervisor's API inside the add-on: :mod:`.supervisor`); outside the add-on, or when the
call fails, it logs what the user can do.

Why not a voice id that changes with the recording: Home Assistant stores the id the user
picked (in the pipeline, in automations), and a stored id keeps its stale key; only picking
the voice again would change it, which asks more of the user than the cache's own action.

What was last seen is kept in ``<download dir>/home-assistant-tts.json`` (when that dir
exists); a first start has nothing to compare with and only records it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.home_assistant.supervisor import HomeAssistantApi, HomeAssistantError

_LOGGER = logging.getLogger(__name__)

STATE_FILE = "home-assistant-tts.json"
HOW_TO_CLEAR = (
    "in Home Assistant run the action 'Text-to-speech (TTS): Clear TTS cache' (tts.clear_cache, "
    "under Developer tools → Actions), or delete the files in its config folder's tts/"
)
# Files of a custom voice that shape its speech (engine.prompt.voices): recording, transcript,
# instruction.
_VOICE_FILE_ENDINGS = (".wav", ".txt", ".instruct.txt")


def settings_identity(config: ServerConfig, model_dir: Path) -> dict[str, Any]:
    """What shapes the audio of a request beside its text, voice and speaker."""
    return {
        "model": model_dir.name,
        "default_voice": config.voice,
        "speed": config.speed,
        "loudness": config.loudness,
        "volume": config.volume,
    }


def voice_files_identity(
    folder: Iterable[tuple[str, int, int]], names: Iterable[str]
) -> dict[str, list[list[Any]]]:
    """Per custom voice, its files' (name, size, modification time) among ``folder``'s (the
    voices folder's fingerprint: :func:`.custom_voices.folder.folder_fingerprint`)."""
    entries = list(folder)
    return {
        name: [list(e) for e in entries
               if e[0].casefold() in {f"{name}{end}".casefold() for end in _VOICE_FILE_ENDINGS}]
        for name in names
    }  # fmt: skip


class TtsCacheGuard:
    """Compares what shapes the audio with what it was, and has Home Assistant's cache cleared
    when it changed. ``state``: where what was seen is kept (None: nowhere, nothing compared)."""

    def __init__(self, state: Path | None, api: HomeAssistantApi | None) -> None:
        self.state, self.api = state, api
        self.clears = 0  # times Home Assistant was asked to clear its cache
        self._lock = asyncio.Lock()

    @classmethod
    def for_config(cls, config: ServerConfig, env: Mapping[str, str] = os.environ) -> TtsCacheGuard:
        data = config.effective_download_dir
        state = data / STATE_FILE if data.is_dir() else None
        return cls(state, HomeAssistantApi.from_environment(env))

    async def check_settings(self, settings: Mapping[str, Any]) -> None:
        """At the start: the settings that shape the audio, against the last start's."""
        async with self._lock:
            seen = await asyncio.to_thread(self._read)
            before = seen.get("settings")
            now = json.loads(json.dumps(settings))  # as it reads back from the file
            if before is not None and before != now:
                changed = ", ".join(sorted(k for k in now if before.get(k) != now.get(k)))
                if not await self._clear(f"the setting(s) {changed} changed since the last start"):
                    return  # seen again at the next start, and cleared then
            if before == now:
                _LOGGER.debug("Nothing that shapes the audio changed since the last start")
                return
            await asyncio.to_thread(self._write, {**seen, "settings": now})

    async def check_voices(self, voices: Mapping[str, Any]) -> None:
        """After a scan of the voices folder: each offered voice's files, against what they
        were when the voice was last offered (also before a restart)."""
        async with self._lock:
            seen = await asyncio.to_thread(self._read)
            before: dict[str, Any] = seen.get("voices", {})
            now = json.loads(json.dumps(voices))
            changed = sorted(n for n, files in now.items() if n in before and before[n] != files)
            if changed and not await self._clear(f"custom voice(s) {', '.join(changed)} changed"):
                return
            if any(before.get(n) != files for n, files in now.items()):
                # voices no longer offered are kept: one offered again may have changed
                await asyncio.to_thread(self._write, {**seen, "voices": {**before, **now}})

    async def _clear(self, reason: str) -> bool:
        """Ask Home Assistant to clear its TTS cache; False (and logged) if it could not be."""
        if self.api is None:
            _LOGGER.warning("Home Assistant may replay audio it kept from before: %s. To hear "
                            "the change, %s", reason, HOW_TO_CLEAR)  # fmt: skip
            return True  # nothing to retry: without the Supervisor it is the user's to do
        try:
            await asyncio.to_thread(self.api.clear_tts_cache)
        except HomeAssistantError as err:
            _LOGGER.warning("Could not have Home Assistant clear its TTS cache (%s): %s. It "
                            "may replay audio it kept from before; %s", reason, err,
                            HOW_TO_CLEAR)  # fmt: skip
            return False
        self.clears += 1
        _LOGGER.info("Home Assistant cleared its TTS cache: %s", reason)
        return True

    def _read(self) -> dict[str, Any]:
        if self.state is None:
            return {}
        try:
            seen = json.loads(self.state.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as err:
            _LOGGER.warning("Ignoring %s (%s): what shapes the audio is recorded afresh",
                            self.state, err)  # fmt: skip
            return {}
        return seen if isinstance(seen, dict) else {}

    def _write(self, seen: dict[str, Any]) -> None:
        if self.state is None:
            return
        staging = self.state.with_name(f".{self.state.name}.part")
        try:
            staging.write_text(json.dumps(seen, ensure_ascii=False), encoding="utf-8")
            os.replace(staging, self.state)  # a reader sees the old file or the whole new one
            _LOGGER.debug("Recorded what shapes the audio in %s", self.state)
        except OSError as err:
            _LOGGER.warning("Cannot write %s: %s", self.state, err)
            with contextlib.suppress(OSError):
                staging.unlink(missing_ok=True)
