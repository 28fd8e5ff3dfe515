"""Load an official CosyVoice v1 model directory: config, checkpoints and speaker table.

Every checkpoint is opened with ``torch.load(weights_only=True, mmap=True)``: no pickle code runs,
and the tensors stay memory-mapped (or, once it is indexed, mapped through its index without
unpickling: engine.checkpoint_index). The models are built on the ``meta`` device and the mapped
tensors are assigned in place, so loading allocates no second copy of any weight. Every failure
is a :class:`ModelLoadError` that names the file and the offending keys.
"""

from __future__ import annotations

import logging
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.checkpoint_index import read_indexed, write_index
from engine.hparams import ModelArgs, ModelConfigError, load_model_args
from engine.pages import (
    fence_off_unused,
    file_mapped_ranges,
    mapping_of,
    read_copies,
    release_if_mapped,
)
from engine.types import ModelLoadError

if TYPE_CHECKING:
    from engine.flow import FlowModel
    from engine.hift import HiFTGenerator
    from engine.llm import TransformerLM

_LOGGER = logging.getLogger(__name__)

CONFIG_FILE = "cosyvoice.yaml"
CHECKPOINT_FILES = ("llm.pt", "flow.pt", "hift.pt")
SPEAKER_FILE = "spk2info.pt"
REQUIRED_FILES = (CONFIG_FILE, *CHECKPOINT_FILES, SPEAKER_FILE)
SPEAKER_EMBED_DIM = 192
_MAX_LISTED_KEYS = 8


def missing_model_files(model_dir: Path) -> list[str]:
    """Names of the required files that ``model_dir`` lacks (empty when complete)."""
    return [name for name in REQUIRED_FILES if not (Path(model_dir) / name).is_file()]


def _list_keys(keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED_KEYS])
    more = len(keys) - _MAX_LISTED_KEYS
    return shown + (f" (and {more} more)" if more > 0 else "")


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


def read_state_dict(path: Path, index_dir: Path | None = None) -> dict[str, torch.Tensor]:
    """Read a checkpoint that must be a flat mapping of names to tensors.

    With ``index_dir``, through the checkpoint's index there when it has a usable one (no
    unpickling: engine.checkpoint_index), else loaded and vetted as usual and indexed.
    """
    if index_dir is not None:
        indexed = read_indexed(path, index_dir)
        if indexed is not None:
            return indexed
    obj = read_checkpoint(path)
    if not isinstance(obj, Mapping):
        raise ModelLoadError(
            f"{path}: expected a state dict (name → tensor), got {type(obj).__name__}"
        )
    bad = [str(k) for k, v in obj.items() if not isinstance(k, str) or not torch.is_tensor(v)]
    if bad:
        raise ModelLoadError(f"{path}: entries that are not tensors: {_list_keys(bad)}")
    state = dict(obj)
    if index_dir is not None:
        write_index(path, index_dir, state)
    return state


