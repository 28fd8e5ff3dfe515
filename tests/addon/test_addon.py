"""The Home Assistant add-on (addon/, repository.yaml, wyoming_cosyvoice/addon*.py).

Everything the Supervisor and the container would do, except building and running the image
(script/image-test does that): manifest and build file against the add-on linter's JSON schemas,
options ↔ schema ↔ translations, the options → server command line mapping, versions, hadolint /
yamllint, the image's entry point, the healthcheck, what the Supervisor's repository scan picks
up, and an end-to-end start (options, discovery, server, SIGTERM) with the tiny model.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import socketserver
import struct
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from conftest import DATA, ROOT, wait_for_port
from lint_tools import tool
from stand_in_supervisor import StandInSupervisor

from engine.core.types import MAX_SPEED, MIN_SPEED
from wyoming_cosyvoice import addon_start
from wyoming_cosyvoice.config import AUTO_PROFILE, VOLUME_RANGE, packaged_settings
from wyoming_cosyvoice.home_assistant import addon

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ADDON = ROOT / "addon"
SCHEMAS = DATA / "schemas"
HEALTHCHECK = ADDON / "rootfs/usr/local/bin/cosyvoice-healthcheck"
LANGUAGES = ("en", "zh-Hans")  # zh-Hans: the code HA's frontend uses for Simplified Chinese


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    return load_yaml(ADDON / "config.yaml")


def package_version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def pinned_torch() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in deps if d.startswith("torch=="))


# --- manifest and build file against the add-on linter's schemas -------------------------------


def schema_errors(schema_name: str, document: Any) -> list[str]:
    schema = json.loads((SCHEMAS / schema_name).read_text())
    # jsonschema evaluates "pattern" with Python's re, which is the regex variant the linter's
    # schemas need (they use Python named groups).
    validator = jsonschema.Draft7Validator(
        schema, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER
    )
    return [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(document)]


def keys_set_to_default(schema_name: str, document: dict[str, Any]) -> list[str]:
    """The linter also flags keys that only repeat the Supervisor's default."""
    props = json.loads((SCHEMAS / schema_name).read_text())["properties"]
    return [
        k for k, v in document.items() if "default" in props.get(k, {}) and props[k]["default"] == v
    ]


def test_config_yaml_matches_the_linter_schema(config: dict[str, Any]) -> None:
    assert schema_errors("config.schema.json", config) == []
    assert keys_set_to_default("config.schema.json", config) == []


def test_build_yaml_matches_the_linter_schema() -> None:
    build = load_yaml(ADDON / "build.yaml")
    assert schema_errors("build.schema.json", build) == []
    assert keys_set_to_default("build.schema.json", build) == []
    assert set(build["build_from"]) == set(load_yaml(ADDON / "config.yaml")["arch"])
    assert all("debian" in image for image in build["build_from"].values())


def test_the_schema_check_catches_mistakes() -> None:
    """Guard against a validator that accepts anything."""
    broken = {**load_yaml(ADDON / "config.yaml"), "init": "maybe"}
    del broken["slug"]
    errors = schema_errors("config.schema.json", broken)
    assert any("slug" in e for e in errors) and any("maybe" in e for e in errors)
    assert keys_set_to_default("config.schema.json", {"boot": "auto"}) == ["boot"]


def test_manifest_names_the_prebuilt_image_and_its_options(config: dict[str, Any]) -> None:
    assert config["arch"] == ["amd64", "aarch64"]
    assert config["init"] is False
    assert config["discovery"] == ["wyoming"]
    assert config["ports"] == {"10200/tcp": None}
    assert config["image"] == "ghcr.io/wyoming-cosyvoice/{arch}-addon-cosyvoice"  # pulled, prebuilt
    assert [m["type"] for m in config["map"]] == ["share"]
    assert config["backup_exclude"]
    # streaming TTS in Home Assistant since 2025.7
    assert tuple(int(p) for p in config["homeassistant"].split(".")[:2]) >= (2025, 7)


def test_the_web_page_opens_in_the_sidebar_on_the_servers_http_port(config: dict[str, Any]) -> None:
    schema = json.loads((SCHEMAS / "config.schema.json").read_text())["properties"]
    assert config["ingress"] is True and config["panel_icon"].startswith("mdi:")
    port = config.get("ingress_port", schema["ingress_port"]["default"])
    args = addon.options_to_args(config["options"])
    assert args[args.index("--http-port") + 1] == str(port) == str(addon.INGRESS_PORT)
    # the page is reached through ingress only: the HTTP port is not published on the host
    assert f"{port}/tcp" not in config["ports"]
    # the page may reload Home Assistant's Wyoming entry for a new voice
    assert config["homeassistant_api"] is True


