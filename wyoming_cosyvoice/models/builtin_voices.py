"""Voices out of the box for CosyVoice2: v1-SFT's speakers, made once into a folder.

CosyVoice2 has no built-in speakers: it speaks in the voice of a prompt recording. So that a
fresh install offers voices without recording anything, the server keeps a folder of prompt
voices made from CosyVoice-300M-SFT's seven speakers (:mod:`engine.cosyvoice2.builtin_voices`:
one sentence each, spoken by the v1 engine, extracted as v2 prompts) under the download
directory, and offers them as the v2 engine's built-in speakers under the names users know
(``zh-female``, ...).

The first start with CosyVoice2 finds the folder unfinished: it finds or downloads
CosyVoice-300M-SFT and the v2 prompt models, makes the voices (logged one by one) and frees the
v1 model before the v2 model loads, so the two never share the memory. All of it runs inside the
engine load, on the engine thread: the event loop keeps answering ``describe`` meanwhile. An
interrupted start goes on where it stopped (voices already made are kept); later starts read the
folder's caches in milliseconds. Offline without the v1 model, a log line says how to get
voices; the server still runs (a voices folder works).
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path

from engine.api import Engine, TakesVoices
from engine.core.types import SynthesisOptions
from engine.family import Family
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.models.download import (
    DownloadError,
    ModelNotFoundError,
    ensure_extra_files,
    ensure_model,
)

_LOGGER = logging.getLogger(__name__)

# Written once every speaker was tried: the folder is finished (a dot file: no voice).
FINISHED_MARK = ".finished"
# How the source model says each sentence: its own defaults (the real model ends each sentence
# by itself).
SPEAKING_OPTIONS = SynthesisOptions()


def builtin_voices_dir(config: ServerConfig, family: Family) -> Path | None:
    """Under the download directory, named for what it holds
    (``CosyVoice2-voices-from-CosyVoice-300M-SFT``); None for a family whose models ship
    their speakers."""
    if family.voices_from is None:
        return None
    return config.effective_download_dir / f"{family.label}-voices-from-{family.voices_from}"


def cached_voice_names(folder: Path | None, family: Family) -> list[str]:
    """Names of the folder's voices with a prompt cache of ``family``'s, without torch."""
    if folder is None or not folder.is_dir():
        return []
    suffix = family.prompt_cache_suffix
    return sorted(p.name[: -len(suffix)] for p in folder.glob(f"*{suffix}"))


def make_missing_voices(
    model_dir: Path, family: Family, config: ServerConfig, *, cache_dir: Path | None = None
) -> None:
    """Make the built-in voices for ``model_dir`` (of ``family``, whose models ship no
    speakers) unless the folder is finished; never raises for voices that cannot be had, it
    logs why. Runs before that model loads, so the source model is gone before this one takes
    its memory. ``cache_dir``: where the source model's prepared files go when its directory
    cannot be written."""
    folder = builtin_voices_dir(config, family)
    if folder is None or family.voices_from is None or (folder / FINISHED_MARK).is_file():
        return
    try:
        _make_voices(model_dir, family, family.voices_from, config, folder, cache_dir)
    except (ModelNotFoundError, DownloadError, OSError) as err:
        _LOGGER.warning(
            "No built-in voices for %s: %s\nTo get them, allow the download of %s (no "
            "--offline, network access) or put that model in a data dir; or give the "
            "server your own voices with --voices-dir (NAME.wav + NAME.txt, see "
            "docs/custom-voices.md)",
            model_dir.name,
            err,
            family.voices_from,
        )


def _make_voices(
    model_dir: Path,
    family: Family,
    source_model: str,
    config: ServerConfig,
    folder: Path,
    cache_dir: Path | None,
) -> None:
    from engine.core.runtime import give_back_free_heap
    from engine.family import load_engine

    maker = family.engine_class()
    if not issubclass(maker, TakesVoices):
        raise TypeError(f"{family.label}'s engine takes no made voices")
    offline, endpoint = config.offline, config.hub_endpoint
    source_dir = ensure_model(
        source_model,
        config.data_dirs,
        config.effective_download_dir,
        offline=offline,
        endpoint=endpoint,
    )
    ensure_extra_files(model_dir, family.base_model, offline=offline, endpoint=endpoint)
    _LOGGER.info(
        "Making %s's built-in voices from %s's speakers into %s (once)",
        family.label,
        source_model,
        folder,
    )
    start = time.monotonic()
    source: Engine = load_engine(
        source_dir,
        threads=config.load.threads,
        lm_int8=_voice_making_lm(config) == "int8",
        cache_dir=cache_dir,
    )
    try:
        maker.make_voices(source, model_dir, folder, SPEAKING_OPTIONS, _log_speaker)
    finally:
        del source  # the source model is needed no more: give its memory back
        gc.collect()
        give_back_free_heap()
    (folder / FINISHED_MARK).write_text(f"every speaker of {source_model} was tried\n")
    _LOGGER.info("Built-in voices made in %.0f s", time.monotonic() - start)


def _voice_making_lm(config: ServerConfig) -> str:
    """The source model's LM format: the exact profiles' int8 (fp32 when the server runs fp32
    throughout), whatever the server's own profile: the voices are made once and kept, so they
    do not depend on the profile of the start that made them."""
    return "fp32" if config.lm_weights == "fp32" else "int8"


def _log_speaker(number: int, count: int, speaker: str) -> None:
    _LOGGER.info("Built-in voice %d of %d: %s", number, count, speaker)


def add_builtin_voices(engine: Engine, family: Family, config: ServerConfig) -> list[str]:
    """Offer the built-in voices folder's voices as ``engine``'s speakers (an engine that
    takes voices); the names added."""
    folder = builtin_voices_dir(config, family)
    if folder is None or not cached_voice_names(folder, family):
        return []
    if not isinstance(engine, TakesVoices):
        raise TypeError(f"the {engine.kind} engine takes no made voices")
    result = engine.add_voices_from(folder)
    for name, reason in result.rejected.items():
        _LOGGER.warning("Built-in voice %r not offered: %s", name, reason)
    _LOGGER.info("Built-in voices from %s: %s", folder, ", ".join(result.voices) or "none")
    return list(result.voices)
