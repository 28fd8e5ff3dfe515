"""Server settings: ``settings.yaml`` read into frozen dataclasses.

``settings.yaml`` ships inside the package (the repository's root ``config.yaml`` is a link to
it), so an installed server reads the same file as a checkout: it is the only home of every
default value, none is repeated here. Values come from three layers, later ones winning: that
file, an optional ``--config`` file, and command-line overrides given as dotted keys. Every value
is checked once here; a bad one raises :class:`ConfigError` naming the key, which the CLI turns
into an exit message.

A profile's settings apply at three moments, kept apart in the types: its weight formats when
the model loads (:class:`LoadSettings`, from the server's own profile only), ``streaming`` in the
Wyoming ``describe`` answer, and the rest per request (:meth:`ProfileConfig.options`). A request
may name another profile only if the loaded weights are the ones it needs
(:meth:`ProfileConfig.unservable_by`).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from engine.core.solver import SOLVERS
from engine.core.start_policy import START_POLICIES
from engine.core.types import (
    LOW_LATENCY_SCHEDULE,
    MAX_SPEED,
    MIN_SPEED,
    OFFICIAL_SCHEDULE,
    StreamSchedule,
    SynthesisOptions,
)
from wyoming_cosyvoice.voices.presets import SPEEDS, STYLES, is_preset_name

SETTINGS_FILE = "settings.yaml"  # in this package: the defaults every other layer overrides
LM_WEIGHTS = ("int8", "int4", "fp32")
# server.lm_weights: each profile's own LM format, or one of LM_WEIGHTS for every profile.
LM_OWN = "profile"
FLOW_WEIGHTS = ("fp32", "int8", "bf16")
HIFT_WEIGHTS = ("fp32", "bf16", "int8")
TARGET_RANGE = (-40.0, -6.0)  # LUFS the server's loudness may aim at (server.loudness)
# factor on the target level (server.volume, a request's volume): −20 dB … +6 dB
VOLUME_RANGE = (0.1, 2.0)

_NAMED_SCHEDULES = {"low_latency": LOW_LATENCY_SCHEDULE, "official": OFFICIAL_SCHEDULE}


def packaged_settings() -> dict[str, Any]:
    """The package's ``settings.yaml``, parsed (every default value, nothing else)."""
    text = (resources.files("wyoming_cosyvoice") / SETTINGS_FILE).read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    assert isinstance(raw, dict), SETTINGS_FILE
    return raw


class ConfigError(ValueError):
    """An invalid config file or value; the message names the offending key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key '{key}': {problem}")
        self.key = key
        self.problem = problem


@dataclass(frozen=True)
class WeightFormats:
    """The formats the model's weights are loaded in: fixed for the life of the process."""

    lm: str  # int8, int4 or fp32 (the server profile's lm_weights)
    flow: str  # fp32, int8 or bf16 (the server profile's flow_weights)
    hift: str  # fp32, bf16 or int8 (the server profile's hift_weights)
    # Loaded beside those for a request to choose (``auto``): "llm.int4", "flow.int8", ...
    extra: tuple[str, ...] = ()

    def primary(self, part: str) -> str:
        """The format ``part`` ("llm", "flow" or "hift", as the engine names them) loads in."""
        return {"llm": self.lm, "flow": self.flow, "hift": self.hift}[part]

    def holds(self, part: str, weights: str) -> bool:
        """Whether ``part`` ("llm", "flow" or "hift") is loaded in ``weights``."""
        return self.primary(part) == weights or f"{part}.{weights}" in self.extra


# The parts whose weight formats a profile chooses, as a message names them.
PART_NAMES = {"llm": "the LM", "flow": "the flow", "hift": "HiFT"}


def _listed(items: Iterable[str]) -> str:
    """``a, b and c``."""
    *rest, last = items
    return f"{', '.join(rest)} and {last}" if rest else last


# The profile that chooses, per request, among fixed profiles (``auto:`` in settings.yaml).
AUTO_PROFILE = "auto"


@dataclass(frozen=True)
class AutoSettings:
    """How the ``auto`` profile chooses (wyoming_cosyvoice.auto.profile)."""

    first_audio_s: float  # the first audio a request should get within
    profiles: tuple[str, ...]  # what it chooses from, the most exact first
    streaming: bool  # streaming text input, in the Wyoming describe answer