def test_stt_uri_names_a_wyoming_server() -> None:
    args = addon.options_to_args({"stt_uri": " tcp://core-whisper:10300 "})
    assert server_config_of(args).stt_uri == "tcp://core-whisper:10300"
    assert server_config_of(addon.options_to_args({"stt_uri": ""})).stt_uri is None
    with pytest.raises(ValueError, match="'stt_uri'"):
        addon.options_to_args({"stt_uri": "http://core-whisper:10300"})


# --- options, schema, translations --------------------------------------------------------------

# The Supervisor's option types (supervisor/addons/options.py), rewritten as one expression.
_SUPERVISOR_TYPE = re.compile(
    r"^(?:bool|email|url|port"
    r"|device(?:\(subsystem=[a-z]+\))?"
    r"|(?P<kind>str|password|int|float)(?:\((?P<min>-?[\d.]+)?,(?P<max>-?[\d.]+)?\))?"
    r"|match\((?P<match>.*)\)"
    r"|list\((?P<list>.+)\))(?P<optional>\?)?$"
)


def option_fits(value: Any, spec: str) -> bool:
    m = _SUPERVISOR_TYPE.match(spec)
    assert m, f"not a Supervisor option type: {spec}"
    if m["list"]:
        return value in m["list"].split("|")
    if spec.rstrip("?") == "bool":
        return isinstance(value, bool)
    if m["kind"] in ("int", "float"):
        number_type = int if m["kind"] == "int" else (int, float)
        low = float(m["min"]) if m["min"] else float("-inf")
        high = float(m["max"]) if m["max"] else float("inf")
        return (
            isinstance(value, number_type) and not isinstance(value, bool) and low <= value <= high
        )
    return isinstance(value, str)


def test_every_option_has_a_valid_schema_entry(config: dict[str, Any]) -> None:
    schema, options = config["schema"], config["options"]
    assert set(options) <= set(schema)
    for key, spec in schema.items():
        if isinstance(spec, list):  # a list of one type, e.g. [str]
            (item,) = spec
            assert all(option_fits(v, item) for v in options.get(key, [])), key
            continue
        assert _SUPERVISOR_TYPE.match(spec), (key, spec)
        if key in options:
            assert option_fits(options[key], spec), (key, options[key], spec)
        else:
            assert spec.endswith("?"), f"{key} has no default, so it must be optional"


def schema_choices(config: dict[str, Any], option: str) -> list[str]:
    """The choices of a `list(a|b|c)` option (or of each entry of a list of them)."""
    spec = config["schema"][option]
    match = _SUPERVISOR_TYPE.match(spec[0] if isinstance(spec, list) else spec)
    assert match and match["list"], (option, spec)
    return match["list"].split("|")


def test_every_option_sets_the_server_setting_whose_default_it_shows(
    config: dict[str, Any],
) -> None:
    """The add-on's options are the server's settings, not a second list of them: each sets one
    (of its own name, or as addon.RENAMED_OPTIONS says), and its default in `options:` is
    settings.yaml's (an optional one, `?`, has none: the setting's is null)."""
    settings = packaged_settings()
    for option in config["schema"]:
        if option == addon.STREAMING_OPTION:  # leaves every profile's own streaming on
            assert config["options"][option] is settings["auto"]["streaming"] is True
            continue
        key = addon.option_setting(option)
        assert key is not None, f"option {option!r} sets no server setting"
        default = addon.setting_default(key)
        if option in config["options"]:
            assert addon.setting_value(config["options"][option]) == default, option
        else:
            assert default is None, option
    assert not set(addon.RENAMED_OPTIONS) - set(config["schema"])  # no stale renames


