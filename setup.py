"""The build's compiled part: the engine's kernels for x86-64 (engine/core/native).

Everything else is declared in pyproject.toml. The kernels are compiled against the installed
torch (pinned in pyproject.toml), so the build needs that torch: ``pip install
--no-build-isolation`` after torch, as script/setup and addon/Dockerfile do. Elsewhere the
package is pure Python and the engine uses torch's own kernels: on other machines, and in
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
            "setup.py: no torch in this build: the engine's kernels are left out",
            file=sys.stderr,
        )
        return {}

    # -fopenmp: at::parallel_for is OpenMP in torch's headers (serial without it); the libgomp
    # it links is the one torch has already loaded (same soname). -g0 overrides the -g of
    # Python's own flags: debug information for torch's templates doubles the compile time of
    # every install and image build and makes each module twenty times larger.
    kernels = [
        CppExtension(
            f"engine.core.native.{name}",
            [f"engine/core/native/{name}.cpp"],
            extra_compile_args=["-O3", "-g0", "-fopenmp"],
            extra_link_args=["-fopenmp"],
        )
        # the LM's int8 and int4 Linear; the int8 HiFT's Snake + activation quantisation;
        # the Qwen2 LM's RMS norm; the LMs' decode-step attention; their decode step in one call
        for name in (
            "int8_avx2",
            "int4_avx2",
            "snake_avx2",
            "norm_avx2",
            "attention_avx2",
            "decode_step_avx2",
        )
    ]
    return {"ext_modules": kernels, "cmdclass": {"build_ext": BuildExtension}}


setup(**_native())
