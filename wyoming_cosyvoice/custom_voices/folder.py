"""Custom voices for the server: the voices folder, its re-scans and the catalog.

After the model has loaded, the folder (``--voices-dir``) is scanned on the engine thread, in
the request queue's turn (``Scheduler.run_on_engine``), and the good voices join the voice
catalog that ``describe`` and the HTTP API read. Every ``server.voices_rescan_s`` seconds a cheap
fingerprint of the folder (names, sizes, modification times) is taken off the event loop; only
when it changed is the folder scanned again, so a voice dropped in later appears without a
restart and an idle server does no work. The engine reuses each voice's prompt cache
(``NAME.prompt.pt`` for v1, ``NAME.cosyvoice2.prompt.pt`` for CosyVoice2), so a re-scan only
analyses new or changed recordings. A voice saved from the web page asks for a check at once
(:meth:`CustomVoices.rescan`) instead of waiting for the next one.

The prompt models (``campplus.onnx`` and the family's speech tokenizer, ~550 MB) are downloaded
only when a voice actually needs them (a valid recording without an up-to-date cache), not for
every add-on user: the add-on always passes a voices folder. The download runs in a daemon
thread, so built-in voices keep speaking meanwhile and a shutdown never waits for it (an
interrupted download resumes next time). Without them, cached voices still work and the others
are skipped with a message; the server keeps running whatever the folder holds.

Per request, Wyoming's ``voice.speaker`` carries an instruction for the -Instruct model and
CosyVoice2 (instruct2, with any voice) when it names no voice (see
:func:`wyoming_cosyvoice.pipeline.speech.split_instruction` and docs/custom-voices.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.api import Engine
from engine.family import PROMPT_CACHE_ENDING
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.home_assistant.tts_cache_guard import TtsCacheGuard, voice_files_identity
from wyoming_cosyvoice.pipeline.scheduler import Scheduler
from wyoming_cosyvoice.voices.catalog import VoiceCatalog, describe_custom_voice
from wyoming_cosyvoice.voices.names import name_key

if TYPE_CHECKING:
    from engine.prompt.voices import ScanResult

_LOGGER = logging.getLogger(__name__)

DOWNLOAD_RETRY_S = 600.0  # a failed download is tried again on a folder change, not sooner

Fingerprint = tuple[tuple[str, int, int], ...]
_NEVER = object()  # no fingerprint taken yet: the first check always scans


def voice_model_name(config: ServerConfig, model_dir: Path) -> str:
    """The model whose repository completes ``model_dir`` with its prompt models: the
    configured one, unless the directory (``--model-dir``) is of another family."""
    from wyoming_cosyvoice.models.model import family_at

    family = family_at(model_dir)
    return config.model if config.model in family.models else family.base_model


def prompt_model_files(model_dir: Path) -> tuple[str, ...]:
    """The ONNX files voices of ``model_dir``'s family are extracted with."""
    from wyoming_cosyvoice.models.model import family_at

    return family_at(model_dir).prompt_model_files


def folder_fingerprint(
    voices_dir: Path, model_dir: Path, prompt_models: tuple[str, ...] = ()
) -> Fingerprint | None:
    """What a re-scan depends on: the voice files and the prompt models; None if no folder."""
    try:
        entries = [
            (p.name, st.st_size, st.st_mtime_ns)
            for p in voices_dir.iterdir()
            if not p.name.startswith(".")
            and not p.name.lower().endswith(PROMPT_CACHE_ENDING)
            and p.is_file()
            and (st := p.stat())
        ]
    except OSError:  # no folder (yet), or it vanished while listed: scan and let it say so
        return None
    for name in prompt_models:  # placed by hand later: voices waiting for them become usable
        path = model_dir / name
        entries.append((f"model:{name}", path.stat().st_size if path.is_file() else -1, 0))
    return tuple(sorted(entries))


