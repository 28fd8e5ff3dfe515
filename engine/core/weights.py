"""Read the checkpoints of an official model directory, and assign them to models built on meta.

Every checkpoint is opened with ``torch.load(weights_only=True, mmap=True)``: no pickle code runs.
The models are built on the ``meta`` device and the checkpoint's tensors are assigned in place.
Every failure is a :class:`ModelLoadError` that names the file and the offending keys.

This is the reference path, straight from the official files: ``engine.core.prepared`` turns its
result into the files the engine runs from.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from engine.core.types import ModelLoadError

_LOGGER = logging.getLogger(__name__)

PARTS = ("llm", "flow", "hift")  # the three models, each in ``<part>.pt``
_MAX_LISTED_KEYS = 8


def list_keys(keys: list[str]) -> str:
    """The first few of ``keys``, and how many more there are."""
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    more = len(keys) - _MAX_LISTED_KEYS
    return shown + (f" (and {more} more)" if more > 0 else "")


def check_model_dir(model_dir: Path, missing: list[str], expected: str = "") -> None:
    """Raise :class:`ModelLoadError` if ``model_dir`` does not exist or lacks ``missing``
    (``expected``: a note on the files a complete one holds)."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    if missing:
        raise ModelLoadError(
            f"model directory {model_dir} is incomplete: missing {', '.join(missing)}{expected}"
        )


def read_checkpoint(path: Path) -> object:
    """``torch.load`` a file safely, turning every failure into a clear ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: file is missing")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"{path}: file is empty")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        # weights_only refuses anything but tensors and plain containers.
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ModelLoadError(
            f"{path}: refused to load — it contains Python objects other than plain tensors "
            f"(only weights_only checkpoints are accepted). {first_line}"
        ) from err
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError) as err:
        raise ModelLoadError(f"{path}: truncated or corrupt checkpoint ({err})") from err


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """Read a checkpoint that must be a flat mapping of names to tensors."""
    obj = read_checkpoint(path)
    if not isinstance(obj, Mapping):
        raise ModelLoadError(
            f"{path}: expected a state dict (name → tensor), got {type(obj).__name__}"
        )
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise ModelLoadError(f"{path}: entries that are not tensors: {list_keys(bad)}")
    return dict(obj)


def state_dict_problems(
    module: nn.Module, state: Mapping[str, torch.Tensor], optional: Iterable[str] = ()
) -> list[str]:
    """Every missing (not ``optional``), unexpected or misshapen key, worded for an error."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    missing = sorted(set(expected) - set(state) - set(optional))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} != {expected[k]}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {list_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {list_keys(unexpected)}")
    if wrong:
        problems.append(f"shape mismatches: {list_keys(wrong)}")
    return problems


def check_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Compare keys and shapes with what ``module`` expects; raise naming every mismatch."""
    if problems := state_dict_problems(module, state):
        raise ModelLoadError(f"{path} does not fit {type(module).__name__}: " + "; ".join(problems))


def finish_assigned(module: nn.Module) -> None:
    """After an assigning ``load_state_dict``: inference mode, and the derived tensors that a
    module built on the meta device rebuilds itself (rel-pos tables, STFT windows, layouts)."""
    module.eval()
    module.requires_grad_(False)
    for sub in module.modules():
        materialize = getattr(sub, "materialize_derived", None)
        if callable(materialize):
            materialize()


def check_materialized(module: nn.Module, path: Path) -> None:
    """Raise if a parameter or buffer of ``module`` is still on the meta device."""
    leftovers = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftovers:  # a derived tensor the module did not rebuild after meta construction
        raise ModelLoadError(f"{path}: internal error, left on meta: {list_keys(leftovers)}")


def assign_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Check, then load ``state`` into ``module`` by assignment (mmap'd tensors used in place)."""
    check_state_dict(module, state, path)
    floats = {k: v if v.dtype == torch.float32 else v.float() for k, v in state.items()}
    module.load_state_dict(floats, strict=True, assign=True)
    finish_assigned(module)
    check_materialized(module, path)


@contextmanager
def without_init() -> Iterator[None]:
    """Skip ``torch.nn.init`` while building on meta: every value is replaced by a loaded one.

    Random init on meta tensors is not free: the first ``normal_`` imports torch's Python
    decompositions (2-4 s). Loading happens once at start-up, before any other thread runs.
    """
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_")]
    saved = {n: getattr(nn.init, n) for n in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