def test_the_schema_admits_what_the_server_accepts(config: dict[str, Any]) -> None:
    """Every choice of a list, both ends of a range and both booleans reach the server's
    settings intact; a number range with the server's own bounds is the server's exactly."""
    from wyoming_cosyvoice.__main__ import build_parser, config_from_args

    def accepted(option: str, value: Any) -> bool:
        try:
            args = addon.options_to_args({option: value})
        except ValueError:
            return False
        config_from_args(build_parser().parse_args(args))
        return True

    for option, spec in config["schema"].items():
        item = spec[0] if isinstance(spec, list) else spec
        match = _SUPERVISOR_TYPE.match(item)
        assert match, (option, spec)
        if match["list"]:
            for choice in match["list"].split("|"):
                assert accepted(option, [choice] if isinstance(spec, list) else choice), choice
        elif item.rstrip("?") == "bool":
            assert accepted(option, True) and accepted(option, False), option
        elif match["kind"] in ("int", "float"):
            kind = int if match["kind"] == "int" else float
            low, high = kind(match["min"]), kind(match["max"])
            assert accepted(option, low) and accepted(option, high), option
    assert not accepted("volume", VOLUME_RANGE[0] - 0.01)
    assert not accepted("volume", VOLUME_RANGE[1] + 0.01)
    assert not accepted("speed", MIN_SPEED - 0.01) and not accepted("speed", MAX_SPEED + 0.01)
    assert config["schema"]["volume"] == f"float({VOLUME_RANGE[0]:g},{VOLUME_RANGE[1]:g})"
    assert config["schema"]["speed"] == f"float({MIN_SPEED:g},{MAX_SPEED:g})"


def test_the_model_and_profile_lists_are_the_servers(config: dict[str, Any]) -> None:
    from wyoming_cosyvoice.models.download import MODELS

    assert sorted(schema_choices(config, "model")) == sorted(MODELS)
    assert schema_choices(config, "profile") == [AUTO_PROFILE, *packaged_settings()["profiles"]]


@pytest.mark.parametrize("language", LANGUAGES)
def test_every_option_and_port_is_translated(config: dict[str, Any], language: str) -> None:
    translation = load_yaml(ADDON / "translations" / f"{language}.yaml")
    assert set(translation) <= {"configuration", "network"}
    entries = translation["configuration"]
    assert set(entries) == set(config["schema"])
    for key, entry in entries.items():
        assert set(entry) <= {"name", "description", "fields"}, key
        assert isinstance(entry["name"], str) and entry["name"].strip(), key
        assert isinstance(entry.get("description"), str) and entry["description"].strip(), key
    assert set(translation["network"]) == set(config["ports"])


def test_chinese_translation_is_chinese() -> None:
    entries = load_yaml(ADDON / "translations/zh-Hans.yaml")["configuration"]
    for key, entry in entries.items():
        assert re.search(r"[\u4e00-\u9fff]", entry["name"] + entry["description"]), key


# --- options → server command line ---------------------------------------------------------------


def server_flags() -> dict[str, bool]:
    """The server's flags, each with whether it takes a value."""
    from wyoming_cosyvoice.__main__ import build_parser

    return {
        flag: action.nargs != 0
        for action in build_parser()._actions
        for flag in action.option_strings
    }


def test_default_options_give_the_documented_command_line(config: dict[str, Any]) -> None:
    args = addon.options_to_args(config["options"])
    assert args == [
        "--uri", "tcp://0.0.0.0:10200",
        "--data-dir", "/data/models",
        "--data-dir", "/share/cosyvoice/models",
        "--download-dir", "/data/models",
        "--voices-dir", "/share/cosyvoice/voices",
        "--http-port", "8099",
        "--web-voice-maker",
    ]  # fmt: skip
    known = server_flags()
    flags = [a for a in args if a.startswith("--")]
    assert set(flags) <= set(known)
    for i, arg in enumerate(args):  # every flag that takes a value has one
        if arg.startswith("--") and known[arg]:
            assert not args[i + 1].startswith("--"), arg


def server_config_of(args: list[str]) -> Any:
    from wyoming_cosyvoice.__main__ import build_parser, config_from_args

    return config_from_args(build_parser().parse_args(args))