@dataclass(frozen=True)
class LoadSettings:
    """What the model is loaded with, once, before the first request."""

    weights: WeightFormats
    threads: int | None
    parallel_sentences: int
    warmup: bool


@dataclass(frozen=True)
class ProfileConfig:
    """A named set of synthesis settings (``realtime``, ``quality``, ``batch``, ...)."""

    name: str
    # In the Wyoming describe answer (the server's profile).
    streaming: bool
    # Per request: what :meth:`options` hands the engine.
    stream_audio: bool
    schedule: StreamSchedule
    n_timesteps: int
    cfg_rate: float
    start_policy: str
    # At load time (the server's profile): the LM (int8, int4: approximations), the flow
    # (int8: approximation) and HiFT's filter (bf16: approximation) are loaded in these
    # formats; a request may name another profile only if its formats are loaded too.
    lm_weights: str
    flow_weights: str
    hift_weights: str
    # Per request: the flow ODE's solver (euler: the official maths).
    solver: str

    def options(
        self,
        *,
        speaker: str | None,
        seed: int | None,
        instruct: str | None,
        force_tokens: int | None,
    ) -> SynthesisOptions:
        """The engine options of one request under this profile."""
        return SynthesisOptions(
            speaker=speaker,
            stream=self.stream_audio,
            schedule=self.schedule,
            seed=seed,
            n_timesteps=self.n_timesteps,
            cfg_rate=self.cfg_rate,
            solver=self.solver,
            instruct=instruct,
            force_tokens=force_tokens,
            start_policy=self.start_policy,
            lm_weights=self.lm_weights,
            flow_weights=self.flow_weights,
            hift_weights=self.hift_weights,
        )

    def weight_formats(self) -> dict[str, str]:
        """The format each part runs in under this profile, by the engine's part names."""
        return {"llm": self.lm_weights, "flow": self.flow_weights, "hift": self.hift_weights}

    def unservable_by(self, loaded: WeightFormats, server_profile: str) -> str | None:
        """Why a server whose weights are ``loaded`` cannot speak this profile, or None.

        Its per-request settings alone on other weights would be neither this profile nor the
        server's, and nothing would tell the client: refused, with what to change.
        """
        wanted = self.weight_formats()
        if all(loaded.holds(part, weights) for part, weights in wanted.items()):
            return None
        needs = _listed(f"{PART_NAMES[part]} in {fmt}" for part, fmt in wanted.items())
        runs = _listed(f"{PART_NAMES[part]} in {loaded.primary(part)}" for part in wanted)
        return (
            f"profile {self.name!r} needs {needs}; this server loaded {runs} for its profile "
            f"{server_profile!r}: start it with --profile {self.name} to use {self.name!r}"
        )


@dataclass(frozen=True)
class Limits:
    """Per-connection and per-request bounds; see settings.yaml for their meaning."""

    max_text_chars: int
    max_header_bytes: int
    max_data_bytes: int
    max_payload_bytes: int
    max_events_per_connection: int
    max_connections: int
    idle_timeout_s: float
    max_buffered_audio_s: float
    stall_timeout_s: float
    load_wait_s: float

    @property
    def max_text_bytes(self) -> int:
        """Room for a text of ``max_text_chars`` in a JSON data block or body, even when every
        character is sent as a \\uXXXX escape (so the text limit, not a size limit, decides)."""
        return max(self.max_data_bytes, 6 * self.max_text_chars + 4096)


@dataclass(frozen=True)
class CacheConfig:
    """The repeat cache of recently spoken sentences; see settings.yaml."""

    max_mb: float  # 0 = off
    prepare_phrases: tuple[str, ...]

    @property
    def max_bytes(self) -> int:
        return int(self.max_mb * 1024 * 1024)


