"""Making torch's QNNPACK int8 Linear (aarch64's kernels) hold its weight once, as fbgemm does.

fbgemm (x86) packs a layer's int8 weight at ``linear_prepack`` into a copy and keeps nothing of
what it was given. QNNPACK's ``linear_prepack`` only keeps the weight tensor (no copy: for a
loaded layer, a view of the prepared file's mapping), packs it at the layer's first call, and
keeps the original beside the packed copy for ever, unless ATen's ``releaseWeightsWhenPrepacking``
flag is set (which mobile builds do); ``unpack`` then rebuilds the weight from the packed copy.
The flag has no Python binding, so it is set here through ATen's exported C++ functions
(``at::globalContext()`` and the setter, Itanium-mangled, as on every Linux and macOS build).
Where they cannot be reached the original stays: a WARNING says so, and the mapping test in
``tests/engine_tests/core/test_prepared.py`` fails.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

_LOGGER = logging.getLogger(__name__)

ENGINE = "qnnpack"  # torch.backends.quantized.engine's name for it
_LIBRARIES = ("libtorch_cpu.so", "libtorch_cpu.dylib")
_GLOBAL_CONTEXT = "_ZN2at13globalContextEv"  # at::globalContext()
_SET_RELEASE = "_ZN2at7Context31setReleaseWeightsWhenPrepackingEb"  # at::Context::set...(bool)
_GET_RELEASE = "_ZNK2at7Context28releaseWeightsWhenPrepackingEv"  # at::Context::...() const


def _torch_cpu_library() -> ctypes.CDLL:
    """libtorch_cpu, already loaded by ``import torch`` (this only finds it)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in _LIBRARIES:
        if (lib_dir / name).is_file():
            return ctypes.CDLL(str(lib_dir / name))
    raise OSError(f"no {' or '.join(_LIBRARIES)} in {lib_dir}")


@functools.cache
def release_packed_originals() -> bool:
    """Make QNNPACK drop the weight a layer was packed from once it has packed it.

    Returns whether it will (process-wide; fbgemm ignores the flag).
    """
    try:
        library = _torch_cpu_library()
        context = library[_GLOBAL_CONTEXT]
        context.restype, context.argtypes = ctypes.c_void_p, []
        setter, getter = library[_SET_RELEASE], library[_GET_RELEASE]
        setter.restype, setter.argtypes = None, [ctypes.c_void_p, ctypes.c_bool]
        getter.restype, getter.argtypes = ctypes.c_bool, [ctypes.c_void_p]
        setter(context(), True)
        released = bool(getter(context()))
    except (OSError, AttributeError) as err:  # no such library or symbol in this build
        _LOGGER.debug("Cannot set ATen's releaseWeightsWhenPrepacking: %s", err)
        released = False
    if not released:
        _LOGGER.warning(
            "QNNPACK keeps the int8 weights it packs from in this torch build: the int8 "
            "layers' source weights stay in memory beside their packed copies"
        )
    return released


def pack_now(layer: torch.nn.Module, in_features: int) -> None:
    """Make a QNNPACK layer pack its weight now: one call, on one row of zeros.

    The packing does not depend on the input (its scale is set again by every call), so the
    layer computes exactly what it would have after packing at its first real call.
    """
    with torch.no_grad():
        layer(torch.zeros(1, in_features))