# The command line an earlier add-on gave for `every` below (one flag per option, written out
# per option): the options an existing install has saved must give the same server settings.
EARLIER_FIXED_ARGS = [
    "--uri", "tcp://0.0.0.0:10200", "--data-dir", "/data/models",
    "--data-dir", "/share/cosyvoice/models", "--download-dir", "/data/models",
    "--voices-dir", "/share/cosyvoice/voices", "--http-port", "8099", "--web-voice-maker",
]  # fmt: skip
EARLIER_EVERY_ARGS = [
    "--voice", "x", "--threads", "2", "--parallel-sentences", "2", "--no-streaming",
    "--set", "server.early_speech=false", "--seed", "1", "--hub-endpoint",
    "https://hf-mirror.com", "--stt-uri", "tcp://core-whisper:10300",
    "--set", "server.volume=0.5", "--set", "server.speed=1.25",
    "--set", 'server.preset_voices=["slow", "calm-fast"]', "--set", "cache.max_mb=0",
    "--set", 'cache.prepare_phrases=["Good night."]', "--debug",
    "--set", 'server.pronunciations=["Niamh = Neev"]',
    "--set", "server.rl_tuned_lm=true", "--set", "server.lm_weights=int4",
]  # fmt: skip


def test_saved_options_give_the_settings_an_earlier_add_on_gave(config: dict[str, Any]) -> None:
    every = {**config["options"], "voice": " x ", "threads": 2, "parallel_sentences": 2,
             "streaming": False, "early_speech": False, "seed": 1,
             "hub_endpoint": "https://hf-mirror.com/", "stt_uri": "tcp://core-whisper:10300",
             "volume": 0.5, "speed": 1.25, "preset_voices": ["slow", "calm-fast"],
             "repeat_cache_mb": 0, "prepared_phrases": [" Good night. ", ""],
             "debug_logging": True,
             "pronunciations": [" Niamh = Neev", ""], "rl_tuned_lm": True,
             "lm_weights": "int4"}  # fmt: skip
    assert set(every) == set(config["schema"])  # every option, changed from its default
    assert [k for k in every if every[k] == config["options"].get(k)] == ["model", "profile"]
    for model in schema_choices(config, "model"):
        for profile in schema_choices(config, "profile"):
            chosen = ["--model", model, "--profile", profile]
            for options, earlier in ((config["options"], []), (every, EARLIER_EVERY_ARGS)):
                options = {**options, "model": model, "profile": profile}
                server_config = server_config_of(addon.options_to_args(options))
                assert server_config == server_config_of([*EARLIER_FIXED_ARGS, *chosen, *earlier])
                assert (server_config.model, server_config.profile.name) == (model, profile)
                assert server_config.web_voice_maker is True


def test_each_option_maps_to_its_setting() -> None:
    options = {
        "model": "CosyVoice-300M-Instruct", "voice": " zh_female ", "profile": "batch",
        "threads": 2, "streaming": False, "seed": 42, "debug_logging": True,
        "prepared_phrases": ["yes", " "],
    }  # fmt: skip
    args = addon.options_to_args(options, data_dir="/d", share_dir="/s", uri="tcp://h:1")
    assert args == [
        "--uri", "tcp://h:1",
        "--data-dir", "/d/models",
        "--data-dir", "/s/models",
        "--download-dir", "/d/models",
        "--voices-dir", "/s/voices",
        "--http-port", "8099",
        "--web-voice-maker",
        "--set", "server.model=CosyVoice-300M-Instruct",
        "--set", "server.voice=zh_female",
        "--set", "server.profile=batch",
        "--set", "server.threads=2",
        "--set", "server.seed=42",
        "--set", "server.debug=true",
        "--set", 'cache.prepare_phrases=["yes"]',  # a text, not YAML's true
        "--no-streaming",
    ]  # fmt: skip
    assert server_config_of(args).cache.prepare_phrases == ("yes",)


def test_lm_weights_is_each_profiles_own_unless_one_format_is_chosen(
    config: dict[str, Any],
) -> None:
    assert schema_choices(config, "lm_weights") == ["profile", "int8", "int4", "fp32"]
    default = addon.options_to_args(config["options"])
    assert not [arg for arg in default if "lm_weights" in arg]  # the server's own default
    own = server_config_of(default)
    assert (own.profiles["realtime"].lm_weights, own.profiles["fastest"].lm_weights) == (
        "int8",
        "int4",
    )
    assert "llm.int4" in own.load.weights.extra  # auto loads both LMs
    for lm in ("int8", "int4", "fp32"):
        args = addon.options_to_args({**config["options"], "lm_weights": lm})
        assert args[-2:] == ["--set", f"server.lm_weights={lm}"]
        chosen = server_config_of(args)
        assert {p.lm_weights for p in chosen.profiles.values()} == {lm}
        assert chosen.load.weights.lm == lm and not [
            e for e in chosen.load.weights.extra if e.startswith("llm.")
        ]


