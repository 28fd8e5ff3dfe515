"""The model: where its files are (found or downloaded), how the engine loads, its speakers.

The server, its HTTP API and the ``synthesize`` command all load the model through here, with
the load-time settings of :class:`~wyoming_cosyvoice.config.LoadSettings`.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.api import Engine
from wyoming_cosyvoice.auto.profile import AutoProfile
from wyoming_cosyvoice.auto.stage_costs import CostMeter, free_cores_now
from wyoming_cosyvoice.config import ServerConfig, WeightFormats
from wyoming_cosyvoice.pipeline.repeat_cache import RepeatCache
from wyoming_cosyvoice.pipeline.scheduler import EngineFactory, Scheduler
from wyoming_cosyvoice.voices.loudness import LEVELS_DIR, LevelStore, VoiceLevels

if TYPE_CHECKING:
    from engine.family import Family

_LOGGER = logging.getLogger(__name__)


def resolve_model_dir(config: ServerConfig) -> Path:
    """--model-dir as given (checked), else found in the data dirs or downloaded; with the
    RL-tuned LM when the settings ask for it (:mod:`~wyoming_cosyvoice.models.rl_lm`)."""
    from wyoming_cosyvoice.models.rl_lm import ensure_rl_lm

    model_dir = _model_dir(config)
    ensure_rl_lm(config, model_dir, family_at(model_dir))
    return model_dir


def _model_dir(config: ServerConfig) -> Path:
    from engine.core.types import ModelLoadError
    from engine.family import model_family
    from wyoming_cosyvoice.models.download import ModelNotFoundError, ensure_model, missing_files

    if config.model_dir is not None:
        if not config.model_dir.is_dir():
            raise ModelNotFoundError(f"--model-dir {config.model_dir} is not a directory")
        try:
            family = model_family(config.model_dir)
        except ModelLoadError as err:
            raise ModelNotFoundError(f"--model-dir {err}") from err
        absent = missing_files(config.model_dir, family.model_files)
        if absent:
            raise ModelNotFoundError(
                f"--model-dir {config.model_dir} is missing or has empty: {', '.join(absent)}"
            )
        return config.model_dir
    return ensure_model(
        config.model,
        config.data_dirs,
        config.effective_download_dir,
        offline=config.offline,
        endpoint=config.hub_endpoint,
    )


def load_cosyvoice(
    model_dir: Path,
    threads: int | None,
    lm_int8: bool = True,
    cache_dir: Path | None = None,
    flow_int8: bool = False,
    hift_bf16: bool = False,
    extra_formats: tuple[str, ...] = (),
    lm_int4: bool = False,
    flow_bf16: bool = False,
    hift_int8: bool = False,
    rl_lm: bool = False,
) -> Engine:
    """The engine of the directory's model family; imported here so torch loads on the engine
    thread, not at startup. ``rl_lm``: its RL-tuned LM, for a family that has one."""
    from engine.family import load_engine

    # only a family with an RL-tuned LM takes the option (models.rl_lm)
    own = {"rl_lm": True} if rl_lm and family_at(model_dir).rl_lm_file is not None else {}
    if own:
        _LOGGER.info("Loading the RL-tuned LM (%s)", family_at(model_dir).rl_lm_file)

    engine: Engine = load_engine(
        model_dir,
        threads=threads,
        lm_int8=lm_int8,
        lm_int4=lm_int4,
        flow_int8=flow_int8,
        flow_bf16=flow_bf16,
        hift_bf16=hift_bf16,
        hift_int8=hift_int8,
        cache_dir=cache_dir,
        extra_formats=extra_formats,
        **own,
    )
    return engine


def family_at(model_dir: Path) -> Family:
    """The directory's model family, read without torch.

    A directory of no known family counts as the first family's here: its load reports what is
    wrong.
    """
    from engine.core.types import ModelLoadError
    from engine.family import FAMILIES, model_family

    try:
        return model_family(model_dir)
    except ModelLoadError:
        return FAMILIES[0]


def model_sample_rate(model_dir: Path) -> int:
    """The rate the directory's model speaks at, known before the engine loads."""
    return family_at(model_dir).sample_rate


def model_instruction_form(model_dir: Path) -> str | None:
    """How the directory's model reads an instruction (engine.api; None: it takes none), known
    before the engine loads."""
    family = family_at(model_dir)
    return family.instruction_form_of(family.kind_of(model_dir))


def engine_cache_dir(config: ServerConfig) -> Path | None:
    """``<download dir>/.cache`` (persistent /data in the add-on) if that dir exists: where the
    engine keeps the prepared weights of a model directory it cannot write.

    None (the engine's default cache) otherwise: a cache must not create a data dir of its own.
    """
    data = config.effective_download_dir
    return data / ".cache" if data.is_dir() else None


def engine_loader(config: ServerConfig) -> EngineFactory:
    """The real loader with the config's load-time weight formats (the LM's, the flow's and
    HiFT's: the server profile's, ``auto``: those of every profile it chooses from) and cache
    directory; a model without built-in speakers (CosyVoice2) gets the built-in voices
    folder's voices."""
    return partial(load_with_voices, config=config, **load_options(config))


def load_options(config: ServerConfig) -> dict[str, Any]:
    """:func:`load_cosyvoice`'s keywords for the config: its weight formats, cache and LM."""
    return {
        **weight_options(config.load.weights),
        "cache_dir": engine_cache_dir(config),
        "rl_lm": config.rl_tuned_lm,
    }


