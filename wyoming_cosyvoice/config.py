"""Server settings: the root ``config.yaml`` read into frozen dataclasses.

Values come from three layers, later ones winning: the built-in ``DEFAULTS`` (identical to the
repository's ``config.yaml``, a test keeps them in sync), the config file, and command-line
overrides given as dotted keys. Every value is checked once here; a bad one raises
:class:`ConfigError` naming the key, which the CLI turns into an exit message.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from engine.start_policy import START_POLICIES
from engine.types import LOW_LATENCY_SCHEDULE, OFFICIAL_SCHEDULE, StreamSchedule, SynthesisOptions

REPO_CONFIG = Path(__file__).resolve().parent.parent / "config.yaml"

_PROFILE_DEFAULTS: dict[str, Any] = {
    "streaming": True,
    "stream_audio": True,
    "schedule": "low_latency",
    "n_timesteps": 10,
    "cfg_rate": 0.7,
    "start_policy": "eager",
    "flow_weights": "fp32",
    "hift_weights": "fp32",
}
LM_WEIGHTS = ("int8", "fp32")
FLOW_WEIGHTS = ("fp32", "int8")
HIFT_WEIGHTS = ("fp32", "bf16")

DEFAULTS: dict[str, Any] = {
    "server": {
        "uri": "tcp://0.0.0.0:10200",
        "model": "CosyVoice-300M-SFT",
        "model_dir": None,
        "data_dirs": ["./data"],
        "download_dir": None,
        "voices_dir": None,
        "voices_rescan_s": 30,
        "voice": None,
        "profile": "realtime",
        "lm_weights": "int8",
        "threads": None,
        "parallel_sentences": 1,
        "samples_per_chunk": 1024,
        "zeroconf": None,
        "seed": None,
        "warmup": True,
        "hub_endpoint": None,
        "offline": False,
        "debug": False,
        "log_format": "%(asctime)s %(levelname)s %(name)s: %(message)s",
    },
    "profiles": {
        "realtime": {
            "streaming": True,
            "stream_audio": True,
            "schedule": {"first_hop": 21, "growth": 2.0, "max_hop": 100, "overlap": 20},
            "n_timesteps": 10,
            "cfg_rate": 0.7,
            "start_policy": "eager",
        },
        "fast": {
            "streaming": True,
            "stream_audio": True,
            "schedule": {"first_hop": 25, "growth": 2.0, "max_hop": 100, "overlap": 20},
            "n_timesteps": 5,
            "cfg_rate": 0.7,
            "start_policy": "eager",
            "flow_weights": "int8",
            "hift_weights": "bf16",
        },
        "fastest": {
            "streaming": True,
            "stream_audio": True,
            "schedule": {"first_hop": 21, "growth": 2.0, "max_hop": 100, "overlap": 20},
            "n_timesteps": 4,
            "cfg_rate": 0.0,
            "start_policy": "eager",
            "flow_weights": "int8",
            "hift_weights": "bf16",
        },
        "quality": {
            "streaming": True,
            "stream_audio": True,
            "schedule": "official",
            "n_timesteps": 10,
            "cfg_rate": 0.7,
            "start_policy": "eager",
        },
        "batch": {
            "streaming": False,
            "stream_audio": False,
            "schedule": "official",
            "n_timesteps": 10,
            "cfg_rate": 0.7,
        },
    },
    "limits": {
        "max_text_chars": 5000,
        "max_header_bytes": 65536,
        "max_data_bytes": 65536,
        "max_payload_bytes": 1048576,
        "max_events_per_connection": 10000,
        "max_connections": 32,
        "idle_timeout_s": 300,
        "max_buffered_audio_s": 60,
        "stall_timeout_s": 30,
        "load_wait_s": 300,
    },
}

_NAMED_SCHEDULES = {"low_latency": LOW_LATENCY_SCHEDULE, "official": OFFICIAL_SCHEDULE}


class ConfigError(ValueError):
    """An invalid config file or value; the message names the offending key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"config key '{key}': {problem}")
        self.key = key


@dataclass(frozen=True)
class ProfileConfig:
    """A named set of synthesis settings (``realtime``, ``quality``, ``batch``, ...)."""

    name: str
    streaming: bool
    stream_audio: bool
    schedule: StreamSchedule
    n_timesteps: int
    cfg_rate: float
    start_policy: str = "eager"
    flow_weights: str = "fp32"  # the server loads the flow in this format (int8: approximation)
    hift_weights: str = "fp32"  # HiFT's filter runs in this format (bf16: approximation)

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
            instruct=instruct,
            force_tokens=force_tokens,
            start_policy=self.start_policy,
        )


@dataclass(frozen=True)
class Limits:
    """Per-connection and per-request bounds; see config.yaml for their meaning."""

    max_text_chars: int = 5000
    max_header_bytes: int = 65536
    max_data_bytes: int = 65536
    max_payload_bytes: int = 1048576
    max_events_per_connection: int = 10000
    max_connections: int = 32
    idle_timeout_s: float = 300
    max_buffered_audio_s: float = 60
    stall_timeout_s: float = 30
    load_wait_s: float = 300


