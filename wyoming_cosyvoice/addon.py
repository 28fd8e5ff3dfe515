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

from engine.core.types import MAX_SPEED, MIN_SPEED
from wyoming_cosyvoice.config import AUTO_PROFILE, packaged_settings
from wyoming_cosyvoice.loudness import VOLUME_RANGE

_LOGGER = logging.getLogger(__name__)

URI = "tcp://0.0.0.0:10200"
# The web page and HTTP API, reached through ingress: the Supervisor's default ingress port
# (addon/config.yaml sets no other; a test checks).
INGRESS_PORT = 8099
OPTIONS_FILE = Path("/data/options.json")
DATA_DIR = Path("/data")
SHARE_DIR = Path("/share/cosyvoice")

MODELS = ("CosyVoice-300M-SFT", "CosyVoice2-0.5B", "CosyVoice-300M", "CosyVoice-300M-Instruct")
# The server's profiles: auto, then settings.yaml's in its order (the manifest's list must
# match, a test checks).
PROFILES = (AUTO_PROFILE, *packaged_settings()["profiles"])

# Must equal `options:` in addon/config.yaml (a test checks it). Used when a key is missing from
# options.json, e.g. an add-on updated from an older version that did not have the option yet.
DEFAULT_OPTIONS: dict[str, Any] = {
    "model": "CosyVoice-300M-SFT",
    "voice": "",
    "profile": AUTO_PROFILE,
    "threads": 0,
    "parallel_sentences": 1,
    "streaming": True,
    "early_speech": True,
    "volume": 1.0,
    "speed": 1.0,
    "preset_voices": [],
    "repeat_cache_mb": 64,
    "prepared_phrases": [],
    "debug_logging": False,
}
# Optional options (schema `?`) that have no default and are simply absent when unset.
OPTIONAL_OPTIONS = ("seed", "hub_endpoint", "stt_uri")


def _choice(options: Mapping[str, Any], key: str, allowed: Sequence[str]) -> str:
    value = options.get(key, DEFAULT_OPTIONS[key])
    if value not in allowed:
        raise ValueError(f"option {key!r}: {value!r} is not one of {', '.join(allowed)}")
    return str(value)


def _int(options: Mapping[str, Any], key: str, default: int | None) -> int | None:
    value = options.get(key, default)
    if value is None or value == "":
        return None
    # bool is an int subclass; a `true` here is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"option {key!r}: {value!r} is not a whole number >= 0")
    return value


def _bool(options: Mapping[str, Any], key: str) -> bool:
    value = options.get(key, DEFAULT_OPTIONS[key])
    if not isinstance(value, bool):
        raise ValueError(f"option {key!r}: {value!r} is not true or false")
    return value


def _volume(options: Mapping[str, Any]) -> float:
    value = options.get("volume", DEFAULT_OPTIONS["volume"])
    low, high = VOLUME_RANGE
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"option 'volume': {value!r} is not a number from {low:g} to {high:g}")
    return float(value)


def _phrases(options: Mapping[str, Any]) -> list[str]:
    value = options.get("prepared_phrases") or []
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise ValueError(f"option 'prepared_phrases': {value!r} is not a list of texts")
    return [p.strip() for p in value if p.strip()]


def _speed(options: Mapping[str, Any]) -> float:
    value = options.get("speed", DEFAULT_OPTIONS["speed"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"option 'speed': {value!r} is not a number")
    if not MIN_SPEED <= value <= MAX_SPEED:
        raise ValueError(f"option 'speed': {value!r} is not from {MIN_SPEED:g} to {MAX_SPEED:g}")
    return float(value)


def options_to_args(
    options: Mapping[str, Any],
    *,
    data_dir: Path | str = DATA_DIR,
    share_dir: Path | str = SHARE_DIR,
    uri: str = URI,
    http_port: int = INGRESS_PORT,
) -> list[str]:
    """Map the add-on options (``/data/options.json``) to ``wyoming-cosyvoice`` arguments.

    Pure: reads nothing, writes nothing. Raises ValueError naming the option on a bad value.
    Unknown keys are ignored (the Supervisor may keep options of an older add-on version).
    """
    data, share = Path(data_dir), Path(share_dir)
    args = [
        "--uri", uri,
        "--model", _choice(options, "model", MODELS),
        # Downloads land in /data (persistent); models placed by hand in /share are found too.
        "--data-dir", str(data / "models"),
        "--data-dir", str(share / "models"),
        "--download-dir", str(data / "models"),
        "--voices-dir", str(share / "voices"),
        "--profile", _choice(options, "profile", PROFILES),
        "--http-port", str(http_port),
        # the page that saves voices is behind Home Assistant's login (ingress)
        "--web-voice-maker",
    ]  # fmt: skip
    voice = str(options.get("voice") or "").strip()
    if voice:
        args += ["--voice", voice]
    threads = _int(options, "threads", DEFAULT_OPTIONS["threads"])
    if threads:  # 0 = let the server pick (all cores)
        args += ["--threads", str(threads)]
    parallel = _int(options, "parallel_sentences", DEFAULT_OPTIONS["parallel_sentences"])
    if parallel is not None and parallel != 1:
        if parallel < 1:
            raise ValueError(f"option 'parallel_sentences': {parallel!r} is not 1 or more")
        args += ["--parallel-sentences", str(parallel)]
    if not _bool(options, "streaming"):
        args.append("--no-streaming")
    if not _bool(options, "early_speech"):  # CosyVoice2: wait for each sentence's end
        args += ["--set", "server.early_speech=false"]
    seed = _int(options, "seed", None)
    if seed is not None:
        args += ["--seed", str(seed)]
    endpoint = str(options.get("hub_endpoint") or "").strip()
    if endpoint:
        # A Hugging Face mirror, for networks where huggingface.co is unreachable (e.g. China).
        if not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"option 'hub_endpoint': {endpoint!r} is not an http(s) URL")
        args += ["--hub-endpoint", endpoint.rstrip("/")]
    stt_uri = str(options.get("stt_uri") or "").strip()
    if stt_uri:
        # A Wyoming speech-to-text server for the web page's new voices, e.g. the Whisper add-on.
        if not stt_uri.startswith(("tcp://", "unix://")):
            raise ValueError(f"option 'stt_uri': {stt_uri!r} is not a Wyoming address such as "
                             "tcp://core-whisper:10300")  # fmt: skip
        args += ["--stt-uri", stt_uri]
    volume = _volume(options)
    if volume != 1.0:  # a factor on the loudness every voice is brought to
        args += ["--set", f"server.volume={volume:g}"]
    speed = _speed(options)
    if speed != 1.0:  # the speed of Assist pipelines and of calls that name none
        args += ["--set", f"server.speed={speed:g}"]
    if presets := options.get("preset_voices"):  # checked by the server's settings
        args += ["--set", f"server.preset_voices={json.dumps(presets)}"]
    cache_mb = _int(options, "repeat_cache_mb", DEFAULT_OPTIONS["repeat_cache_mb"])
    if cache_mb is not None and cache_mb != DEFAULT_OPTIONS["repeat_cache_mb"]:
        args += ["--set", f"cache.max_mb={cache_mb}"]  # 0 = off
    if phrases := _phrases(options):  # JSON is a YAML value --set reads
        args += ["--set", f"cache.prepare_phrases={json.dumps(phrases)}"]
    if _bool(options, "debug_logging"):
        args.append("--debug")
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
        return dict(DEFAULT_OPTIONS)
    try:
        options = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path}: {err}") from err
    if not isinstance(options, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    unknown = sorted(set(options) - set(DEFAULT_OPTIONS) - set(OPTIONAL_OPTIONS))
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