def weight_options(weights: WeightFormats) -> dict[str, Any]:
    """The engine loader's keywords for ``weights``: the primary formats as flags, the others
    as extras ("llm.int4", "flow.int8", ...)."""
    return {
        "lm_int8": weights.lm == "int8",
        "lm_int4": weights.lm == "int4",
        "flow_int8": weights.flow == "int8",
        "flow_bf16": weights.flow == "bf16",
        "hift_bf16": weights.hift == "bf16",
        "hift_int8": weights.hift == "int8",
        "extra_formats": weights.extra,
    }


def load_with_voices(
    model_dir: Path, threads: int | None, *, config: ServerConfig, **load_options: Any
) -> Engine:
    """:func:`load_cosyvoice`; for a family whose models ship no speakers (CosyVoice2) with the
    built-in voices folder's voices (made first, before the model takes its memory, when the
    folder has none)."""
    family = family_at(model_dir)
    if family.voices_from is None:
        return load_cosyvoice(model_dir, threads, **load_options)
    from wyoming_cosyvoice.models.builtin_voices import add_builtin_voices, make_missing_voices

    make_missing_voices(model_dir, family, config, cache_dir=engine_cache_dir(config))
    engine = load_cosyvoice(model_dir, threads, **load_options)
    add_builtin_voices(engine, family, config)
    return engine


def scheduler_for_config(
    config: ServerConfig, model_dir: Path, engine_factory: EngineFactory = load_cosyvoice
) -> Scheduler:
    """The scheduler every front end uses: the config's load-time settings and engine loader.

    ``engine_factory`` other than the real loader (a test fake) is used as given.
    """
    if engine_factory is load_cosyvoice:
        engine_factory = engine_loader(config)
    # Sentences share the cores (every core for one alone, one thread each side by side)
    # unless the user set a thread count: on every core each, two sentences oversubscribe the
    # cores and make less audio per second together than one thread each.
    load = config.load
    shared_cores = load.threads is None and load.parallel_sentences > 1
    return Scheduler(
        model_dir,
        engine_factory=engine_factory,
        threads=load.threads,
        warmup=load.warmup,
        speakers_hint=speakers_before_load(config, model_dir),
        parallel=load.parallel_sentences,
        shared_cores=shared_cores,
        sample_rate=model_sample_rate(model_dir),
        instruction_form=model_instruction_form(model_dir),
        prime_options=[
            profile.options(speaker=None, seed=None, instruct=None, force_tokens=None)
            for profile in config.auto_candidates or [config.profile]
        ],
        repeat_cache=RepeatCache(config.cache.max_bytes),
        levels=voice_levels(config, model_dir),
        auto=auto_profile(config),
        pronunciations=config.pronunciations,
    )


def auto_profile(config: ServerConfig) -> AutoProfile | None:
    """The server's ``auto`` profile (None when it runs a fixed one); its costs are measured
    with the threads a sentence gets."""
    if config.auto is None or not config.auto_candidates:
        return None
    meter = CostMeter(partial(free_cores_now, config.threads))
    return AutoProfile(config.auto, config.auto_candidates, meter)


def voice_levels(config: ServerConfig, model_dir: Path) -> VoiceLevels:
    """Loudness per voice at the config's target and volume; recordings are looked up in the
    custom voices folder and the folder of built-in voices made from recordings (CosyVoice2).
    What is learnt is kept per model in ``<download dir>/voice-levels/`` if that dir exists (a
    state file must not create a data dir of its own)."""
    from wyoming_cosyvoice.models.builtin_voices import builtin_voices_dir

    folders = (config.voices_dir, builtin_voices_dir(config, family_at(model_dir)))
    data = config.effective_download_dir
    store = LevelStore(data / LEVELS_DIR / f"{model_dir.name}.json") if data.is_dir() else None
    return VoiceLevels(config.loudness, config.volume, folders, store)


def speakers_before_load(config: ServerConfig, model_dir: Path) -> list[str] | None:
    """The voices ``describe`` lists while the model loads: v1's speaker table, the built-in
    voices already made of a family whose models ship none (CosyVoice2)."""
    family = family_at(model_dir)
    if family.voices_from is not None:
        from wyoming_cosyvoice.models.builtin_voices import builtin_voices_dir, cached_voice_names

        return cached_voice_names(builtin_voices_dir(config, family), family) or None
    return peek_speakers(model_dir)


# --- speaker names without torch ------------------------------------------------------------


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _NamesOnlyUnpickler(pickle.Unpickler):
    """Reads the dict keys of a torch checkpoint; every tensor becomes an inert stub."""

    _ALLOWED = {("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module.startswith("torch"):
            return _Stub  # never import or call anything from the file
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> None:
        return None


def peek_speakers(model_dir: Path) -> list[str] | None:
    """Speaker names from ``spk2info.pt`` in milliseconds, before torch is even imported.

    Lets ``describe`` list the right voices while the model is still loading. ``None`` if the
    file is missing or unreadable (the engine's own list is used once it has loaded).
    """
    path = model_dir / "spk2info.pt"
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            with archive.open(pkl) as f:
                table = _NamesOnlyUnpickler(f).load()
    except Exception as err:  # a hint only; never fatal
        _LOGGER.debug("Could not read speaker names from %s: %s", path, err)
        return None
    if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
        return None
    return list(table)
