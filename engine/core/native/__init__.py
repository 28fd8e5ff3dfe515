"""The engine's compiled kernels (built by setup.py on x86-64; see docs/dev/int8-kernel.md)."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

_LOGGER = logging.getLogger(__name__)


def load(name: str) -> ModuleType | None:
    """The compiled module ``name`` if it is built and this CPU can run it, else None.

    Each module imports on any x86-64 CPU; its ``supported()`` says whether its kernels (AVX2
    and FMA) may run here.
    """
    try:
        module = importlib.import_module(f"{__name__}.{name}")
    except ImportError as err:
        _LOGGER.debug("the engine's kernel %s is not built here: %s", name, err)
        return None
    if not module.supported():
        _LOGGER.debug("the engine's kernel %s needs AVX2 and FMA; using torch's", name)
        return None
    return module


def padded(values: torch.Tensor, size: int) -> torch.Tensor:
    """``values`` as float32, zero-padded to ``size``: the kernels compute whole blocks of
    outputs, so their per-output scales and biases cover the last block's padding too."""
    out = torch.zeros(size, dtype=torch.float32)
    out[: values.numel()] = values.detach().float()
    return out
