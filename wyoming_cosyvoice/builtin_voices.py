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
from typing import Any

from engine.core.types import SynthesisOptions
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.download import (
    FAMILY_MODELS,
    DownloadError,
    ModelNotFoundError,
    ensure_extra_files,
    ensure_model,
)

_LOGGER = logging.getLogger(__name__)

SOURCE_MODEL = "CosyVoice-300M-SFT"  # whose built-in speakers become the voices
# Under the download directory; named for what it holds.
BUILTIN_VOICES_DIR = "CosyVoice2-voices-from-CosyVoice-300M-SFT"
V2_CACHE_SUFFIX = ".cosyvoice2.prompt.pt"  # engine.cosyvoice2.prompt.COSYVOICE2.cache_suffix
# Written once every speaker was tried: the folder is finished (a dot file: no voice).
FINISHED_MARK = ".finished"
# How the v1 model says each sentence: its own defaults (the real model ends each sentence
# by itself).
SPEAKING_OPTIONS = SynthesisOptions()


def builtin_voices_dir(config: ServerConfig) -> Path:
    return config.effective_download_dir / BUILTIN_VOICES_DIR


def cached_voice_names(folder: Path) -> list[str]:
    """Names of the folder's voices with a CosyVoice2 prompt cache, without importing torch."""
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(V2_CACHE_SUFFIX)] for p in folder.glob(f"*{V2_CACHE_SUFFIX}"))


def make_missing_voices(
    model_dir: Path, config: ServerConfig, *, cache_dir: Path | None = None
) -> None:
    """Make the built-in voices for the CosyVoice2 directory ``model_dir`` unless the folder is
    finished; never raises for voices that cannot be had, it logs why. Runs before the v2
    engine loads, so the v1 model is gone before the v2 one takes its memory. ``cache_dir``:
    where the v1 model's prepared files go when its directory cannot be written."""
    folder = builtin_voices_dir(config)
    if (folder / FINISHED_MARK).is_file():
        return
    try:
        _make_voices(model_dir, config, folder, cache_dir)
    except (ModelNotFoundError, DownloadError, OSError) as err:
        _LOGGER.warning(
            "No built-in voices for %s: %s\nTo get them, allow the download of %s (no "
            "--offline, network access) or put that model in a data dir; or give the "
            "server your own voices with --voices-dir (NAME.wav + NAME.txt, see "
            "docs/custom-voices.md)",
            model_dir.name,
            err,
            SOURCE_MODEL,
        )


def _make_voices(
    model_dir: Path, config: ServerConfig, folder: Path, cache_dir: Path | None
) -> None:
    from engine.core.runtime import give_back_free_heap
    from engine.cosyvoice1.engine import CosyVoiceEngine
    from engine.cosyvoice2.builtin_voices import make_builtin_voices
    from engine.cosyvoice2.prompt import prompt_models

    offline, endpoint = config.offline, config.hub_endpoint
    source_dir = ensure_model(
        SOURCE_MODEL,
        config.data_dirs,
        config.effective_download_dir,
        offline=offline,
        endpoint=endpoint,
    )
    ensure_extra_files(model_dir, FAMILY_MODELS["cosyvoice2"], offline=offline, endpoint=endpoint)
    _LOGGER.info(
        "Making CosyVoice2's built-in voices from %s's speakers into %s (once)",
        SOURCE_MODEL,
        folder,
    )
    start = time.monotonic()
    v1 = CosyVoiceEngine.load(
        source_dir,
        threads=config.load.threads,
        lm_int8=config.load.weights.lm == "int8",
        lm_int4=config.load.weights.lm == "int4",
        cache_dir=cache_dir,
    )
    try:
        models = prompt_models(model_dir)
        speakers = list(v1.speakers)
        for number, speaker in enumerate(speakers, 1):
            _LOGGER.info("Built-in voice %d of %d: %s", number, len(speakers), speaker)
            make_builtin_voices(v1, folder, models, speakers=[speaker], options=SPEAKING_OPTIONS)
        models.close()
    finally:
        del v1  # the v1 model is needed no more: give its memory back
        gc.collect()
        give_back_free_heap()
    (folder / FINISHED_MARK).write_text("every speaker of the v1 model was tried\n")
    _LOGGER.info("Built-in voices made in %.0f s", time.monotonic() - start)


def add_builtin_voices(engine: Any, config: ServerConfig) -> list[str]:
    """Offer the built-in voices folder's voices as the CosyVoice2 ``engine``'s speakers; the
    names added."""
    folder = builtin_voices_dir(config)
    if not cached_voice_names(folder):
        return []
    return _add_voices(engine, folder)


def _add_voices(engine: Any, folder: Path) -> list[str]:
    from engine.cosyvoice2.prompt import prompt_models, voice_library

    result = voice_library(folder, prompt_models(engine.model_dir)).scan()
    for name, reason in result.rejected.items():
        _LOGGER.warning("Built-in voice %r not offered: %s", name, reason)
    for voice in result.voices.values():
        engine.add_voice(voice)
    _LOGGER.info("Built-in voices from %s: %s", folder, ", ".join(result.voices) or "none")
    return list(result.voices)
