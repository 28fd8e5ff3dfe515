"""The parity tests again, under other CPU kernel paths of the same machine.

PyTorch picks its vectorised kernels by the CPU's best instruction set, oneDNN (convolutions,
some matmuls) and MKL (BLAS) pick theirs the same way, and a reduction split over more threads
adds in another order. A tolerance fitted to the one path a developer's machine takes fails on
the next CPU; re-running the ``parity`` tests here with the paths capped lower and another thread
count makes it fail on this machine instead. The tolerances themselves, and the official code's
own spread they come from, are in tests/data/README.md and tests/data/cosyvoice2/README.md.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch
from conftest import PARITY_THREADS_ENV, TESTS
from parity import parity_files

ROOT = TESTS.parent
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _parity_files() -> list[str]:
    return [f"tests/{name}" for name in parity_files()]


# The lowest paths every x86-64 build has: ATen's scalar kernels, oneDNN's SSE4.1 ones, MKL's
# SSE4.2 ones. On other CPUs only ATen's variable is known to every build.
PORTABLE = (
    {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
     "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}
    if X86 else {"ATEN_CPU_CAPABILITY": "default"}
)  # fmt: skip
AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def _run_parity(env_changes: dict[str, str]) -> None:
    env = {**os.environ, **env_changes}
    command = [sys.executable, "-m", "pytest", "-q", "-m", "parity", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, *_parity_files()], cwd=ROOT, env=env, capture_output=True, text=True
    )
    summary = result.stdout.strip().splitlines()[-1:] if result.stdout.strip() else []
    output = f"{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    assert result.returncode == 0, f"the parity tests fail with {env_changes}:\n{output}"
    assert summary and " passed" in summary[0] and "failed" not in summary[0], summary


def test_the_parity_tests_collect_from_the_files_that_mark_them() -> None:
    files = _parity_files()
    assert "tests/engine_tests/cosyvoice2/test_cosyvoice2_hift.py" in files
    assert "tests/engine_tests/prompt/test_prompt_features.py" in files
    assert "tests/engine_tests/cosyvoice1/test_streaming.py" in files  # marks one parameter only
    # the re-run never runs itself
    assert "tests/engine_tests/core/test_kernel_paths.py" not in files


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_parity_holds_on_the_portable_kernels_with_four_threads() -> None:
    _run_parity({**PORTABLE, PARITY_THREADS_ENV: "4"})


@pytest.mark.long
@pytest.mark.timeout(1800)
def test_parity_holds_on_the_avx2_kernels_of_a_cpu_with_more() -> None:
    best = torch.backends.cpu.get_cpu_capability()
    if not X86 or best in ("DEFAULT", "AVX2"):
        pytest.skip(f"this CPU's best kernel path is {best}: the default run already took it")
    _run_parity({**AVX2, PARITY_THREADS_ENV: "1"})
