"""Tell Home Assistant about new voices (reload its Wyoming entry) and about changed audio
(clear its TTS cache), through the Supervisor.

Home Assistant reads a Wyoming server's voices (``describe``) when the integration's entry
loads, so a voice made on the web page shows up in Home Assistant only after that entry is
reloaded. Inside the add-on (``homeassistant_api: true`` in its manifest) the Supervisor gives
the process a token (``SUPERVISOR_TOKEN``) for Home Assistant's REST API at
``http://supervisor/core/api``, where the Supervisor acts as an administrator: the web page
offers to do the reload for the user. The entries reloaded are the Wyoming ones whose title
names this server (the add-on is discovered as "CosyVoice"); a renamed entry is reloaded by
hand (addon/DOCS.md). Its TTS cache is cleared with its ``tts.clear_cache`` action
(:mod:`.tts_cache_guard` says when).

Small requests with the standard library, in a thread: no HTTP client dependency.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

SUPERVISOR_CORE_API = "http://supervisor/core/api"
TOKEN_VARIABLE = "SUPERVISOR_TOKEN"
ENTRY_TITLE = "cosyvoice"  # matched without case inside a Wyoming entry's title
TIMEOUT_S = 30.0


class HomeAssistantError(Exception):
    """Home Assistant could not be asked, or refused."""


@dataclass(frozen=True)
class HomeAssistantApi:
    """Home Assistant's REST API as the add-on reaches it."""

    base_url: str
    token: str

    @classmethod
    def from_environment(cls, env: Mapping[str, str] = os.environ) -> HomeAssistantApi | None:
        """The Supervisor's API when running as an add-on allowed to use it, else None."""
        token = env.get(TOKEN_VARIABLE, "").strip()
        return cls(SUPERVISOR_CORE_API, token) if token else None

    def _call(self, method: str, path: str) -> Any:
        request = urllib.request.Request(
            f"{self.base_url}{path}",
            method=method,
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"},
            data=b"{}" if method == "POST" else None,
        )
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as err:
            detail = err.read().decode("utf-8", "replace").strip()[:200]
            raise HomeAssistantError(f"Home Assistant answered {method} {path} with "
                                     f"{err.code}: {detail or err.reason}") from err  # fmt: skip
        except (OSError, ValueError) as err:
            raise HomeAssistantError(f"cannot reach Home Assistant at {self.base_url}: "
                                     f"{getattr(err, 'reason', err)}") from err  # fmt: skip

    def wyoming_entries(self) -> list[dict[str, Any]]:
        """This server's entries of the Wyoming integration."""
        entries = self._call("GET", "/config/config_entries/entry?domain=wyoming")
        if not isinstance(entries, list):
            raise HomeAssistantError("Home Assistant's list of Wyoming entries is not a list")
        return [
            e for e in entries
            if isinstance(e, dict) and ENTRY_TITLE in str(e.get("title", "")).casefold()
        ]  # fmt: skip

    def reload_wyoming_entries(self) -> list[str]:
        """Reload this server's Wyoming entries; their titles. Blocking: run it in a thread."""
        entries = self.wyoming_entries()
        for entry in entries:
            self._call("POST", f"/config/config_entries/entry/{quote(entry['entry_id'])}/reload")
        return [str(e["title"]) for e in entries]

    def clear_tts_cache(self) -> None:
        """Run Home Assistant's ``tts.clear_cache`` action (every TTS engine's cached audio:
        it has no narrower one). Blocking: run it in a thread."""
        self._call("POST", "/services/tts/clear_cache")
