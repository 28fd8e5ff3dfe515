"""What this CPU and this torch build can run: int8 kernels, native bfloat16, a safe thread count.

* int8 kernels: torch's dynamic int8 Linear packs its weights for one "quantized engine". The
  default is not chosen for the CPU: on aarch64 it is ``x86``, which cannot pack there ("unknown
  architecure"). The engine in force is kept when it packs and computes here; otherwise the first
  of x86, fbgemm and qnnpack that does (aarch64: qnnpack). oneDNN's is never chosen: its fused
  ReLU does not compute ReLU after the layer.
* bfloat16: whether oneDNN computes bfloat16 convolutions natively (the bfloat16 HiFT).
* thread ceiling: the BLAS bundled with PyPI's aarch64 torch wheel uses ARMv8.1 atomics (LSE)
  in its multi-threaded paths, so on an ARMv8.0 CPU without them (Cortex-A72, Raspberry Pi 4)
  the process dies with SIGILL as soon as torch runs on more than one thread. Where /proc/cpuinfo
  does not list ``atomics``, a child process runs a multi-threaded convolution and matrix product
  once: if it survives, the installed build is safe and there is no ceiling, otherwise it is 1.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import signal
import subprocess
import sys
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

_LOGGER = logging.getLogger(__name__)

CPUINFO = Path("/proc/cpuinfo")
# In order of preference after the engine in force (x86 first: the recipe's measured kernels).
INT8_ENGINES = ("x86", "fbgemm", "qnnpack")
ARM_MACHINES = ("aarch64", "arm64")
PROBE_TIMEOUT_S = 300  # a torch import on a slow board (or under emulation) takes a while

# Run in a child: the fault kills the process, so it cannot be caught where it happens.
_THREAD_PROBE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a SIGILL here is expected, not a bug
import torch
torch.set_num_threads(int(sys.argv[1]))
with torch.inference_mode():
    torch.nn.Conv1d(64, 64, 3)(torch.randn(1, 64, 4096))
    a = torch.randn(512, 512)
    a @ a
"""


@dataclass(frozen=True)
class CpuChoices:
    """What the engine runs with on this CPU (shown by the benchmark and the server's /health)."""

    machine: str
    int8_kernels: str | None  # torch's quantized engine; None: none works here (int8 → float32)
    bfloat16: bool  # native bfloat16 convolutions (the bfloat16 HiFT)
    thread_ceiling: int | None  # most torch threads this build survives here; None: no limit

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def describe(self) -> str:
        ceiling = "none" if self.thread_ceiling is None else str(self.thread_ceiling)
        return (
            f"{self.machine}: int8 kernels {self.int8_kernels or 'none (int8 runs float32)'}, "
            f"native bfloat16 {'yes' if self.bfloat16 else 'no'}, thread ceiling {ceiling}"
        )


# --- /proc/cpuinfo -------------------------------------------------------------------------


def read_cpuinfo() -> str:
    try:
        return CPUINFO.read_text(errors="replace")
    except OSError:
        return ""


