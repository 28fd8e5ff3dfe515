"""The build's one compiled part: the engine's int8 kernel for x86-64 (engine/core/native).

Everything else is declared in pyproject.toml. The kernel is compiled against the installed
torch (pinned in pyproject.toml), so the build needs that torch: ``pip install
--no-build-isolation`` after torch, as script/setup and addon/Dockerfile do. Elsewhere the
package is pure Python and the engine uses torch's own int8 kernels: on other machines, and in
an isolated build (it has no torch), as script/test-aarch64 installs the package for its
emulated Arm boards.
"""

import platform
import sys

from setuptools import setup

X86_64 = platform.machine().lower() in ("x86_64", "amd64")


def _native() -> dict:
    if not X86_64:
        return {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "setup.py: no torch in this build: the engine's int8 kernel is left out",
            file=sys.stderr,
        )
        return {}

    kernel = CppExtension(
        "engine.core.native.int8_avx2",
        ["engine/core/native/int8_avx2.cpp"],
        # -fopenmp: at::parallel_for is OpenMP in torch's headers (serial without it); the
        # libgomp it links is the one torch has already loaded (same soname).
        extra_compile_args=["-O3", "-fopenmp"],
        extra_link_args=["-fopenmp"],
    )
    return {"ext_modules": [kernel], "cmdclass": {"build_ext": BuildExtension}}


setup(**_native())