def test_texts_that_read_as_other_yaml_values_stay_texts() -> None:
    for voice in ("yes", "7", "null", "a: b", "# x", "[x]", "dîner 晚安 🙂", 'say "hi"'):
        assert server_config_of(addon.options_to_args({"voice": voice})).voice == voice


def test_threads_0_is_every_core_as_the_servers_setting() -> None:
    assert packaged_settings()["server"]["threads"] == 0
    args = addon.options_to_args({"threads": 0})
    assert "--set" not in args and server_config_of(args).threads is None
    assert server_config_of(addon.options_to_args({"threads": 3})).threads == 3


def test_hub_endpoint_selects_a_mirror() -> None:
    args = addon.options_to_args({"hub_endpoint": "https://hf-mirror.com/"})
    assert server_config_of(args).hub_endpoint == "https://hf-mirror.com"
    assert "--set" not in addon.options_to_args({"hub_endpoint": ""})
    with pytest.raises(ValueError, match="'hub_endpoint'"):
        addon.options_to_args({"hub_endpoint": "hf-mirror.com"})


def test_missing_and_unknown_options_fall_back_to_defaults(config: dict[str, Any]) -> None:
    assert addon.options_to_args({}) == addon.options_to_args(config["options"])
    assert addon.options_to_args({"old_option": 1}) == addon.options_to_args({})
    # settings the add-on fixes are not options
    assert addon.options_to_args({"uri": "tcp://0.0.0.0:1"}) == addon.options_to_args({})
    assert "server.seed=0" in addon.options_to_args({"seed": 0})  # 0 is a seed, not "unset"


def test_options_json_warns_of_options_this_add_on_does_not_have(
    tmp_path: Path, config: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "options.json"
    path.write_text(json.dumps({**config["options"], "seed": 1, "old_option": 1, "uri": "x"}))
    with caplog.at_level("WARNING", logger=addon.__name__):
        assert addon.read_options(path)["seed"] == 1
    assert [r.getMessage() for r in caplog.records] == ["ignoring unknown options: old_option, uri"]
    caplog.clear()
    with caplog.at_level("WARNING", logger=addon.__name__):
        assert addon.read_options(tmp_path / "absent.json") == {}  # the server's defaults
    assert "using the default options" in caplog.text


@pytest.mark.parametrize(
    ("key", "value"),
    [("profile", "turbo"), ("threads", -1), ("threads", True), ("seed", "7"),
     ("streaming", "yes"), ("streaming", 1), ("debug_logging", 1), ("parallel_sentences", 0),
     ("parallel_sentences", True), ("volume", 3), ("preset_voices", ["slow", "loud"]),
     ("prepared_phrases", [1]), ("repeat_cache_mb", -1)],
)  # fmt: skip
def test_bad_values_name_the_option(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=f"^option {key!r}: "):
        addon.options_to_args({key: value})


def run_addon_main(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wyoming_cosyvoice.addon_start", *args],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip


def test_main_reads_options_json(tmp_path: Path) -> None:
    options = {"model": "CosyVoice-300M", "seed": 3, "hub_endpoint": "https://hf-mirror.com"}
    (tmp_path / "options.json").write_text(json.dumps(options))
    result = run_addon_main("--options", str(tmp_path / "options.json"), "--print")
    assert result.returncode == 0, result.stderr
    command = result.stdout.split()
    assert command[:3] == [sys.executable, "-m", "wyoming_cosyvoice"]
    assert command == addon_start.server_command(command[3:])
    assert command[3:] == addon.options_to_args(options)


@pytest.mark.long
def test_main_rejects_a_bad_options_file(tmp_path: Path) -> None:
    (tmp_path / "options.json").write_text('{"profile": "turbo"}')
    result = run_addon_main("--options", str(tmp_path / "options.json"), "--print")
    assert result.returncode == 2
    assert "invalid add-on configuration" in result.stderr and "'profile'" in result.stderr
    (tmp_path / "options.json").write_text("{not json")
    assert run_addon_main("--options", str(tmp_path / "options.json"), "--print").returncode == 2


def _missing_model_message(tmp_path: Path) -> str:
    """The server's message for the add-on's default model, absent, offline."""
    from wyoming_cosyvoice.__main__ import build_parser, config_from_args, resolve_model_dir
    from wyoming_cosyvoice.models.download import ModelNotFoundError

    args = addon.options_to_args({}, data_dir=tmp_path / "data", share_dir=tmp_path / "share")
    config = config_from_args(build_parser().parse_args([*args, "--offline"]))
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_dir(config)
    return str(err.value)


def test_missing_model_message_in_the_addon_names_the_share_folder_and_an_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, Any]
) -> None:
    (tmp_path / "options.json").write_text("{}")
    monkeypatch.setattr(addon, "OPTIONS_FILE", tmp_path / "options.json")
    assert addon.in_addon()
    message = _missing_model_message(tmp_path)
    model = config["options"]["model"]
    assert f"/share/cosyvoice/models/{model}/" in message  # searched, and reachable by Samba
    assert "'hub_endpoint'" in message and "hub_endpoint" in config["schema"]
    assert "--model-dir" not in message and "/data/" not in message, message
    assert str(tmp_path) not in message  # no path of the container's private /data