def arm_features(cpuinfo: str) -> frozenset[str] | None:
    """The first ``Features`` line of an Arm /proc/cpuinfo (None: there is none)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Features":
            return frozenset(value.split())
    return None


# --- int8 kernels --------------------------------------------------------------------------


def supported_engines() -> list[str]:
    return list(torch.backends.quantized.supported_engines)


@contextlib.contextmanager
def _quantized_engine(name: str) -> Iterator[None]:
    before = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = before


@functools.cache
def int8_engine_works(name: str) -> bool:
    """Whether the engine packs a per-channel int8 layer here and computes it (and its fused
    ReLU): the recipe of engine.core.quantize, on a small layer."""
    gen = torch.Generator().manual_seed(0)
    weight, x = torch.randn(16, 32, generator=gen), torch.randn(4, 32, generator=gen)
    scales = weight.abs().amax(1).double() / 127.5  # symmetric, as the per-channel observer
    zero_points = torch.zeros(16, dtype=torch.int64)
    try:
        with _quantized_engine(name), torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensors are deprecated (for torchao)
            qweight = torch.quantize_per_channel(weight, scales, zero_points, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(qweight, None)
            out = torch.ops.quantized.linear_dynamic(x, packed, name != "qnnpack")
            relu = torch.ops.quantized.linear_relu_dynamic(x, packed, name != "qnnpack")
    except RuntimeError as err:
        _LOGGER.debug("int8 engine %s does not work here: %s", name, err)
        return False
    exact = x @ weight.T
    close = float((out - exact).norm() / exact.norm()) < 0.05  # int8 rounding: ~1 %
    return close and torch.allclose(relu, out.clamp(min=0), atol=1e-5)


def choose_int8_engine() -> str | None:
    """The engine in force if it works here, else the first of INT8_ENGINES that does."""
    available = supported_engines()
    current = torch.backends.quantized.engine
    candidates = [current, *(name for name in INT8_ENGINES if name != current)]
    for name in candidates:
        if name in INT8_ENGINES and name in available and int8_engine_works(name):
            return name
    return None


def ensure_int8_engine() -> str | None:
    """Make torch's quantized engine one that works here (kept if it does); returns it."""
    name = choose_int8_engine()
    if name is not None and name != torch.backends.quantized.engine:
        torch.backends.quantized.engine = name
    return name


# --- bfloat16 ------------------------------------------------------------------------------


def bf16_native() -> bool:
    """Whether oneDNN computes bfloat16 convolutions natively on this CPU.

    Without oneDNN's bfloat16 they take a slow reference path. On x86 it also needs AVX-512
    BF16 or AMX: with plain AVX-512 oneDNN emulates the bfloat16 products, which was not
    measured here, so the bfloat16 HiFT is not used there.
    """
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        if check is None or not check():
            return False
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return True  # Arm: oneDNN reports bfloat16 only with the BF16 extension
        native = (
            getattr(torch.cpu, "_is_avx512_bf16_supported", None),
            getattr(torch.cpu, "_is_amx_tile_supported", None),
        )
        return any(probe is not None and probe() for probe in native)
    except RuntimeError:
        return False


def has_amx() -> bool:
    """Whether the CPU has AMX tiles (torch's cpuinfo probe: it leaves oneDNN unqueried)."""
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe is not None and probe())
    except RuntimeError:
        return False


# --- threads -------------------------------------------------------------------------------


def needs_thread_probe(machine: str, cpuinfo: str) -> bool:
    """An Arm CPU without LSE atomics (or whose features are unknown)."""
    if machine.lower() not in ARM_MACHINES:
        return False
    features = arm_features(cpuinfo)
    return features is None or "atomics" not in features


def threads_survive(threads: int) -> bool:
    """Whether a child process survives a convolution and a matrix product on ``threads``."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _THREAD_PROBE, str(threads)],
            capture_output=True,
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        _LOGGER.warning("Multi-threaded torch check did not finish (%s): one thread", err)
        return False
    if done.returncode == 0:
        return True
    how = (
        signal.Signals(-done.returncode).name
        if done.returncode < 0
        else f"exit status {done.returncode}"
    )
    _LOGGER.warning(
        "torch on %d threads dies on this CPU (%s): the engine uses one thread", threads, how
    )
    return False


@functools.cache
def thread_ceiling() -> int | None:
    """The most torch threads this process may use (None: no limit); checked once, then cached.

    1 on an Arm CPU without LSE atomics unless a multi-threaded run in a child process shows
    that the installed torch build survives there.
    """
    if not needs_thread_probe(platform.machine(), read_cpuinfo()):
        return None
    return None if threads_survive(max(2, os.cpu_count() or 1)) else 1


def capped_threads(requested: int | None, ceiling: int | None) -> int | None:
    """The thread count to run with: ``requested`` (None: torch's own) within ``ceiling``."""
    if ceiling is None or (requested is not None and requested <= ceiling):
        return requested
    if requested is not None:
        _LOGGER.warning(
            "%d threads asked for; this CPU runs torch on at most %d", requested, ceiling
        )
    return ceiling


def detect() -> CpuChoices:
    return CpuChoices(
        machine=platform.machine(),
        int8_kernels=choose_int8_engine(),
        bfloat16=bf16_native(),
        thread_ceiling=thread_ceiling(),
    )