@dataclass(frozen=True)
class ServerConfig:
    """Every setting, checked. The fields named like a key of settings.yaml's ``server:`` hold
    that key; their default is in settings.yaml only. A plain ``bool``/``str``/``int``/``float``
    field (numbers: positive) or one of ``str | None``/``int | None``/``Path | None`` is checked
    by its type alone (``_server_kinds``), so a new setting of such a type needs no other line
    here."""

    uri: str
    model: str
    model_dir: Path | None
    data_dirs: tuple[Path, ...]
    download_dir: Path | None
    voices_dir: Path | None
    voices_rescan_s: float
    stt_uri: str | None  # Wyoming speech-to-text for new voices' transcripts
    web_voice_maker: bool  # the web page may save new voices into voices_dir
    voice: str | None
    profile: ProfileConfig
    lm_weights: str  # "profile" (each profile's own) or the one LM format of every profile
    rl_tuned_lm: bool  # CosyVoice3: its RL-tuned LM (llm.rl.pt) in place of llm.pt
    threads: int | None  # None: every core (settings.yaml's 0)
    parallel_sentences: int
    samples_per_chunk: int
    loudness: float | None  # LUFS every voice is brought to; None = as the model makes it
    volume: float  # a factor on that level
    speed: float  # speaking speed of a request that asks for none
    preset_voices: tuple[str, ...]  # presets every voice is also listed at (describe)
    early_speech: bool  # speak a streamed sentence while it arrives (engines that can)
    pronunciations: tuple[str, ...]  # "word = entry" lines, read by the engine
    zeroconf: str | None
    seed: int | None
    warmup: bool
    hub_endpoint: str | None
    offline: bool
    debug: bool
    log_format: str
    # The other sections of settings.yaml.
    limits: Limits
    profiles: dict[str, ProfileConfig]
    cache: CacheConfig
    auto: AutoSettings  # the auto: section (the auto profile's choice)
    # Benchmarks and tests only, set in code by their launchers (wyoming_cosyvoice.bench.server),
    # never by a user: speech tokens per sentence, so that a random-weight model, which never
    # ends an utterance by itself, gives fixed-length audio.
    force_tokens: int | None = None

    @property
    def effective_download_dir(self) -> Path:
        """Where a missing model is downloaded: --download-dir, else the first data dir."""
        return self.download_dir or self.data_dirs[0]

    @property
    def load(self) -> LoadSettings:
        """The load-time settings: the server's own profile chooses the LM, flow and HiFT
        formats (``auto``: those of every profile it chooses from, its most exact one's
        primary)."""
        own = self.profile
        primary = own.weight_formats()
        extra = {
            f"{part}.{weights}"
            for candidate in self.auto_candidates
            for part, weights in candidate.weight_formats().items()
            if weights != primary[part]
        }
        weights = WeightFormats(
            lm=own.lm_weights,
            flow=own.flow_weights,
            hift=own.hift_weights,
            extra=tuple(sorted(extra)),
        )
        return LoadSettings(weights, self.threads, self.parallel_sentences, self.warmup)

    @property
    def auto_candidates(self) -> list[ProfileConfig]:
        """What the server's ``auto`` profile chooses from, the most exact first (none when the
        server runs a fixed profile)."""
        if self.profile.name != AUTO_PROFILE:
            return []
        return [self.profiles[name] for name in self.auto.profiles]

    def request_profile(self, name: str | None) -> ProfileConfig:
        """The profile a request names (None: the server's), if this server can speak it.

        Raises :class:`UnknownProfileError` or :class:`ProfileNotLoadedError`.
        """
        if name is None or name == self.profile.name:
            return self.profile
        if name == AUTO_PROFILE:
            raise ProfileNotLoadedError(
                f"profile {AUTO_PROFILE!r} chooses per request among the profiles whose weights "
                f"the server loaded for it: start it with --profile {AUTO_PROFILE} to use it"
            )
        if name not in self.profiles:
            raise UnknownProfileError(
                f"unknown profile {name!r}; known: {', '.join(self.profiles)}"
            )
        profile = self.profiles[name]
        if problem := profile.unservable_by(self.load.weights, self.profile.name):
            raise ProfileNotLoadedError(problem)
        return profile

    @property
    def servable_profiles(self) -> list[str]:
        """The profiles a request may name: those whose weight formats are loaded."""
        loaded, own = self.load.weights, self.profile.name
        servable = [n for n, p in self.profiles.items() if p.unservable_by(loaded, own) is None]
        return [AUTO_PROFILE, *servable] if own == AUTO_PROFILE else servable


