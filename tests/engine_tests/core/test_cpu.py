"""What the engine picks for the CPU by itself: int8 kernels, bfloat16, the thread ceiling.

The Arm machines are described as the boards' kernels describe them (/proc/cpuinfo, torch's
list of quantized engines); script/test-aarch64 runs the same choices on emulated Arm CPUs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY_MODEL, FakeEngine, synthesize_all

from engine.core import cpu
from engine.core.types import SynthesisOptions
from engine.cosyvoice1.engine import CosyVoiceEngine

PI5_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm \
lrcpc dcpop asimddp
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x4
CPU part\t: 0xd0b
CPU revision\t: 1

Model\t\t: Raspberry Pi 5 Model B Rev 1.0
"""
PI4_CPUINFO = """\
processor\t: 0
BogoMIPS\t: 108.00
Features\t: fp asimd evtstrm crc32 cpuid
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x0
CPU part\t: 0xd08
CPU revision\t: 3

Model\t\t: Raspberry Pi 4 Model B Rev 1.4
"""
X86_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse sse2 avx2 avx512f\n"
# torch's list on the aarch64 wheel: x86 and fbgemm are listed (x86 is the default) but cannot
# pack there ("unknown architecure").
ARM_ENGINES = ["qnnpack", "onednn", "x86", "fbgemm"]


@pytest.fixture(autouse=True)
def _restore_torch_settings(single_torch_thread: None) -> Iterator[None]:
    before = torch.backends.quantized.engine
    yield
    torch.backends.quantized.engine = before
    torch.set_num_threads(1)


def board(monkeypatch: pytest.MonkeyPatch, machine: str, cpuinfo: str) -> None:
    monkeypatch.setattr(cpu.platform, "machine", lambda: machine)
    monkeypatch.setattr(cpu, "read_cpuinfo", lambda: cpuinfo)


# --- int8 kernels ---------------------------------------------------------------------------


def test_on_arm_the_engine_picks_qnnpack_over_the_default_that_cannot_pack(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu, "supported_engines", lambda: ARM_ENGINES)
    monkeypatch.setattr(cpu, "int8_engine_works", lambda name: name in ("qnnpack", "onednn"))
    torch.backends.quantized.engine = "x86"  # torch's default on aarch64
    assert cpu.choose_int8_engine() == "qnnpack"


@pytest.mark.parametrize(
    ("current", "expect"),
    [
        ("x86", "x86"),  # torch's default on x86 works: kept
        ("qnnpack", "qnnpack"),  # set by the caller and working: kept
        ("onednn", "x86"),  # its fused ReLU is not ReLU after the layer: never chosen
    ],
)
def test_the_engine_in_force_is_kept_when_it_works(
    monkeypatch: pytest.MonkeyPatch, current: str, expect: str
) -> None:
    monkeypatch.setattr(cpu, "supported_engines", lambda: ["qnnpack", "onednn", "x86", "fbgemm"])
    monkeypatch.setattr(cpu, "int8_engine_works", lambda name: True)
    torch.backends.quantized.engine = current
    assert cpu.choose_int8_engine() == expect


def test_no_int8_kernels_when_none_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "int8_engine_works", lambda name: False)
    assert cpu.choose_int8_engine() is None


def test_the_kernel_check_packs_and_runs_a_layer_here() -> None:
    engines = torch.backends.quantized.supported_engines
    assert any(cpu.int8_engine_works(name) for name in cpu.INT8_ENGINES if name in engines)
    assert not cpu.int8_engine_works("none")  # torch has no int8 kernels under that name


def test_the_engine_loads_int8_with_the_kernels_it_picked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # As on aarch64: the default engine cannot pack, so loading int8 must switch to qnnpack.
    monkeypatch.setattr(cpu, "int8_engine_works", lambda name: name == "qnnpack")
    torch.backends.quantized.engine = "x86"
    engine = CosyVoiceEngine.load(TINY_MODEL, lm_int8=True, flow_int8=True, cache_dir=tmp_path)
    assert torch.backends.quantized.engine == "qnnpack"
    assert engine.cpu_choices is not None and engine.cpu_choices.int8_kernels == "qnnpack"
    options = SynthesisOptions(stream=True, seed=0, force_tokens=30, n_timesteps=2)
    audio = synthesize_all(engine, "Hello there.", options)
    assert audio.numel() > 0 and torch.isfinite(audio).all()


def test_quantising_outside_a_load_also_uses_kernels_that_work_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.core.quantize import int8_linear

    monkeypatch.setattr(cpu, "int8_engine_works", lambda name: name == "qnnpack")
    torch.backends.quantized.engine = "x86"
    layer = int8_linear(torch.randn(8, 16))
    assert torch.backends.quantized.engine == "qnnpack"
    assert layer(torch.randn(2, 16)).shape == (2, 8)


def test_without_int8_kernels_the_engine_runs_float32_and_says_so(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu, "int8_engine_works", lambda name: False)
    with caplog.at_level(logging.WARNING):
        engine = CosyVoiceEngine.load(TINY_MODEL, lm_int8=True, flow_int8=True, cache_dir=tmp_path)
    assert engine.cpu_choices is not None and engine.cpu_choices.int8_kernels is None
    assert "No int8 kernel works on this CPU" in caplog.text
    assert not any(
        isinstance(m, torch.ao.nn.quantized.dynamic.Linear)
        for model in (engine.models.llm, engine.models.flow)
        for m in model.modules()
    )