def test_missing_model_message_outside_the_addon_names_the_command_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(addon, "OPTIONS_FILE", tmp_path / "no-options.json")
    assert not addon.in_addon()
    message = _missing_model_message(tmp_path)
    assert "--model-dir" in message and str(tmp_path / "data" / "models") in message


def test_prepare_dirs_creates_the_user_folders(tmp_path: Path) -> None:
    addon.prepare_dirs(tmp_path / "data", tmp_path / "share/cosyvoice")
    for path in ("data/models", "share/cosyvoice/models", "share/cosyvoice/voices"):
        assert (tmp_path / path).is_dir()


# --- versions -------------------------------------------------------------------------------------


def dockerfile_arg_default(name: str) -> str:
    text = (ADDON / "Dockerfile").read_text()
    match = re.search(rf"^ARG {name}=(\S+)$", text, re.MULTILINE)
    assert match, f"no ARG {name}=... in the Dockerfile"
    return match.group(1)


def test_versions_agree(config: dict[str, Any]) -> None:
    version = package_version()
    assert config["version"] == version
    build_args = load_yaml(ADDON / "build.yaml")["args"]
    assert build_args["WYOMING_COSYVOICE_VERSION"] == version
    assert dockerfile_arg_default("WYOMING_COSYVOICE_VERSION") == version
    assert build_args["TORCH_VERSION"] == dockerfile_arg_default("TORCH_VERSION") == pinned_torch()
    assert re.search(rf"^## {re.escape(version)}\b", (ADDON / "CHANGELOG.md").read_text(), re.M)


def test_repository_urls_agree(config: dict[str, Any]) -> None:
    repository = load_yaml(ROOT / "repository.yaml")
    assert set(repository) <= {"name", "url", "maintainer"} and repository["name"]
    assert config["url"].startswith(repository["url"])
    assert dockerfile_arg_default("WYOMING_COSYVOICE_REPO") == repository["url"]


def test_dockerfile_essentials() -> None:
    text = (ADDON / "Dockerfile").read_text()
    assert "debian" in dockerfile_arg_default("BUILD_FROM")
    assert re.search(r"^FROM \$\{BUILD_FROM\}$", text, re.M)
    assert "https://download.pytorch.org/whl/cpu" in text
    assert "COPY addon/rootfs /" in text
    healthcheck = re.search(r"^HEALTHCHECK .*?CMD (.+)$", text, re.M | re.S)
    assert healthcheck and "/usr/local/bin/cosyvoice-healthcheck" in healthcheck.group(1)


# --- linters ------------------------------------------------------------------------------------