def custom_voice_exists(voices_dir: Path | None, name: str) -> bool:
    """True when the folder mentions ``name``, or a name that looks the same (a ``--voice``
    checked before the first scan; the catalog finds it the same way)."""
    if voices_dir is None or not voices_dir.is_dir():
        return False
    from engine.prompt.voices import voice_names

    return name_key(name) in {name_key(found) for found in voice_names(voices_dir)}


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` in a daemon thread: unlike the default executor, exit never waits for it."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error else future.set_result(result)

    def target() -> None:
        try:
            result, error = fn(), None
        except BaseException as err:  # handed to the awaiting task
            result, error = None, err
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:
            pass  # the loop has closed: nobody is waiting any more

    threading.Thread(target=target, name="prompt-models", daemon=True).start()
    return await future


class CustomVoices:
    """Keeps the catalog's custom voices in step with the voices folder."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler, model_dir: Path, *,
                 tts_cache: TtsCacheGuard | None = None) -> None:  # fmt: skip
        assert config.voices_dir is not None
        self.tts_cache = tts_cache  # told what each offered voice is made of, after a scan
        self.config, self.scheduler, self.model_dir = config, scheduler, model_dir
        self.voices_dir = config.voices_dir
        from wyoming_cosyvoice.models.model import family_at

        family = family_at(model_dir)
        self.model_name = voice_model_name(config, model_dir)
        self.prompt_models = family.prompt_model_files
        self.cache_suffix = family.prompt_cache_suffix
        self.scans = 0
        self._seen: object = _NEVER
        self._offered: set[str] = set()
        self.rejected: dict[str, str] = {}  # the last scan's skipped voices and why
        self.fetching = False  # the prompt models are being downloaded
        self._wake = asyncio.Event()
        self._waiters: list[asyncio.Future[None]] = []
        self._download_failed_at: float | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> CustomVoices:
        self._task = asyncio.create_task(self.run(), name="custom voices")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        try:
            engine = await asyncio.shield(self.scheduler.ready)
        except Exception:  # a failed load is reported (and ends the server) elsewhere
            return
        _LOGGER.info(
            "Custom voices from %s (checked for changes every %g s)",
            self.voices_dir,
            self.config.voices_rescan_s,
        )
        while True:
            self._wake.clear()  # a rescan() asked for from here on gets a check of its own
            waiters, self._waiters = self._waiters, []
            try:
                seen = await asyncio.to_thread(
                    folder_fingerprint, self.voices_dir, self.model_dir, self.prompt_models
                )
                if seen != self._seen:
                    self._seen = seen
                    await self.scan(engine)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad folder must never stop the server
                _LOGGER.exception("Scanning the custom voices in %s failed", self.voices_dir)
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.voices_rescan_s)

    async def rescan(self) -> None:
        """Check the folder now (a voice was just saved); returns once a check that started
        after this call has finished, its scan included. Before the model has loaded, that is
        the first scan."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self._wake.set()
        await waiter

    def state(self, name: str) -> tuple[str, str | None]:
        """("offered" | "rejected" | "waiting", why) for a voice of the folder."""
        if name in self._offered:
            return "offered", None
        if name in self.rejected:
            return "rejected", self.rejected[name]
        if self.fetching:
            return "waiting", (
                f"the server is downloading the prompt models ({' and '.join(self.prompt_models)}"
                ", about 550 MB) that a first custom voice needs"
            )
        return "waiting", "the server has not scanned it yet"

    async def scan(self, engine: Engine) -> None:
        """Scan on the engine thread (fetching the prompt models first if a voice needs them)."""
        scan = partial(engine.enable_custom_voices, self.voices_dir)
        result = await self.scheduler.run_on_engine(scan)
        models = self.prompt_models
        waiting = [n for n, why in result.rejected.items() if any(m in why for m in models)]
        if waiting and await self._fetch_prompt_models(waiting):
            result = await self.scheduler.run_on_engine(scan)
        self.scans += 1
        self._publish(engine, result)
        if self.tts_cache is not None and isinstance(self._seen, tuple):
            await self.tts_cache.check_voices(voice_files_identity(self._seen, self._offered))

    async def _fetch_prompt_models(self, waiting: list[str]) -> bool:
        """Download the ONNX prompt models into the model dir; False (and logged) if impossible."""
        from wyoming_cosyvoice.models.download import (
            DownloadError,
            ModelNotFoundError,
            ensure_extra_files,
        )

        names = ", ".join(waiting)
        failed = self._download_failed_at
        if failed is not None and time.monotonic() - failed < DOWNLOAD_RETRY_S:
            _LOGGER.warning(
                "Custom voice(s) %s wait for %s in %s (the last download failed; it is tried "
                "again after the next change in the folder)",
                names,
                " and ".join(self.prompt_models),
                self.model_dir,
            )
            return False
        from huggingface_hub import constants as hub_constants

        if not (self.config.offline or hub_constants.is_offline_mode()):
            # (offline, ensure_extra_files fails at once with where to put the files by hand)
            _LOGGER.info(
                "Custom voice(s) %s need the prompt models %s (about 550 MB); downloading them "
                "into %s. Built-in voices keep working meanwhile",
                names,
                " and ".join(self.prompt_models),
                self.model_dir,
            )
        started = time.monotonic()
        self.fetching = True
        try:
            await _in_daemon_thread(
                lambda: ensure_extra_files(
                    self.model_dir,
                    self.model_name,
                    self.prompt_models,
                    offline=self.config.offline,
                    endpoint=self.config.hub_endpoint,
                )
            )
        except (ModelNotFoundError, DownloadError, OSError, ValueError) as err:
            if not isinstance(err, ModelNotFoundError):  # offline: nothing to wait for
                self._download_failed_at = time.monotonic()
            _LOGGER.error(
                "Custom voice(s) %s cannot be used yet: %s. Built-in voices and voices with an "
                "up-to-date NAME%s keep working",
                names,
                err,
                self.cache_suffix,
            )
            return False
        finally:
            self.fetching = False
        self._download_failed_at = None
        _LOGGER.info("Prompt models ready in %.0f s", time.monotonic() - started)
        return True

    def _publish(self, engine: Engine, result: ScanResult) -> None:
        """Swap in a catalog with the scan's good voices and log what changed."""
        catalog = VoiceCatalog(
            list(engine.speakers), [(name, v.language) for name, v in result.voices.items()]
        )
        for name, reason in catalog.skipped.items():
            _LOGGER.warning("Custom voice %r skipped: %s; rename it", name, reason)
        offered = {n: v for n, v in result.voices.items() if n not in catalog.skipped}
        for name, voice in offered.items():
            if name in self._offered and voice.source == "cache":
                continue  # unchanged since the last scan
            shown = describe_custom_voice(name, voice.language)
            _LOGGER.info(
                "Custom voice %r ready: transcript in %s (listed under %s first), "
                "%.1f s recording, prompt %s in %.3f s",
                name,
                voice.language,
                shown.languages[0],
                voice.duration_s,
                "extracted" if voice.source == "extracted" else f"from {name}{self.cache_suffix}",
                voice.load_seconds,
            )
            if voice.instruct and engine.instruction_form is not None:
                _LOGGER.info(
                    "Custom voice %r speaks with its instruction: %s", name, voice.instruct
                )
        for name in sorted(self._offered - offered.keys()):
            _LOGGER.info("Custom voice %r is no longer offered", name)
        self._offered = set(offered)
        self.rejected = {**result.rejected, **catalog.skipped}
        self.scheduler.catalog = catalog
        _LOGGER.info(
            "Custom voices offered: %s%s",
            ", ".join(offered) or "none",
            f" ({len(result.rejected) + len(catalog.skipped)} skipped, see above)"
            if result.rejected or catalog.skipped
            else "",
        )
