"""The server's benchmark: the engine's runs with the server's profiles, and K simultaneous
requests through a server started by the benchmark's own launcher (which fixes the number of
speech tokens per sentence; the public command line has no such option)."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from conftest import ROOT
from test_bench import TINY_MODEL, run_bench_json

from engine.bench.profiles import BUILTIN_PROFILES
from engine.core.constants import SAMPLE_RATE
from engine.core.cpu import bf16_native, detect
from wyoming_cosyvoice.bench import server as launcher
from wyoming_cosyvoice.bench.__main__ import main as bench_main
from wyoming_cosyvoice.bench.concurrency import server_command
from wyoming_cosyvoice.bench.profiles import server_profiles
from wyoming_cosyvoice.config import load_config

TOKENS_PER_S = 50  # speech tokens per second of audio


def config_with_exact_int8(tmp_path: Path) -> Path:
    """The repository's config.yaml plus a profile with the exact steps and guidance but an
    int8 flow and bf16 HiFT: only a comparison with the float32 models shows a deviation."""
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["profiles"]["exact_int8"] = {
        **config["profiles"]["realtime"],
        "flow_weights": "int8",
        "hift_weights": "bf16",
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_the_profiles_are_the_server_configs(tmp_path: Path) -> None:
    profiles = server_profiles(config_with_exact_int8(tmp_path))
    exact_int8 = profiles["exact_int8"]
    assert (exact_int8.n_timesteps, exact_int8.cfg_rate) == (10, 0.7)
    assert (exact_int8.flow_weights, exact_int8.hift_weights) == ("int8", "bf16")
    assert exact_int8.source.endswith("config.yaml")
    fastest = server_profiles()["fastest"]  # the repository's own
    assert (fastest.n_timesteps, fastest.cfg_rate, fastest.flow_weights) == (1, 0.7, "int8")
    assert fastest.solver == "euler"


def test_the_engines_own_profiles_are_the_servers_of_those_names() -> None:
    # python -m engine.bench cannot read the server's settings: its realtime and quality must
    # measure what a server with its default settings runs under those names.
    server = server_profiles()
    for name, profile in BUILTIN_PROFILES.items():
        assert replace(profile, source="config.yaml") == server[name], name


def test_each_profile_is_measured_in_the_formats_its_server_loads(tmp_path: Path) -> None:
    config = config_with_exact_int8(tmp_path)
    fp32_lm = tmp_path / "fp32_lm.yaml"
    fp32_lm.write_text(yaml.safe_dump({"server": {"lm_weights": "fp32"}}))
    for source in (None, config, fp32_lm):
        for name, profile in server_profiles(source).items():
            loaded = load_config(source, [("server.profile", name)]).load.weights
            formats = {"lm": loaded.lm, "flow": loaded.flow, "hift": loaded.hift}
            assert profile.weight_formats() == formats, name
    # The default: each profile's own LM format (test_config holds which); the server's
    # override: one for all.
    own = {name: p.lm_weights for name, p in load_config(None).profiles.items()}
    assert {n: p.lm_weights for n, p in server_profiles().items()} == own
    assert set(own.values()) == {"int8", "int4"}
    assert {p.lm_weights for p in server_profiles(fp32_lm).values()} == {"fp32"}


def test_an_unknown_profile_lists_the_servers(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["--model-dir", str(TINY_MODEL), "--profile", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown profile 'nope'" in err and "fastest" in err


def test_the_launcher_fixes_the_token_count() -> None:
    argv = ["--model-dir", str(TINY_MODEL), "--profile", "fastest", "--threads", "1"]
    config = launcher.server_config(*launcher.parse_args(["--force-tokens", "7", *argv]))
    assert config.force_tokens == 7
    assert (config.profile.name, config.threads) == ("fastest", 1)  # the server's own options
    until_eos = launcher.server_config(*launcher.parse_args(argv))
    assert until_eos.force_tokens is None


@pytest.mark.parametrize("count", ["0", "-3", "many"])
def test_the_launcher_rejects_a_token_count_that_is_not_positive(
    count: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        launcher.main(["--force-tokens", count, "--model-dir", str(TINY_MODEL)])
    assert exit_info.value.code == 2
    assert "--force-tokens: must be a positive integer" in capsys.readouterr().err


def test_the_launcher_reads_the_http_options_as_the_server_does() -> None:
    def http(*argv: str) -> object:
        return launcher.http_settings(launcher.parse_args(list(argv))[0])

    assert http("--force-tokens", "5") is None  # Wyoming only
    assert http("--http-port", "8080", "--http-host", "127.0.0.1") == (
        "127.0.0.1",
        8080,
        False,
        (),
    )
    with pytest.raises(ValueError, match="--http-only needs --http-port"):
        http("--http-only")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--http-only"], "--http-only needs --http-port"),
        (["--http-port", "8080", "--http-allow-origin", "ftp:/x"], "--http-allow-origin"),
        (["--set", "server.samples_per_chunk=0"], "server.samples_per_chunk"),
    ],
)
def test_the_launcher_says_what_is_wrong_with_a_setting(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launcher.main(["--force-tokens", "5", "--model-dir", str(TINY_MODEL), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith(launcher.PROG) and message in err


def test_the_benchmark_starts_its_server_through_the_launcher() -> None:
    command = server_command(TINY_MODEL, 10300, profile="fast", threads=2, tokens=30)
    assert command[1:5] == ["-m", "wyoming_cosyvoice.bench.server", "--force-tokens", "30"]
    assert "tcp://127.0.0.1:10300" in command
    assert command[command.index("cache.max_mb=0") - 1] == "--set"  # no replayed repeats
    until_eos = server_command(TINY_MODEL, 10300, profile="fast", threads=None, tokens=None)
    assert "--force-tokens" not in until_eos


@pytest.mark.long
def test_concurrency_through_the_server() -> None:
    tokens = 30
    result = run_bench_json(
        "--text",
        "Hello.",
        "--tokens",
        str(tokens),
        "--concurrency",
        "1,2",
        timeout=600,
        module="wyoming_cosyvoice.bench",
    )
    assert [level["concurrency"] for level in result["levels"]] == [1, 2]
    for level in result["levels"]:
        assert len(level["requests"]) == level["concurrency"]
        assert all(r["first_audio_ms"] for r in level["requests"])
        # One sentence of exactly `tokens` speech tokens each: the launcher's fixed count.
        expected_s = tokens / TOKENS_PER_S
        assert [r["audio_s"] for r in level["requests"]] == pytest.approx(
            [expected_s] * level["concurrency"], abs=2 * 256 / SAMPLE_RATE
        )
        assert level["aggregate_audio_s_per_s"] > 0
        assert level["server_cpu_s_per_audio_s"] > 0
    assert result["tokens"] == tokens


@pytest.mark.slow
def test_benchmark_loads_the_profiles_int8_flow_and_reports_its_deviation(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    model = tmp_path / "tiny_model"  # a copy: its prepared files are written beside it
    shutil.copytree(TINY_MODEL, model, ignore=shutil.ignore_patterns("prepared"))
    result = run_bench_json(
        "--model-dir",
        str(model),
        "--profile",
        "exact_int8",
        "--config",
        str(config_with_exact_int8(tmp_path)),
        "--tokens",
        "30",
        "--repeats",
        "2",
        timeout=1800,
        env=env,
        module="wyoming_cosyvoice.bench",
    )
    assert (result["flow_weights"], result["lm_weights"]) == ("int8", "int8")
    assert result["cpu"] == detect().as_dict()  # the kernels and threads the engine chose
    assert [run["flow_int8_cache_hit"] for run in result["runs"]] == [False, True]
    assert 0 < result["mel_rel_l2_vs_exact"] < 0.05
    hift = "bf16" if bf16_native() else "fp32"
    if bf16_native():  # else HiFT stays float32, and says so
        assert result["hift_weights"] == "bfloat16"
        assert 0 < result["wave_rel_l2_vs_exact_hift"] < 0.05
    else:
        assert (result["hift_weights"], result["wave_rel_l2_vs_exact_hift"]) == ("float32", 0)
    # The first run prepared the int8 weights, the second read them (engine.core.prepared).
    prepared = sorted(p.name for p in (model / "prepared").iterdir())
    assert prepared == ["flow.int8.safetensors", f"hift.{hift}.safetensors", "llm.int8.safetensors"]
