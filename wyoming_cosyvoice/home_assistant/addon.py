"""Home Assistant add-on glue: turn the add-on options into the server's command line.

The image's command (``python3 -m wyoming_cosyvoice.addon_start``) reads the options with this
module; everything that needs a decision lives here, in plain Python, so it can be tested without
a container.

Layout inside the add-on container (see ``addon/DOCS.md``):

- ``/data/options.json``       options chosen in the UI, written by the Supervisor
- ``/data/models/<Model>/``     downloaded models (persistent, excluded from backups)
- ``/share/cosyvoice/models/``  models placed by hand for offline installs
- ``/share/cosyvoice/voices/``  custom voices (``NAME.wav`` + ``NAME.txt``)
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from wyoming_cosyvoice.config import ConfigError, load_config, packaged_settings, parse_override

_LOGGER = logging.getLogger(__name__)

URI = "tcp://0.0.0.0:10200"
# The web page and HTTP API, reached through ingress: the Supervisor's default ingress port
# (addon/config.yaml sets no other; a test checks).
INGRESS_PORT = 8099
OPTIONS_FILE = Path("/data/options.json")
DATA_DIR = Path("/data")
SHARE_DIR = Path("/share/cosyvoice")

# The options, their defaults and their types are addon/config.yaml's; every default is the
# server's, from settings.yaml (a test checks each option against the setting it sets). An option
# sets the server setting of its own name (`voice` sets server.voice), except these, whose names
# existing installs have saved:
RENAMED_OPTIONS = {
    "repeat_cache_mb": "cache.max_mb",
    "prepared_phrases": "cache.prepare_phrases",
    "debug_logging": "server.debug",
}
# `streaming` turns streaming input off for whichever profile runs: the server's --no-streaming.
STREAMING_OPTION = "streaming"
# Server settings the add-on sets itself (its folders, its port, its page): no option changes them.
FIXED_SETTINGS = ("uri", "model_dir", "data_dirs", "download_dir", "voices_dir", "web_voice_maker")
_SETTINGS = packaged_settings()


def option_setting(option: str) -> str | None:
    """The settings.yaml key (``section.name``) an add-on option sets; None for an option the
    add-on does not know (and for ``streaming``, a flag)."""
    if option in RENAMED_OPTIONS:
        return RENAMED_OPTIONS[option]
    if option in _SETTINGS["server"] and option not in FIXED_SETTINGS:
        return f"server.{option}"
    return None


def setting_default(key: str) -> Any:
    """settings.yaml's value of a ``section.name`` key."""
    section, name = key.split(".")
    return _SETTINGS[section][name]


def setting_value(value: Any) -> Any:
    """An option's value as the server reads it: a text without the spaces around it, a blank
    text (a field left empty in the UI) as null, and a list without its blank entries."""
    if isinstance(value, str):
        return value.strip() or None
    if isinstance(value, list):
        return [item for item in map(setting_value, value) if item is not None]
    return value


def _yaml_text(value: Any) -> str:
    """``value`` as ``--set`` reads it back (a YAML value): plain where that reads back the same
    text, else JSON (which is YAML)."""
    if isinstance(value, str):
        try:
            if yaml.safe_load(value) == value:
                return value
        except yaml.YAMLError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _settings_args(options: Mapping[str, Any]) -> list[str]:
    """``--set KEY=VALUE`` for each option whose value is not the server's default, checked by
    the server's own settings; a bad value raises ValueError naming the option."""
    changed: dict[str, str] = {}  # option -> "key=value"
    for option, value in options.items():
        key, wanted = option_setting(option), setting_value(value)
        if key is not None and wanted is not None and not _is_default(wanted, key):
            changed[option] = f"{key}={_yaml_text(wanted)}"
    try:
        load_config(None, [parse_override(item) for item in changed.values()])
    except ConfigError as err:
        named = next(
            (o for o, item in changed.items() if _names(err.key, item.partition("=")[0])), None
        )
        raise ValueError(f"option {named!r}: {err.problem}" if named else str(err)) from err
    return [arg for item in changed.values() for arg in ("--set", item)]


