"""config.yaml, its profiles and overrides; every bad value names its key."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from engine.core.types import LOW_LATENCY_SCHEDULE, OFFICIAL_SCHEDULE
from wyoming_cosyvoice.__main__ import build_parser, config_from_args
from wyoming_cosyvoice.config import (
    ConfigError,
    ProfileNotLoadedError,
    UnknownProfileError,
    load_config,
    packaged_settings,
    parse_override,
)

REPO_CONFIG = ROOT / "config.yaml"


def cli(*argv: str):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_the_server_reads_the_repositorys_config_yaml() -> None:
    assert yaml.safe_load(REPO_CONFIG.read_text()) == packaged_settings()
    assert load_config().limits.max_text_chars == packaged_settings()["limits"]["max_text_chars"]


@pytest.mark.long
@pytest.mark.timeout(900)  # the install compiles the engine's kernels: minutes on a slow CPU
def test_an_installed_package_reads_the_same_config_yaml(tmp_path: Path) -> None:
    """What the add-on image copies and pip-installs (not editable) reads the file that the
    root config.yaml is: a value changed there is the installed server's value."""
    from test_release import package_copies

    source, site = tmp_path / "src", tmp_path / "site"
    source.mkdir()
    for copied in package_copies():
        if copied.startswith("addon/"):
            continue  # the image's own files, not the package
        if (ROOT / copied).is_dir():
            shutil.copytree(ROOT / copied, source / copied,
                            ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
        else:
            shutil.copy(ROOT / copied, source / copied)
    settings = source / REPO_CONFIG.resolve().relative_to(ROOT)
    limit = packaged_settings()["limits"]["max_text_chars"]
    settings.write_text(
        REPO_CONFIG.read_text().replace(f"max_text_chars: {limit}", "max_text_chars: 1234")
    )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(source)],
        check=True, capture_output=True, timeout=840,
    )  # fmt: skip
    script = (
        "import json, wyoming_cosyvoice.config as c; "
        "print(json.dumps([c.__file__, c.packaged_settings(), "
        "c.load_config().limits.max_text_chars]))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    where, values, limit = json.loads(done.stdout)
    assert Path(where).is_relative_to(site)  # the installed copy, not this checkout
    assert values == yaml.safe_load(settings.read_text()) and limit == 1234


def test_root_config_yaml_is_not_an_addon_manifest() -> None:
    document = yaml.safe_load(REPO_CONFIG.read_text())
    assert not {"name", "slug", "version", "arch", "description"} & set(document)


def test_profiles() -> None:
    config = load_config()
    assert config.profile.name == "auto"  # choosing among realtime, fast and fastest
    realtime, quality, batch = (config.profiles[n] for n in ("realtime", "quality", "batch"))
    assert realtime.streaming and realtime.stream_audio
    assert realtime.schedule.first_hop == 21 < OFFICIAL_SCHEDULE.first_hop
    assert realtime.schedule == replace(LOW_LATENCY_SCHEDULE, paced=True)
    assert quality.schedule == OFFICIAL_SCHEDULE and quality.streaming
    assert not batch.streaming and not batch.stream_audio


def test_flags_override_the_file() -> None:
    config = cli(
        "--uri", "tcp://127.0.0.1:1234", "--voice", "en-male", "--profile", "quality",
        "--threads", "2", "--samples-per-chunk", "512", "--zeroconf", "--seed", "7",
        "--data-dir", "a", "--data-dir", "b", "--download-dir", "c", "--debug",
        "--model-dir", "m", "--hub-endpoint", "http://127.0.0.1:9", "--offline",
    )  # fmt: skip
    assert config.uri == "tcp://127.0.0.1:1234" and config.voice == "en-male"
    assert config.profile.name == "quality" and config.threads == 2
    assert config.samples_per_chunk == 512 and config.zeroconf == "cosyvoice" and config.seed == 7
    assert config.data_dirs == (Path("a"), Path("b")) and config.effective_download_dir == Path("c")
    assert config.model_dir == Path("m") and config.debug and config.offline
    assert config.hub_endpoint == "http://127.0.0.1:9"
    assert cli("--zeroconf", "kitchen").zeroconf == "kitchen"
    assert cli().effective_download_dir == Path("data")  # the first data dir


def test_no_streaming_applies_to_the_selected_profile() -> None:
    assert cli("--no-streaming").profile.streaming is False
    config = cli("--profile", "quality", "--no-streaming")
    assert config.profile.name == "quality" and not config.profile.streaming
    assert config.profiles["realtime"].streaming  # others untouched


def test_every_value_can_be_set_by_dotted_key() -> None:
    config = cli(
        "--set", "limits.max_text_chars=100",
        "--set", "profiles.realtime.schedule.first_hop=10",
        "--set", "profiles.realtime.n_timesteps=5",
        "--set", "server.warmup=false",
    )  # fmt: skip
    assert config.limits.max_text_chars == 100
    assert config.profile.schedule.first_hop == 10 and config.profile.schedule.max_hop == 100
    assert config.profile.n_timesteps == 5 and config.warmup is False
    paced = cli("--set", "profiles.realtime.schedule.paced=false").profile.schedule
    assert paced.paced is False and paced.first_hop == 21
    # a dedicated flag beats --set
    assert cli("--set", "server.voice=a", "--voice", "b").voice == "b"


def test_custom_profile_in_a_config_file(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("server: {profile: fast}\nprofiles:\n  fast: {schedule: {first_hop: 15}}\n")
    config = load_config(path)
    assert config.profile.name == "fast" and config.profile.schedule.first_hop == 15
    assert config.profile.schedule.growth == LOW_LATENCY_SCHEDULE.growth  # defaults fill in
    assert "realtime" in config.profiles  # the built-in profiles stay available


def test_a_new_profile_names_every_setting(tmp_path: Path) -> None:
    path = tmp_path / "server.yaml"
    path.write_text("profiles:\n  mine: {n_timesteps: 3}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "profiles.mine" and "missing: streaming" in str(err.value)
    without_lm = {k: v for k, v in packaged_settings()["profiles"]["fast"].items()
                  if k != "lm_weights"}  # fmt: skip
    path.write_text(yaml.safe_dump({"profiles": {"mine": without_lm}}))
    with pytest.raises(ConfigError, match="missing: lm_weights"):
        load_config(path)
    realtime = packaged_settings()["profiles"]["realtime"]
    path.write_text(yaml.safe_dump({"profiles": {"mine": {**realtime, "n_timesteps": 3}}}))
    assert load_config(path).profiles["mine"].n_timesteps == 3


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("limits.max_text_chars", -1, "limits.max_text_chars"),
        ("limits.max_text_chars", "many", "limits.max_text_chars"),
        ("limits.idle_timeout_s", 0, "limits.idle_timeout_s"),
        ("limits.max_headers", 5, "limits.max_headers"),
        ("server.samples_per_chunk", 0, "server.samples_per_chunk"),
        ("server.threads", True, "server.threads"),
        ("server.threads", -1, "server.threads"),
        ("server.hub_endpoint", "hf-mirror.com", "server.hub_endpoint"),
        ("server.profile", "ludicrous", "server.profile"),
        ("server.uri", "http://x:1", "server.uri"),
        ("server.voices", "x", "server.voices"),
        ("server.data_dirs", [], "server.data_dirs"),
        ("server.warmup", "yes", "server.warmup"),
        ("profiles.realtime.schedule", "fastest", "profiles.realtime.schedule"),
        ("profiles.realtime.schedule.first_hop", 0, "profiles.realtime.schedule.first_hop"),
        ("profiles.realtime.schedule.max_hop", 5, "profiles.realtime.schedule.max_hop"),
        ("profiles.realtime.schedule.hop", 5, "profiles.realtime.schedule.hop"),
        ("profiles.realtime.schedule.paced", "yes", "profiles.realtime.schedule.paced"),
        ("profiles.realtime.cfg_rate", -1, "profiles.realtime.cfg_rate"),
        ("profiles.realtime.streaming", "no", "profiles.realtime.streaming"),
        ("profiles.realtime.speed", 2, "profiles.realtime.speed"),
        ("profiles.realtime.start_policy", "later", "profiles.realtime.start_policy"),
        ("server.lm_weights", "int2", "server.lm_weights"),
        ("profiles.fast.lm_weights", "profile", "profiles.fast.lm_weights"),
        ("profiles.fast.flow_weights", "int4", "profiles.fast.flow_weights"),
        ("profiles.batch", 3, "profiles.batch"),
        ("extras", 1, "extras"),
    ],
)
def test_bad_values_name_the_key(key: str, value: object, named: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [(key, value)])
    assert err.value.key == named
    assert f"'{named}'" in str(err.value)


def test_threads_0_is_every_core_and_an_earlier_null_still_is(tmp_path: Path) -> None:
    assert packaged_settings()["server"]["threads"] == 0
    assert load_config().threads is None  # the engine's "no cap"
    assert cli("--threads", "0").threads is None and cli("--threads", "3").threads == 3
    saved = tmp_path / "server.yaml"  # as settings.yaml said it before 0
    saved.write_text("server:\n  threads: null\n")
    assert load_config(saved).threads is None


def test_settings_yaml_is_the_only_home_of_a_default() -> None:
    """No dataclass field repeats (or contradicts) a settings.yaml default; the server section's
    keys are ServerConfig's setting fields."""
    from wyoming_cosyvoice import config as module

    classes = (module.ServerConfig, module.CacheConfig, module.Limits, module.AutoSettings,
               module.ProfileConfig, module.LoadSettings)  # fmt: skip
    with_defaults = [f"{c.__name__}.{f.name}" for c in classes for f in dataclasses.fields(c)
                     if f.default is not dataclasses.MISSING]  # fmt: skip
    assert with_defaults == ["ServerConfig.force_tokens"]  # set by benchmarks, not a setting
    settings = {f.name for f in dataclasses.fields(module.ServerConfig)} - {
        "limits", "profiles", "cache", "auto", "force_tokens"
    }  # fmt: skip
    assert settings == set(packaged_settings()["server"])


def test_a_hub_endpoint_is_an_http_url_without_its_last_slash() -> None:
    assert cli("--hub-endpoint", "https://hf-mirror.com/").hub_endpoint == "https://hf-mirror.com"


def test_bad_files(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("server: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad_yaml)
    a_list = tmp_path / "list.yaml"
    a_list.write_text("- 1\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(a_list)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("novalue")


def test_cli_exits_with_a_message_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("limits:\n  max_text_chars: lots\n")
    result = subprocess.run(
        [sys.executable, "-m", "wyoming_cosyvoice", "--config", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "limits.max_text_chars" in result.stderr and "integer" in result.stderr


def test_load_settings_come_from_the_servers_own_profile() -> None:
    config = load_config(None, [("server.profile", "fast"), ("server.lm_weights", "fp32")])
    load = config.load
    assert (load.weights.lm, load.weights.flow, load.weights.hift) == ("fp32", "int8", "int8")
    assert (load.threads, load.parallel_sentences, load.warmup) == (None, 1, True)
    own = load_config(None, [("server.profile", "fast")]).load.weights
    assert (own.lm, own.extra) == ("int4", ())


def test_the_fast_profiles_run_the_int4_lm_and_the_exact_ones_int8() -> None:
    config = load_config(None)
    assert config.lm_weights == "profile"  # the default: each profile's own
    assert {name: p.lm_weights for name, p in config.profiles.items()} == {
        "realtime": "int8",
        "fast": "int4",
        "faster": "int4",
        "fastest": "int4",
        "quality": "int8",
        "batch": "int8",
    }


@pytest.mark.parametrize("lm", ["int8", "int4", "fp32"])
def test_the_server_lm_weights_apply_to_every_profile(lm: str) -> None:
    for profile in ("auto", "realtime", "fastest"):
        config = load_config(None, [("server.lm_weights", lm), ("server.profile", profile)])
        assert {p.lm_weights for p in config.profiles.values()} == {lm}
        assert config.profile.lm_weights == config.load.weights.lm == lm
        assert not [e for e in config.load.weights.extra if e.startswith("llm.")]
        options = config.profiles["fast"].options(
            speaker=None, seed=None, instruct=None, force_tokens=None
        )
        assert options.lm_weights == lm


def test_the_lm_weights_flag_is_the_override() -> None:
    assert {p.lm_weights for p in cli("--lm-weights", "int8").profiles.values()} == {"int8"}
    own = cli("--lm-weights", "profile").profiles
    assert (own["realtime"].lm_weights, own["faster"].lm_weights) == ("int8", "int4")


def test_auto_loads_the_int4_lm_beside_its_own_int8_one() -> None:
    weights = load_config(None).load.weights  # auto: realtime's formats first
    assert (weights.lm, weights.flow, weights.hift) == ("int8", "fp32", "fp32")
    assert weights.extra == ("flow.int8", "hift.int8", "llm.int4")
    assert weights.holds("llm", "int8") and weights.holds("llm", "int4")
    assert not weights.holds("llm", "fp32")
    # Its candidates all int8: one LM.
    int8 = load_config(
        None, [(f"profiles.{n}.lm_weights", "int8") for n in ("fast", "faster", "fastest")]
    )
    assert int8.load.weights.extra == ("flow.int8", "hift.int8")
    # The fast ones first: int4 primary, int8 the extra.
    fast_first = load_config(None, [("auto.profiles", ["fastest", "realtime"])]).load.weights
    assert (fast_first.lm, fast_first.extra) == ("int4", ("flow.fp32", "hift.fp32", "llm.int8"))


def test_the_engine_loader_gets_autos_lm_formats() -> None:
    from wyoming_cosyvoice.models.model import engine_loader

    keywords = engine_loader(load_config(None)).keywords
    assert (keywords["lm_int8"], keywords["lm_int4"]) == (True, False)
    assert "llm.int4" in keywords["extra_formats"]


def test_a_requests_options_carry_its_profiles_lm_format() -> None:
    config = load_config(None)
    for name, lm in (("realtime", "int8"), ("fastest", "int4"), ("quality", "int8")):
        profile = config.request_profile(name)
        options = profile.options(speaker=None, seed=None, instruct=None, force_tokens=None)
        assert options.lm_weights == lm, name


def test_a_profile_whose_lm_is_not_loaded_is_refused() -> None:
    """Same flow and HiFT formats, another LM: refused, naming the LM."""
    config = load_config(None, [("server.profile", "fast"), ("profiles.faster.lm_weights", "fp32")])
    assert config.servable_profiles == ["fast", "fastest"]
    with pytest.raises(ProfileNotLoadedError) as err:
        config.request_profile("faster")
    assert "'faster' needs the LM in fp32, the flow in int8 and HiFT in int8" in str(err.value)
    assert "this server loaded the LM in int4, the flow in int8" in str(err.value)


def test_a_request_may_name_only_a_profile_whose_weights_are_loaded() -> None:
    realtime = load_config(None, [("server.profile", "realtime")])
    assert realtime.servable_profiles == ["realtime", "quality", "batch"]
    assert realtime.request_profile(None).name == "realtime"
    assert realtime.request_profile("batch").name == "batch"
    with pytest.raises(ProfileNotLoadedError) as err:
        realtime.request_profile("fastest")
    assert "'fastest' needs the LM in int4, the flow in int8 and HiFT in int8" in str(err.value)
    assert "start it with --profile fastest" in str(err.value)
    with pytest.raises(UnknownProfileError, match="unknown profile 'turbo'"):
        realtime.request_profile("turbo")
    assert load_config(None, [("server.profile", "fastest")]).servable_profiles == [
        "fast",
        "faster",
        "fastest",
    ]


def test_profile_options_carry_every_setting() -> None:
    config = load_config(None, [("profiles.fast.start_policy", "gapless")])
    fast = config.profiles["fast"]
    options = fast.options(speaker="x", seed=3, instruct=None, force_tokens=7)
    assert (options.n_timesteps, options.start_policy, options.seed) == (5, "gapless", 3)
    assert (options.lm_weights, options.flow_weights, options.hift_weights) == (
        "int4",
        "int8",
        "int8",
    )
    assert options.schedule == fast.schedule and options.stream is fast.stream_audio


def test_exact_profiles_keep_the_float_flow_and_fast_ones_use_int8() -> None:
    profiles = load_config(None).profiles
    weights = {name: profile.flow_weights for name, profile in profiles.items()}
    assert weights == {
        "realtime": "fp32",
        "fast": "int8",
        "faster": "int8",
        "fastest": "int8",
        "quality": "fp32",
        "batch": "fp32",
    }


def test_only_the_fast_profiles_run_an_int8_hift() -> None:
    profiles = load_config(None).profiles
    weights = {name: profile.hift_weights for name, profile in profiles.items()}
    assert weights == {
        "realtime": "fp32",
        "fast": "int8",
        "faster": "int8",
        "fastest": "int8",
        "quality": "fp32",
        "batch": "fp32",
    }
    with pytest.raises(ConfigError) as err:
        load_config(None, [("profiles.fastest.hift_weights", "fp16")])
    assert err.value.key == "profiles.fastest.hift_weights"


@pytest.mark.parametrize(
    ("profile", "flow_int8", "hift_int8"),
    [
        ("realtime", False, False),
        ("fast", True, True),
        ("faster", True, True),
        ("fastest", True, True),
        ("batch", False, False),
    ],
)
def test_the_server_loads_the_weight_formats_its_profile_names(
    profile: str, flow_int8: bool, hift_int8: bool
) -> None:
    from wyoming_cosyvoice.models.model import engine_loader

    loader = engine_loader(load_config(None, [("server.profile", profile)]))
    assert loader.keywords["flow_int8"] is flow_int8
    assert loader.keywords["hift_int8"] is hift_int8
    assert loader.keywords["hift_bf16"] is False
    assert loader.keywords["lm_int8"] is (profile in ("realtime", "batch"))  # its own format
    assert loader.keywords["lm_int4"] is (profile not in ("realtime", "batch"))