def check_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Compare keys and shapes with what ``module`` expects; raise naming every mismatch."""
    expected = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(
        f"{k} {tuple(state[k].shape)} != {expected[k]}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != expected[k]
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {_list_keys(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {_list_keys(unexpected)}")
    if wrong:
        problems.append(f"shape mismatches: {_list_keys(wrong)}")
    if problems:
        raise ModelLoadError(f"{path} does not fit {CONFIG_FILE}: " + "; ".join(problems))


_SMALL_BYTES = 4096  # one page


def _is_small(tensor: torch.Tensor) -> bool:
    """Norms, biases and position biases (1-D, or one page at most): a few MB in all.

    They are copied out of the checkpoint with ``pread`` (engine.pages.read_copies). Read in
    place, or copied through the mapping, each would map the 2 MiB page-cache folio around it,
    and with it the pages of its large neighbours: in place for good (the fence cannot take
    them away), copied until the fence at the end of the load.
    """
    return tensor.dim() <= 1 or tensor.numel() * tensor.element_size() <= _SMALL_BYTES


def assign_state_dict(module: nn.Module, state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Check, then load ``state`` into ``module`` by assignment (mmap'd tensors used in place)."""
    check_state_dict(module, state, path)
    small = [k for k, v in state.items() if v.dtype == torch.float32 and _is_small(v)]
    copies = dict(zip(small, read_copies([state[k] for k in small]), strict=True))
    floats = {
        k: copies.get(k, v.float() if v.dtype != torch.float32 else v) for k, v in state.items()
    }
    module.load_state_dict(floats, strict=True, assign=True)
    module.eval()
    module.requires_grad_(False)
    # Modules built on the meta device rebuild their derived, non-saved tensors (rel-pos
    # tables, STFT windows, fused weights) here.
    for sub in module.modules():
        materialize = getattr(sub, "materialize_derived", None)
        if callable(materialize):
            materialize()
    leftovers = [n for n, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if leftovers:  # a derived tensor the module did not rebuild after meta construction
        raise ModelLoadError(f"{path}: internal error, left on meta: {_list_keys(leftovers)}")


def load_speakers(path: Path) -> dict[str, torch.Tensor]:
    """Read ``spk2info.pt`` into {speaker name: (192,) float32 x-vector (un-normalised)}."""
    obj = read_checkpoint(path)
    if not isinstance(obj, Mapping):
        raise ModelLoadError(f"{path}: expected a dict of speakers, got {type(obj).__name__}")
    speakers: dict[str, torch.Tensor] = {}
    bad: list[str] = []
    for name, info in obj.items():
        embedding = info.get("embedding") if isinstance(info, Mapping) else None
        if (
            not isinstance(name, str)
            or not torch.is_tensor(embedding)
            or embedding.numel() != SPEAKER_EMBED_DIM
        ):
            bad.append(str(name))
            continue
        speakers[name] = embedding.detach().reshape(SPEAKER_EMBED_DIM).float().clone()
    if bad:
        raise ModelLoadError(
            f"{path}: speakers without a {SPEAKER_EMBED_DIM}-value 'embedding': {_list_keys(bad)}"
        )
    return speakers


@contextmanager
def _without_init() -> Iterator[None]:
    """Skip ``torch.nn.init`` while building on meta: every value is replaced by the checkpoint.

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


@dataclass
class LoadedModels:
    """The three models of one directory plus its speaker table, ready for inference."""

    model_dir: Path
    args: ModelArgs
    llm: TransformerLM
    flow: FlowModel
    hift: HiFTGenerator
    speakers: dict[str, torch.Tensor]
    # One tensor of each mapped checkpoint (llm.pt, flow.pt, hift.pt): keeps its mapping
    # alive, so that release_checkpoint_pages() can never map over memory the process reused.
    checkpoint_anchors: tuple[torch.Tensor, ...] = ()

    def release_checkpoint_pages(self) -> tuple[list[str], int]:
        """Once the weights are final (int8 swaps done): serve the embedding tables from their
        files, then fence off every checkpoint page no model reads any more (engine.pages).
        Returns the tables swapped and the bytes fenced off."""
        swapped = self._read_embeddings_from_files()  # first: the fence then unmaps the tables
        return swapped, self._fence_unused_pages()

    def _read_embeddings_from_files(self) -> list[str]:
        """Serve the mapped embedding tables by reading rows from their files (see
        engine.file_rows). Returns the tables swapped."""
        from engine.file_rows import FileEmbedding

        swapped = []
        for owner, name in (
            (self.llm, "text_embedding"),
            (self.llm, "speech_embedding"),
            (self.flow, "input_embedding"),
        ):
            reader = FileEmbedding.replacing(getattr(owner, name))
            if reader is not None:
                setattr(owner, name, reader)
                swapped.append(f"{type(owner).__name__}.{name}")
        return swapped

    def _fence_unused_pages(self) -> int:
        """Fence off the checkpoint pages that no model tensor uses, so that no later fault
        maps them (see engine.pages). Bytes."""
        in_use = [t for model in (self.llm, self.flow, self.hift) for t in _tensors_of(model)]
        fenced = 0
        for anchor in self.checkpoint_anchors:
            mapping = mapping_of(anchor)
            # A checkpoint no model reads (e.g. every tensor converted to float32) is unmapped
            # whole when its anchor goes below: nothing to fence.
            if mapping is not None and any(mapping[0] <= t.data_ptr() < mapping[1] for t in in_use):
                fenced += fence_off_unused(mapping, in_use)
        self.checkpoint_anchors = ()
        return fenced


# nn.Module's own bookkeeping but its parameter and buffer tables: submodules (visited by
# modules()) and hooks, no tensors. Skipping them halves the walk (≈ 40 → 20 ms).
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"_parameters", "_buffers"}


def _tensors_of(model: nn.Module) -> Iterator[torch.Tensor]:
    """Every tensor a model can read: parameters, buffers and tensor attributes (also inside
    tuples, lists and dicts, such as cached projections)."""
    for module in model.modules():
        pending = [v for k, v in vars(module).items() if k not in _MODULE_INTERNALS]
        while pending:
            value = pending.pop()
            # Only strided tensors can be views of a checkpoint (oneDNN's reordered weights
            # are opaque copies with no data pointer).
            if isinstance(value, torch.Tensor):
                if value.layout == torch.strided:
                    yield value
            elif isinstance(value, tuple | list):
                pending.extend(value)
            elif isinstance(value, dict):
                pending.extend(value.values())


def _release_replaced(raw: Mapping[str, torch.Tensor], kept: Mapping[str, torch.Tensor]) -> None:
    """Give back the mapped pages of the tensors of ``raw`` that ``kept`` no longer uses."""
    used = {id(t) for t in kept.values()}
    ranges = file_mapped_ranges()
    for tensor in raw.values():
        if id(tensor) not in used:
            release_if_mapped(tensor, ranges)


def load_model_dir(model_dir: Path, index_dir: Path | None = None) -> LoadedModels:
    """Build the LM, flow and HiFT from ``cosyvoice.yaml`` and load the official checkpoints
    (through their indexes in ``index_dir``, if given: see read_state_dict)."""
    # Imported here so this module can be read (e.g. for file checks) without the model code.
    from engine.flow import FlowModel
    from engine.hift import HiFTGenerator
    from engine.llm import TransformerLM
    from engine.weight_norm import normalize_hift_state_dict

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    missing = missing_model_files(model_dir)
    if missing:
        raise ModelLoadError(
            f"model directory {model_dir} is incomplete: missing {', '.join(missing)} "
            f"(expected {', '.join(REQUIRED_FILES)})"
        )
    try:
        args = load_model_args(model_dir / CONFIG_FILE)
    except ModelConfigError as err:
        raise ModelLoadError(str(err)) from err

    llm_sd = read_state_dict(model_dir / "llm.pt", index_dir)
    flow_sd = read_state_dict(model_dir / "flow.pt", index_dir)
    hift_raw = read_state_dict(model_dir / "hift.pt", index_dir)
    anchors = tuple(
        next((t for t in sd.values() if t.numel()), torch.empty(0))
        for sd in (llm_sd, flow_sd, hift_raw)
    )
    try:
        hift_sd = normalize_hift_state_dict(hift_raw)
    except ValueError as err:
        raise ModelLoadError(f"{model_dir / 'hift.pt'}: {err}") from err
    _release_replaced(hift_raw, hift_sd)  # the weight-norm pairs, folded into new tensors

    with torch.device("meta"), _without_init():
        llm = TransformerLM(args.llm)
        flow = FlowModel(args.flow)
        hift = HiFTGenerator(args.hift)
    for module, state, name in (
        (llm, llm_sd, "llm.pt"),
        (flow, flow_sd, "flow.pt"),
        (hift, hift_sd, "hift.pt"),
    ):
        assign_state_dict(module, state, model_dir / name)
    speakers = load_speakers(model_dir / SPEAKER_FILE)
    _LOGGER.debug("Loaded %s with %d speakers", model_dir, len(speakers))
    return LoadedModels(model_dir, args, llm, flow, hift, speakers, anchors)