class UnknownProfileError(ValueError):
    """A request names a profile the settings do not have."""


class ProfileNotLoadedError(ValueError):
    """A request names a profile whose weight formats this server did not load."""


# --- reading and merging --------------------------------------------------------------------


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a YAML config file into a mapping (no validation yet)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError("--config", f"cannot read {path}: {err.strerror or err}") from err
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError("--config", f"{path} is not valid YAML: {err}") from err
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError("<top level>", f"{path} must hold a mapping, not {type(raw).__name__}")
    return raw


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``override`` into a copy of ``base`` (mappings merge, other values replace)."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested mapping, creating mappings on the way."""
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(key, "empty component in dotted key")
    node = raw
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), "is not a section")
        node = child
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` from ``--set``; the value is a YAML scalar (``20``, ``true``, ``null``)."""
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(item, "--set expects KEY=VALUE")
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(key.strip(), f"value {text!r} is not valid YAML: {err}") from err
    return key.strip(), value


def load_config(
    path: Path | None = None, overrides: Iterable[tuple[str, Any]] = ()
) -> ServerConfig:
    """The package's settings.yaml ← the file at ``path`` (if any) ← ``overrides``."""
    raw = packaged_settings()
    if path is not None:
        raw = merge(raw, read_config_file(path))
    for key, value in overrides:
        set_dotted(raw, key, value)
    return build_config(raw)


# --- validation -----------------------------------------------------------------------------


def _check(key: str, value: Any, kind: str) -> Any:
    """Validate one scalar: kinds are bool, int+ (positive), int, float+, str, str?, int?, path?."""
    optional = kind.endswith("?")
    base = kind.rstrip("?")
    if value is None:
        if optional:
            return None
        raise ConfigError(key, "must not be empty")
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, not {value!r}")
        return value
    if base in ("int", "int+"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, not {value!r}")
        if base == "int+" and value <= 0:
            raise ConfigError(key, f"must be a positive integer, not {value!r}")
        return value
    if base == "float+":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(key, f"must be a positive number, not {value!r}")
        return float(value)
    if base in ("str", "path"):
        if not isinstance(value, str) or not value.strip():
            raise ConfigError(key, f"must be a non-empty string, not {value!r}")
        return Path(value).expanduser() if base == "path" else value
    raise AssertionError(kind)


def _section(raw: dict[str, Any], name: str, allowed: Iterable[str]) -> dict[str, Any]:
    section = raw.get(name, {})
    if not isinstance(section, dict):
        raise ConfigError(name, "must be a mapping")
    for key in section:
        if key not in allowed:
            raise ConfigError(f"{name}.{key}", f"unknown key (known: {', '.join(allowed)})")
    return section


# How a plain server setting is checked, by the type of its ServerConfig field.
_KIND_OF_TYPE = {
    "bool": "bool",
    "int": "int+",
    "float": "float+",
    "str": "str",
    "str | None": "str?",
    "int | None": "int?",
    "Path | None": "path?",
}
# ServerConfig fields that are not server settings: the other sections and force_tokens.
_NOT_SERVER_SETTINGS = ("limits", "profiles", "cache", "auto", "force_tokens")
# Server settings with a check of their own in build_config.
_CHECKED_APART = ("profile", "data_dirs", "threads", "loudness", "volume", "preset_voices",
                  "pronunciations")  # fmt: skip


def _server_kinds() -> dict[str, str]:
    """The plain server settings and their kinds (``_check``), from ServerConfig's fields."""
    skipped = (*_NOT_SERVER_SETTINGS, *_CHECKED_APART)
    kinds = {f.name: _KIND_OF_TYPE.get(str(f.type)) for f in fields(ServerConfig)}
    if untyped := [name for name, kind in kinds.items() if kind is None and name not in skipped]:
        raise AssertionError(f"ServerConfig fields with no check: {untyped}")
    return {name: kind for name, kind in kinds.items() if kind and name not in skipped}


_SERVER_KINDS = _server_kinds()
_SECTIONS = ("server", "profiles", "limits", "cache", AUTO_PROFILE)
_SCHEDULE_KINDS = {
    "first_hop": "int+",
    "growth": "float+",
    "max_hop": "int+",
    "overlap": "int",
    "paced": "bool",
}


def _schedule(key: str, value: Any) -> StreamSchedule:
    if isinstance(value, str):
        if value not in _NAMED_SCHEDULES:
            raise ConfigError(
                key, f"unknown schedule {value!r} (known: {', '.join(_NAMED_SCHEDULES)})"
            )
        return _NAMED_SCHEDULES[value]
    if not isinstance(value, dict):
        raise ConfigError(key, "must be a schedule name or a mapping")
    base = _NAMED_SCHEDULES.get(value.get("name", "low_latency"), LOW_LATENCY_SCHEDULE)
    fields: dict[str, Any] = {}
    for sub, sub_value in value.items():
        if sub == "name":
            fields["name"] = _check(f"{key}.name", sub_value, "str")
        elif sub in _SCHEDULE_KINDS:
            fields[sub] = _check(f"{key}.{sub}", sub_value, _SCHEDULE_KINDS[sub])
        else:
            raise ConfigError(
                f"{key}.{sub}", f"unknown key (known: name, {', '.join(_SCHEDULE_KINDS)})"
            )
    schedule = replace(base, **fields)
    if schedule.overlap < 0:
        raise ConfigError(f"{key}.overlap", "must not be negative")
    if schedule.max_hop < schedule.first_hop:
        raise ConfigError(f"{key}.max_hop", "must be at least first_hop")
    return schedule


_PROFILE_KEYS = tuple(f.name for f in fields(ProfileConfig) if f.name != "name")


def _profile(name: str, raw: Any) -> ProfileConfig:
    key = f"profiles.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(key, "must be a mapping")
    for sub in raw:
        if sub not in _PROFILE_KEYS:
            raise ConfigError(f"{key}.{sub}", f"unknown key (known: {', '.join(_PROFILE_KEYS)})")
    if missing := [sub for sub in _PROFILE_KEYS if sub not in raw]:
        raise ConfigError(
            key, f"a profile names every setting; missing: {', '.join(missing)} (copy one "
            "from config.yaml and change what you need)"
        )  # fmt: skip
    cfg_rate = raw["cfg_rate"]
    if isinstance(cfg_rate, bool) or not isinstance(cfg_rate, (int, float)) or cfg_rate < 0:
        raise ConfigError(f"{key}.cfg_rate", f"must be a number >= 0, not {cfg_rate!r}")
    return ProfileConfig(
        name=name,
        streaming=_check(f"{key}.streaming", raw["streaming"], "bool"),
        stream_audio=_check(f"{key}.stream_audio", raw["stream_audio"], "bool"),
        schedule=_schedule(f"{key}.schedule", raw["schedule"]),
        n_timesteps=_check(f"{key}.n_timesteps", raw["n_timesteps"], "int+"),
        cfg_rate=float(cfg_rate),
        start_policy=_one_of(f"{key}.start_policy", raw["start_policy"], START_POLICIES),
        lm_weights=_one_of(f"{key}.lm_weights", raw["lm_weights"], LM_WEIGHTS),
        flow_weights=_one_of(f"{key}.flow_weights", raw["flow_weights"], FLOW_WEIGHTS),
        hift_weights=_one_of(f"{key}.hift_weights", raw["hift_weights"], HIFT_WEIGHTS),
        solver=_one_of(f"{key}.solver", raw["solver"], tuple(SOLVERS)),
    )


def _with_lm_weights(
    profiles: dict[str, ProfileConfig], lm_weights: str
) -> dict[str, ProfileConfig]:
    """The profiles as they run: with ``server.lm_weights`` other than ``profile``, every
    one's LM in that format."""
    if lm_weights == LM_OWN:
        return profiles
    return {name: replace(p, lm_weights=lm_weights) for name, p in profiles.items()}


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(key, f"must be one of {', '.join(allowed)}, not {value!r}")
    return str(value)


def _limits(raw: dict[str, Any]) -> Limits:
    names = [f.name for f in fields(Limits)]
    section = _section(raw, "limits", names)
    values: dict[str, Any] = {}
    for key in names:
        kind = "float+" if key.endswith("_s") else "int+"
        values[key] = _check(f"limits.{key}", section.get(key), kind)
    return Limits(**values)


def _cache(raw: dict[str, Any]) -> CacheConfig:
    section = _section(raw, "cache", [f.name for f in fields(CacheConfig)])
    max_mb = section.get("max_mb")
    if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or max_mb < 0:
        raise ConfigError("cache.max_mb", f"must be a number >= 0 (0 = off), not {max_mb!r}")
    phrases = section.get("prepare_phrases") or []
    if isinstance(phrases, str):
        phrases = [phrases]
    if not isinstance(phrases, list):
        raise ConfigError("cache.prepare_phrases", "must be a list of texts")
    texts = tuple(_check(f"cache.prepare_phrases[{i}]", p, "str") for i, p in enumerate(phrases))
    return CacheConfig(max_mb=float(max_mb), prepare_phrases=texts)


def _number_in(key: str, value: Any, bounds: tuple[float, float], unit: str = "") -> Any:
    """A number within ``bounds``; with a ``unit`` (a level), null too."""
    if value is None and unit:
        return None
    low, high = bounds
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        allowed = f"{low:g} to {high:g} {unit} or null" if unit else f"{low:g} to {high:g}"
        raise ConfigError(key, f"must be a number from {allowed}, not {value!r}")
    return float(value)


def _auto(raw: dict[str, Any], profiles: dict[str, ProfileConfig]) -> AutoSettings:
    section = _section(raw, AUTO_PROFILE, [f.name for f in fields(AutoSettings)])
    names = section.get("profiles")
    if not isinstance(names, list) or not names:
        raise ConfigError("auto.profiles", "must be a non-empty list of profile names")
    for name in names:
        if name not in profiles:
            raise ConfigError(
                "auto.profiles", f"unknown profile {name!r} (known: {', '.join(profiles)})"
            )
    return AutoSettings(
        first_audio_s=_check("auto.first_audio_s", section.get("first_audio_s"), "float+"),
        profiles=tuple(str(name) for name in names),
        streaming=_check("auto.streaming", section.get("streaming"), "bool"),
    )


def _server_profile(
    name: str, profiles: dict[str, ProfileConfig], auto: AutoSettings
) -> ProfileConfig:
    """The server's profile; ``auto`` runs its most exact profile's settings until it has
    chosen, and loads that one's weight formats first."""
    if name == AUTO_PROFILE:
        return replace(profiles[auto.profiles[0]], name=AUTO_PROFILE, streaming=auto.streaming)
    if name not in profiles:
        known = ", ".join([AUTO_PROFILE, *profiles])
        raise ConfigError("server.profile", f"unknown profile {name!r} (known: {known})")
    return profiles[name]


def build_config(raw: dict[str, Any]) -> ServerConfig:
    """Validate a merged raw mapping into a :class:`ServerConfig`."""
    for key in raw:
        if key not in _SECTIONS:
            raise ConfigError(key, f"unknown section (known: {', '.join(_SECTIONS)})")
    server = _section(raw, "server", [*_SERVER_KINDS, *_CHECKED_APART])
    values = {
        key: _check(f"server.{key}", server.get(key), kind) for key, kind in _SERVER_KINDS.items()
    }
    if not MIN_SPEED <= values["speed"] <= MAX_SPEED:
        raise ConfigError("server.speed", f"must be a number from {MIN_SPEED:g} to "
                          f"{MAX_SPEED:g}, not {values['speed']!r}")  # fmt: skip

    data_dirs = server.get("data_dirs")
    if isinstance(data_dirs, str):
        data_dirs = [data_dirs]
    if not isinstance(data_dirs, list) or not data_dirs:
        raise ConfigError("server.data_dirs", "must be a non-empty list of directories")
    dirs = tuple(_check(f"server.data_dirs[{i}]", d, "path") for i, d in enumerate(data_dirs))

    profiles_raw = raw.get("profiles", {})
    if not isinstance(profiles_raw, dict) or not profiles_raw:
        raise ConfigError("profiles", "must be a non-empty mapping of profile names")
    if AUTO_PROFILE in profiles_raw:
        raise ConfigError(f"profiles.{AUTO_PROFILE}", "is reserved: the auto: section sets it")
    profiles = {str(name): _profile(str(name), prof) for name, prof in profiles_raw.items()}
    lm_weights = _one_of("server.lm_weights", values["lm_weights"], (LM_OWN, *LM_WEIGHTS))
    profiles = _with_lm_weights(profiles, lm_weights)
    auto = _auto(raw, profiles)
    profile_name = _check("server.profile", server.get("profile"), "str")
    profile = _server_profile(profile_name, profiles, auto)

    for key in ("uri", "stt_uri"):
        uri = values[key]
        if uri is not None and not uri.startswith(("tcp://", "unix://")):
            raise ConfigError(f"server.{key}", f"must start with tcp:// or unix://, not {uri!r}")
    if (endpoint := values["hub_endpoint"]) is not None:
        if not endpoint.startswith(("http://", "https://")):
            raise ConfigError("server.hub_endpoint", f"must be an http(s) URL, not {endpoint!r}")
        values["hub_endpoint"] = endpoint.rstrip("/")  # the hub client appends "/<repo>/..."
    return ServerConfig(
        **values,
        data_dirs=dirs,
        profile=profile,
        threads=_threads(server.get("threads")),
        auto=auto,
        limits=_limits(raw),
        profiles=profiles,
        cache=_cache(raw),
        loudness=_number_in("server.loudness", server.get("loudness"), TARGET_RANGE, "LUFS"),
        volume=_number_in("server.volume", server.get("volume"), VOLUME_RANGE),
        preset_voices=_preset_voices(server.get("preset_voices")),
        pronunciations=_pronunciations(server.get("pronunciations")),
    )


def _threads(value: Any) -> int | None:
    """``server.threads``: at most this many threads; 0 = every core (None). ``null``, the
    spelling of "every core" in settings files written before 0 was, still reads as 0."""
    count = _check("server.threads", 0 if value is None else value, "int")
    if count < 0:
        raise ConfigError("server.threads", f"must be 0 (every core) or more, not {count!r}")
    return count or None


def _preset_voices(value: Any) -> tuple[str, ...]:
    """``server.preset_voices``: preset names (speaker_presets), each once."""
    key = "server.preset_voices"
    names = [value] if isinstance(value, str) else value
    if names is None:
        return ()
    if not isinstance(names, list):
        raise ConfigError(key, f"must be a list of presets such as [slow, fast], not {value!r}")
    presets: list[str] = []
    for i, name in enumerate(names):
        if not isinstance(name, str) or not is_preset_name(name):
            raise ConfigError(f"{key}[{i}]", f"{name!r} is not a preset; presets: "
                              f"{', '.join([*SPEEDS, *STYLES])} or a style-speed pair such as "
                              "calm-slow")  # fmt: skip
        if (preset := name.strip().casefold()) not in presets:
            presets.append(preset)
    return tuple(presets)


def _pronunciations(value: Any) -> tuple[str, ...]:
    """``server.pronunciations``: a list of ``word = entry`` lines (the add-on's form) or a
    mapping word → entry, as lines. What an entry says is the engine's to read: one it cannot
    apply is logged at the start, and the rest apply (docs/pronunciations.md)."""
    key = "server.pronunciations"
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]  # one line
    if isinstance(value, dict):
        lines = []
        for word, entry in value.items():
            if not isinstance(entry, str) or not str(word).strip():
                raise ConfigError(f"{key}.{word}", f"must be a word and its pronunciation as "
                                  f"text, e.g. Siobhan: SH IH0 V AO1 N; not {entry!r}")  # fmt: skip
            lines.append(f"{word} = {entry}")
        return tuple(lines)
    if not isinstance(value, list):
        raise ConfigError(key, "must be a list of 'word = pronunciation' lines or a mapping "
                          f"word: pronunciation, not {value!r}")  # fmt: skip
    for i, line in enumerate(value):
        if not isinstance(line, str):
            raise ConfigError(f"{key}[{i}]", f"must be a 'word = pronunciation' line, not {line!r}")
    return tuple(line.strip() for line in value if line.strip())