def _is_default(value: Any, key: str) -> bool:
    """Whether ``value`` is settings.yaml's for ``key`` (``true`` is not a count of 1)."""
    default = setting_default(key)
    return bool(value == default and type(value) is type(default))


def _names(error_key: str, key: str) -> bool:
    """Whether a settings error about ``error_key`` is about ``key`` (or an entry of it)."""
    return error_key == key or error_key.startswith((f"{key}[", f"{key}."))


def options_to_args(
    options: Mapping[str, Any],
    *,
    data_dir: Path | str = DATA_DIR,
    share_dir: Path | str = SHARE_DIR,
    uri: str = URI,
    http_port: int = INGRESS_PORT,
) -> list[str]:
    """Map the add-on options (``/data/options.json``) to ``wyoming-cosyvoice`` arguments.

    Reads only the package's settings, writes nothing. Raises ValueError naming the option on
    a bad value.
    A missing option is the server's default; unknown keys are ignored (the Supervisor may keep
    options of an older add-on version).
    """
    data, share = Path(data_dir), Path(share_dir)
    args = [
        "--uri", uri,
        # Downloads land in /data (persistent); models placed by hand in /share are found too.
        "--data-dir", str(data / "models"),
        "--data-dir", str(share / "models"),
        "--download-dir", str(data / "models"),
        "--voices-dir", str(share / "voices"),
        "--http-port", str(http_port),
        # the page that saves voices is behind Home Assistant's login (ingress)
        "--web-voice-maker",
    ]  # fmt: skip
    args += _settings_args(options)
    streaming = options.get(STREAMING_OPTION)
    if streaming is False:
        args.append("--no-streaming")
    elif streaming is not None and streaming is not True:
        raise ValueError(f"option {STREAMING_OPTION!r}: {streaming!r} is not true or false")
    return args


def in_addon() -> bool:
    """Running as the Home Assistant add-on: the Supervisor has written its options file."""
    return OPTIONS_FILE.is_file()


def missing_model_help(name: str, repo_id: str, files: Sequence[str]) -> str:
    """What an add-on user can do about a model that is missing and was not downloaded.

    Of the folders searched, only /share can be reached from outside the container (Samba
    share, File editor), and add-on options take the place of command-line flags.
    """
    folder = SHARE_DIR / "models" / name
    return (
        f"Model {name} is not installed and was not downloaded.\n"
        f"To install it by hand, download these files from https://huggingface.co/{repo_id} "
        f"(or ModelScope iic/{name}):\n  {' '.join(files)}\n"
        f"and put them in {folder}/ (for example through the Samba share or File editor "
        "add-on), then restart the add-on.\n"
        "If huggingface.co cannot be reached from this network, set the add-on option "
        "'hub_endpoint' to a Hugging Face mirror instead."
    )


def read_options(path: Path) -> dict[str, Any]:
    """Read options.json; a missing file means defaults (e.g. running the image by hand)."""
    if not path.exists():
        _LOGGER.warning("%s not found, using the default options", path)
        return {}
    try:
        options = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(options, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    unknown = sorted(
        key for key in options if key != STREAMING_OPTION and option_setting(key) is None
    )
    if unknown:
        _LOGGER.warning("ignoring unknown options: %s", ", ".join(unknown))
    return options


def prepare_dirs(data_dir: Path, share_dir: Path) -> None:
    """Create the model and voice folders so users find where to drop files.

    /share is a shared volume; failing to create folders there must not stop the add-on.
    """
    (data_dir / "models").mkdir(parents=True, exist_ok=True)
    for sub in ("models", "voices"):
        try:
            (share_dir / sub).mkdir(parents=True, exist_ok=True)
        except OSError as err:
            _LOGGER.warning("cannot create %s: %s", share_dir / sub, err)