# --- bfloat16 -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("machine", "mkldnn", "avx512_bf16", "amx", "expect"),
    [
        ("x86_64", True, True, False, True),
        ("x86_64", True, False, True, True),
        ("x86_64", True, False, False, False),  # plain AVX-512: oneDNN would emulate bfloat16
        ("x86_64", False, True, True, False),
        ("aarch64", True, False, False, True),  # Arm: oneDNN's own check is the BF16 extension
        ("aarch64", False, False, False, False),
    ],
)
def test_bfloat16_hift_needs_native_bfloat16(
    monkeypatch: pytest.MonkeyPatch,
    machine: str,
    mkldnn: bool,
    avx512_bf16: bool,
    amx: bool,
    expect: bool,
) -> None:
    monkeypatch.setattr(cpu.platform, "machine", lambda: machine)
    monkeypatch.setattr(
        torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn, raising=False
    )
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    assert cpu.bf16_native() is expect


# --- threads --------------------------------------------------------------------------------


@pytest.fixture
def fresh_ceiling() -> Iterator[None]:
    cpu.thread_ceiling.cache_clear()
    yield
    cpu.thread_ceiling.cache_clear()


@pytest.mark.parametrize(
    ("machine", "cpuinfo", "survives", "expect", "probed"),
    [
        ("aarch64", PI4_CPUINFO, False, 1, True),  # ARMv8.0, the PyPI wheel's BLAS: one thread
        ("aarch64", PI4_CPUINFO, True, None, True),  # a build shown to survive: no ceiling
        ("aarch64", PI5_CPUINFO, False, None, False),  # ARMv8.2 has the atomics: nothing to check
        ("aarch64", "", False, 1, True),  # features unknown: checked like an ARMv8.0
        ("x86_64", X86_CPUINFO, False, None, False),
    ],
)
def test_thread_ceiling(
    monkeypatch: pytest.MonkeyPatch,
    fresh_ceiling: None,
    machine: str,
    cpuinfo: str,
    survives: bool,
    expect: int | None,
    probed: bool,
) -> None:
    board(monkeypatch, machine, cpuinfo)
    asked: list[int] = []
    monkeypatch.setattr(cpu, "threads_survive", lambda n: asked.append(n) or survives)
    assert cpu.thread_ceiling() == expect
    assert cpu.thread_ceiling() == expect  # cached: the check runs once per process
    assert len(asked) == (1 if probed else 0) and all(n >= 2 for n in asked)


def test_the_multi_threaded_check_agrees_with_the_ceiling() -> None:
    # x86 and ARMv8.2: the check's child survives and there is no ceiling; under
    # script/test-aarch64's ARMv8.0 the PyPI wheel's child dies and the ceiling is 1.
    assert cpu.threads_survive(2) is (cpu.thread_ceiling() is None)


def test_a_child_killed_by_sigill_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(
        cpu, "_THREAD_PROBE", "import os, signal\nos.kill(os.getpid(), signal.SIGILL)"
    )
    with caplog.at_level(logging.WARNING):
        assert not cpu.threads_survive(4)
    assert "SIGILL" in caplog.text


@pytest.mark.parametrize(
    ("requested", "ceiling", "expect"),
    [
        (None, None, None),
        (4, None, 4),
        (None, 1, 1),
        (4, 1, 1),
        (1, 2, 1),
    ],
)
def test_capped_threads(requested: int | None, ceiling: int | None, expect: int | None) -> None:
    assert cpu.capped_threads(requested, ceiling) == expect


def test_the_engine_loads_within_the_thread_ceiling(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(cpu, "thread_ceiling", lambda: 1)
    with caplog.at_level(logging.WARNING):
        engine = CosyVoiceEngine.load(TINY_MODEL, threads=2)
    assert torch.get_num_threads() == 1 and engine.threads == 1
    assert engine.cpu_choices is not None and engine.cpu_choices.thread_ceiling == 1
    assert "2 threads asked for; this CPU runs torch on at most 1" in caplog.text
    torch.set_num_threads(2)  # torch's own count, as a server gets when threads are not set
    CosyVoiceEngine.load(TINY_MODEL)
    assert torch.get_num_threads() == 1


def test_choices_on_this_machine_are_logged_and_kept_on_the_engine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="engine"):
        engine = CosyVoiceEngine.load(TINY_MODEL)
    assert engine.cpu_choices == cpu.detect()
    assert engine.cpu_choices.int8_kernels in cpu.INT8_ENGINES
    assert f"CPU {engine.cpu_choices.describe()}" in caplog.text


# --- /health --------------------------------------------------------------------------------


def test_health_shows_the_cpu_choices() -> None:
    from test_http import BackgroundServer

    choices = cpu.CpuChoices(
        machine="aarch64", int8_kernels="qnnpack", bfloat16=False, thread_ceiling=1
    )

    def engine(path: Path, threads: int | None) -> FakeEngine:
        fake = FakeEngine(path, threads)
        fake.cpu_choices = choices  # type: ignore[attr-defined]
        return fake

    with BackgroundServer(engine_factory=engine, wyoming=False) as srv, srv.client() as http:
        health = http.get("/health").json()
    assert health["cpu"] == {
        "machine": "aarch64",
        "int8_kernels": "qnnpack",
        "bfloat16": False,
        "thread_ceiling": 1,
    }