@dataclass(frozen=True)
class ServerConfig:
    uri: str
    model: str
    model_dir: Path | None
    data_dirs: tuple[Path, ...]
    download_dir: Path | None
    voices_dir: Path | None
    voices_rescan_s: float
    voice: str | None
    profile: ProfileConfig
    lm_weights: str
    threads: int | None
    parallel_sentences: int
    samples_per_chunk: int
    zeroconf: str | None
    seed: int | None
    warmup: bool
    hub_endpoint: str | None
    offline: bool
    debug: bool
    log_format: str
    limits: Limits = field(default_factory=Limits)
    profiles: dict[str, ProfileConfig] = field(default_factory=dict)
    # Benchmarks only (command line, not config.yaml): speech tokens per sentence, so that a
    # random-weight model, which never ends an utterance by itself, gives fixed-length audio.
    force_tokens: int | None = None

    @property
    def effective_download_dir(self) -> Path:
        """Where a missing model is downloaded: --download-dir, else the first data dir."""
        return self.download_dir or self.data_dirs[0]


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
    """Defaults ← config file (``path``, else the repository's config.yaml) ← overrides."""
    raw = copy.deepcopy(DEFAULTS)
    if path is not None:
        raw = merge(raw, read_config_file(path))
    elif REPO_CONFIG.is_file():
        raw = merge(raw, read_config_file(REPO_CONFIG))
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


_SERVER_KINDS = {
    "uri": "str",
    "model": "str",
    "model_dir": "path?",
    "download_dir": "path?",
    "voices_dir": "path?",
    "voices_rescan_s": "float+",
    "voice": "str?",
    "profile": "str",
    "lm_weights": "str",
    "threads": "int+?",
    "parallel_sentences": "int+",
    "samples_per_chunk": "int+",
    "zeroconf": "str?",
    "seed": "int?",
    "warmup": "bool",
    "hub_endpoint": "str?",
    "offline": "bool",
    "debug": "bool",
    "log_format": "str",
}
_PROFILE_KINDS = {"streaming": "bool", "stream_audio": "bool", "n_timesteps": "int+"}
_SCHEDULE_KINDS = {"first_hop": "int+", "growth": "float+", "max_hop": "int+", "overlap": "int"}


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


def _profile(name: str, raw: Any) -> ProfileConfig:
    key = f"profiles.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(key, "must be a mapping")
    values = merge(_PROFILE_DEFAULTS, raw)
    for sub in values:
        if sub not in _PROFILE_DEFAULTS:
            raise ConfigError(
                f"{key}.{sub}", f"unknown key (known: {', '.join(_PROFILE_DEFAULTS)})"
            )
    cfg_rate = values["cfg_rate"]
    if isinstance(cfg_rate, bool) or not isinstance(cfg_rate, (int, float)) or cfg_rate < 0:
        raise ConfigError(f"{key}.cfg_rate", f"must be a number >= 0, not {cfg_rate!r}")
    return ProfileConfig(
        name=name,
        streaming=_check(f"{key}.streaming", values["streaming"], "bool"),
        stream_audio=_check(f"{key}.stream_audio", values["stream_audio"], "bool"),
        schedule=_schedule(f"{key}.schedule", values["schedule"]),
        n_timesteps=_check(f"{key}.n_timesteps", values["n_timesteps"], "int+"),
        cfg_rate=float(cfg_rate),
        start_policy=_one_of(f"{key}.start_policy", values["start_policy"], START_POLICIES),
        flow_weights=_one_of(f"{key}.flow_weights", values["flow_weights"], FLOW_WEIGHTS),
        hift_weights=_one_of(f"{key}.hift_weights", values["hift_weights"], HIFT_WEIGHTS),
    )


def _one_of(key: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ConfigError(key, f"must be one of {', '.join(allowed)}, not {value!r}")
    return str(value)


def _limits(raw: dict[str, Any]) -> Limits:
    section = _section(raw, "limits", Limits.__dataclass_fields__)
    values: dict[str, Any] = {}
    for key, value in section.items():
        kind = "float+" if key.endswith("_s") else "int+"
        values[key] = _check(f"limits.{key}", value, kind)
    return Limits(**values)


def build_config(raw: dict[str, Any]) -> ServerConfig:
    """Validate a merged raw mapping into a :class:`ServerConfig`."""
    for key in raw:
        if key not in DEFAULTS:
            raise ConfigError(key, f"unknown section (known: {', '.join(DEFAULTS)})")
    server = _section(raw, "server", [*_SERVER_KINDS, "data_dirs"])
    values = {
        key: _check(f"server.{key}", server.get(key), kind) for key, kind in _SERVER_KINDS.items()
    }

    data_dirs = server.get("data_dirs")
    if isinstance(data_dirs, str):
        data_dirs = [data_dirs]
    if not isinstance(data_dirs, list) or not data_dirs:
        raise ConfigError("server.data_dirs", "must be a non-empty list of directories")
    dirs = tuple(_check(f"server.data_dirs[{i}]", d, "path") for i, d in enumerate(data_dirs))

    profiles_raw = raw.get("profiles", {})
    if not isinstance(profiles_raw, dict) or not profiles_raw:
        raise ConfigError("profiles", "must be a non-empty mapping of profile names")
    profiles = {str(name): _profile(str(name), prof) for name, prof in profiles_raw.items()}
    _one_of("server.lm_weights", values["lm_weights"], LM_WEIGHTS)
    profile_name = values.pop("profile")
    if profile_name not in profiles:
        raise ConfigError(
            "server.profile", f"unknown profile {profile_name!r} (known: {', '.join(profiles)})"
        )

    uri = values["uri"]
    if not uri.startswith(("tcp://", "unix://")):
        raise ConfigError("server.uri", f"must start with tcp:// or unix://, not {uri!r}")
    return ServerConfig(
        **values,
        data_dirs=dirs,
        profile=profiles[profile_name],
        limits=_limits(raw),
        profiles=profiles,
    )
