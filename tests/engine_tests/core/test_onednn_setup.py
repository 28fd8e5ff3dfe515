"""oneDNN's process-wide settings at load: its primitive cache bounded, and on a CPU with AMX the
int8 HiFT's loads kept below AMX (engine.core.runtime.configure_onednn).

oneDNN reads them once, at its first query or primitive, so the order is what is tested: they
are in the environment before the load's first CPU probe and its int8 convolution check.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from engine.core import cpu, runtime

ONEDNN_NAMES = (
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY",
    "DNNL_PRIMITIVE_CACHE_CAPACITY",
)


@pytest.fixture
def clean_onednn_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """None of oneDNN's variables set; whatever the test sets is removed after it."""
    for name in ONEDNN_NAMES:
        monkeypatch.setenv(name, "")  # recorded as absent, so undone after the test
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(
    ("int8_hift", "bf16", "amx", "cap"),
    [
        (True, False, True, "AVX512_CORE_BF16"),
        (True, True, True, None),  # bfloat16 wants AMX
        (False, False, True, None),  # nothing of ours JIT-compiles per length on AMX
        (True, False, False, None),  # no AMX to keep away from
    ],
)
def test_only_an_int8_hift_load_without_bfloat16_is_capped_below_amx(
    int8_hift: bool, bf16: bool, amx: bool, cap: str | None
) -> None:
    assert runtime.onednn_isa_cap(int8_hift=int8_hift, bf16=bf16, amx=amx) == cap


def _record_env_at(
    seen: dict[str, dict[str, str]], name: str, result: object
) -> Callable[..., object]:
    """A stand-in for a probe: notes oneDNN's variables when called, returns ``result``."""

    def probe(*_args: object, **_kwargs: object) -> object:
        seen[name] = {key: os.environ[key] for key in ONEDNN_NAMES if key in os.environ}
        return result

    return probe


def test_the_settings_are_in_place_before_the_cpu_probes_and_the_int8_check(
    clean_onednn_env: pytest.MonkeyPatch,
) -> None:
    seen: dict[str, dict[str, str]] = {}
    clean_onednn_env.setattr(cpu, "has_amx", lambda: True)
    clean_onednn_env.setattr(cpu, "detect", _record_env_at(seen, "detect", cpu.detect()))
    clean_onednn_env.setattr(runtime, "int8_hift_fast", _record_env_at(seen, "int8", True))

    setup = runtime.setup_cpu(1, lm_int8=False, flow_int8=False, hift_bf16=False, hift_int8=True)

    assert setup.formats.hift == "int8"
    expected = {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": runtime._ONEDNN_CACHE_CAPACITY,
    }
    assert seen == {"detect": expected, "int8": expected}


def test_an_extra_int8_hift_counts_and_an_extra_bfloat16_format_keeps_amx(
    clean_onednn_env: pytest.MonkeyPatch,
) -> None:
    clean_onednn_env.setattr(cpu, "has_amx", lambda: True)
    runtime.setup_cpu(
        1, lm_int8=False, flow_int8=False, hift_bf16=False, extra_formats=("hift.int8",)
    )
    assert os.environ["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"

    os.environ.pop("ONEDNN_MAX_CPU_ISA")
    runtime.setup_cpu(
        1,
        lm_int8=False,
        flow_int8=False,
        hift_bf16=False,
        extra_formats=("hift.int8", "flow.bf16"),
    )
    assert "ONEDNN_MAX_CPU_ISA" not in os.environ


@pytest.mark.parametrize("name", ["ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"])
def test_the_users_own_settings_stand(clean_onednn_env: pytest.MonkeyPatch, name: str) -> None:
    clean_onednn_env.setattr(cpu, "has_amx", lambda: True)
    clean_onednn_env.setenv(name, "AVX512_CORE_AMX")
    clean_onednn_env.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "1024")
    runtime.configure_onednn(int8_hift=True, bf16=False)
    assert os.environ[name] == "AVX512_CORE_AMX"
    assert {key for key in ONEDNN_NAMES if key in os.environ} == {
        name,
        "DNNL_PRIMITIVE_CACHE_CAPACITY",
    }