def test_hadolint_is_clean() -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(ADDON / "Dockerfile")], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_yamllint_is_clean() -> None:
    rules = "{extends: default, rules: {line-length: {max: 100}}}"
    result = subprocess.run(
        [tool("yamllint"), "--strict", "-d", rules, str(ADDON), str(ROOT / "repository.yaml")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_healthcheck_script_is_ruff_clean() -> None:
    result = subprocess.run([tool("ruff"), "check", "--no-cache", str(HEALTHCHECK)],
                            capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


# --- the image's entry point --------------------------------------------------------------------


def git_mode(path: Path) -> str | None:
    result = subprocess.run(["git", "ls-files", "-s", str(path.relative_to(ROOT))],
                            capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    return result.stdout.split()[0] if result.returncode == 0 and result.stdout else None


def dockerfile_json_instruction(name: str) -> list[str]:
    match = re.search(rf"^{name} (\[.*\])$", (ADDON / "Dockerfile").read_text(), re.M)
    assert match, f"no {name} [...] in the Dockerfile"
    return json.loads(match.group(1))


def test_the_image_starts_the_addon_module_under_tini(config: dict[str, Any]) -> None:
    """tini (PID 1) forwards signals and reaps; a SIGTERM before the server's own handler (exit
    143) is an orderly stop; the command is the start logic tested below, nothing else."""
    assert dockerfile_json_instruction("ENTRYPOINT") == ["/usr/bin/tini", "-e", "143", "--"]
    assert dockerfile_json_instruction("CMD") == ["python3", "-m", "wyoming_cosyvoice.addon_start"]
    assert re.search(r"apt-get install [^&]*\btini\b", (ADDON / "Dockerfile").read_text())
    # The image brings its own init: the Supervisor must not add Docker's.
    assert config["init"] is False
    # No s6 services or bashio scripts are left to run untested.
    rootfs = sorted(p.relative_to(ADDON / "rootfs").as_posix()
                    for p in (ADDON / "rootfs").rglob("*") if p.is_file())  # fmt: skip
    assert rootfs == ["usr/local/bin/cosyvoice-healthcheck"]
    assert os.access(HEALTHCHECK, os.X_OK)
    assert git_mode(HEALTHCHECK) in (None, "100755"), "the health check is not committed executable"


# --- healthcheck --------------------------------------------------------------------------------


class _OneLineServer(socketserver.ThreadingTCPServer):
    allow_reuse_address = True
    daemon_threads = True

    def __init__(self, reply: bytes) -> None:
        self.reply = reply

        class Handler(socketserver.StreamRequestHandler):
            def handle(inner) -> None:  # closure over the server's reply
                if inner.rfile.readline():
                    inner.wfile.write(reply)

        super().__init__(("127.0.0.1", 0), Handler)


@pytest.fixture
def fake_server(request: pytest.FixtureRequest) -> Iterator[int]:
    server = _OneLineServer(request.param)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def run_healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(HEALTHCHECK), str(port)],
                          capture_output=True, text=True, timeout=30)  # fmt: skip


INFO_REPLY = b'{"type": "info", "version": "1.10.2", "data_length": 2}\n{}'


@pytest.mark.parametrize("fake_server", [INFO_REPLY], indirect=True)
def test_healthcheck_accepts_an_info_answer(fake_server: int) -> None:
    result = run_healthcheck(fake_server)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("fake_server", [b'{"type": "error"}\n', b"garbage\n"], indirect=True)
def test_healthcheck_rejects_other_answers(fake_server: int) -> None:
    result = run_healthcheck(fake_server)
    assert result.returncode == 1 and "unhealthy" in result.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_healthcheck_fails_without_a_server() -> None:
    result = run_healthcheck(free_port())
    assert result.returncode == 1 and "no connection" in result.stderr


# --- repository scan, docs, images ---------------------------------------------------------------


def supervisor_candidates() -> list[str]:
    """Files the Supervisor's store scan reads as add-on manifests (supervisor/store/data.py:
    every `**/config.*` with suffix .json/.yaml/.yml, skipping paths with a part that starts
    with "." or is "rootfs"), over what git tracks — what a clone of the repository holds."""
    tracked = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, text=True, cwd=ROOT, check=True)  # fmt: skip
    found = []
    for name in tracked.stdout.splitlines():
        path = Path(name)
        if path.stem != "config" or path.suffix not in (".json", ".yaml", ".yml"):
            continue
        if any(part.startswith(".") or part == "rootfs" for part in path.parts):
            continue
        found.append(name)
    return sorted(found)


def test_the_supervisor_finds_exactly_one_addon() -> None:
    candidates = supervisor_candidates()
    assert "addon/config.yaml" in candidates
    for name in candidates:
        if name == "addon/config.yaml":
            continue
        # Any other config.* (the server's config.yaml at the root) must fail the manifest schema:
        # the Supervisor then logs "Can't read <path>: ..." as a warning and skips it.
        document = load_yaml(ROOT / name) if name.endswith((".yaml", ".yml")) else None
        assert not isinstance(document, dict) or schema_errors("config.schema.json", document), (
            f"{name} would be taken for a second add-on"
        )


def test_docs_cover_every_option_and_the_user_folders(config: dict[str, Any]) -> None:
    docs = (ADDON / "DOCS.md").read_text()
    for key in config["schema"]:
        assert f"### Option: `{key}`" in docs, key
    for text in ("/share/cosyvoice/voices", "/share/cosyvoice/models", "/data/models",
                 "1.8 GB", "Troubleshooting"):  # fmt: skip
        assert text in docs, text


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_icon_and_logo() -> None:
    assert png_size(ADDON / "icon.png") == (128, 128)
    width, height = png_size(ADDON / "logo.png")
    assert 200 <= width <= 300 and 80 <= height <= 125


# --- end to end: the add-on's start logic → real server → audio over TCP ------------------------


async def describe_and_synthesize(port: int) -> tuple[Any, bytes, int]:
    from wyoming.audio import AudioChunk, AudioStart, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.info import Describe, Info
    from wyoming.tts import Synthesize

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Describe().event())
        while not Info.is_type((event := await client.read_event()).type):
            pass
        info = Info.from_event(event)
    audio, rate = b"", 0
    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(Synthesize(text="你好。Hello.").event())
        while True:
            event = await asyncio.wait_for(client.read_event(), timeout=120)
            assert event is not None, "connection closed before audio-stop"
            if AudioStart.is_type(event.type):
                rate = AudioStart.from_event(event).rate
            elif AudioChunk.is_type(event.type):
                audio += AudioChunk.from_event(event).audio
            elif AudioStop.is_type(event.type):
                break
    return info, audio, rate


@pytest.fixture
def failing_supervisor() -> Iterator[StandInSupervisor]:
    """A Supervisor that answers the discovery with an error."""
    server = StandInSupervisor("the-token", "server-error")
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.long
def test_addon_start_logic_serves_audio_when_discovery_fails_and_stops_on_sigterm(
    tmp_path: Path, failing_supervisor: StandInSupervisor
) -> None:
    """The image's command, as the container runs it, but on free ports: the options, the
    folders, the discovery (refused: the server serves all the same and the log says so),
    speech, the page, the health check, and SIGTERM → exit code 0."""
    data, share = tmp_path / "data", tmp_path / "share/cosyvoice"
    # The layout the mapping expects: downloads and cached models in /data/models/<Model>/.
    shutil.copytree(DATA / "tiny_model", data / "models/CosyVoice-300M-SFT")
    options = {**load_yaml(ADDON / "config.yaml")["options"], "threads": 1, "seed": 0}
    (data / "options.json").write_text(json.dumps(options))
    port, http_port = free_port(), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1",  # the model is there: nothing to download
           "SUPERVISOR_TOKEN": "the-token"}  # fmt: skip
    log_path = tmp_path / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "wyoming_cosyvoice.addon_start",
             "--options", str(data / "options.json"), "--data-dir", str(data),
             "--share-dir", str(share), "--uri", f"tcp://127.0.0.1:{port}",
             "--http-port", str(http_port), "--supervisor-url", failing_supervisor.url],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        try:
            wait_for_port(port, process, timeout=240)
            wait_for_port(http_port, process)  # the HTTP server starts after the Wyoming one
            assert (share / "voices").is_dir()  # created for users to drop custom voices into
            info, audio, rate = asyncio.run(describe_and_synthesize(port))
            assert failing_supervisor.received.wait(timeout=60)
        except AssertionError:
            process.terminate()
            process.wait(timeout=30)
            server_log = log_path.read_text(errors="replace")
            raise AssertionError(f"server log:\n{server_log[-4000:]}") from None
        assert info.tts and info.tts[0].installed and info.tts[0].voices
        assert rate == 22050 and len(audio) > 0
        (request,) = failing_supervisor.requests
        assert (
            json.loads(request["body"])["config"]["uri"] == f"tcp://{socket.gethostname()}:{port}"
        )
        # the web page (ingress) with its voice maker, saving into the voices folder
        maker = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http_port}/voices/maker",
                                                  timeout=30).read())  # fmt: skip
        assert maker["voices_folder"] is True and maker["saving"] is True
        result = run_healthcheck(port)
        assert result.returncode == 0, result.stderr
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    server_log = log_path.read_text(errors="replace")
    assert code == 0, server_log[-4000:]
    assert "Home Assistant was not told about this server" in server_log
    assert "500 Internal Server Error" in server_log
    assert "Sent discovery information" not in server_log
