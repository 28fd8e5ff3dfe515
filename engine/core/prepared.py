"""Prepared weights: the tensors the engine runs from, one safetensors file per model and format.

The official checkpoints hold what training saved: weight-normed HiFT convolutions, float32
layers that the fast profiles run in int8, a pickle to parse. ``python -m engine prepare`` (or
the engine's first load of a model in a weight format) turns each model into the tensors the
engine reads, in the formats it reads them: int8 layers as int8 weights with per-channel scales
and their float biases (the int4 LM's 4-bit layers as codes with group-wise scales:
engine.core.int4), HiFT's weight norm folded and its convolution weights laid out channels-last
(in bfloat16 for ``hift.bf16``), the flow estimator's Linear weights in bfloat16 for
``flow.bf16`` (engine.core.bf16_flow), the LM's positional rows computed (its causal layers'
``pos_rows``: engine.core.transformer). Nothing the engine would replace or drop at load.

The files go to a ``prepared/`` folder beside the model files (``llm.int8.safetensors``,
``flow.fp32.safetensors``, ``hift.fp32.safetensors``, ...), or, when the model directory cannot be
written, to a folder per model directory in a cache directory. Each file's metadata is its key:
the checkpoint's size and modification time, the torch version, this file format's version and
the weight format. A file whose key no longer matches is prepared again; one that safetensors
cannot open, or whose tensors do not fit the model, is reported with a warning and rebuilt.
safetensors checks the header and the file's length, not the tensor bytes: a checksum of every
file at every start would cost seconds.

Loading maps the file (safetensors opens it with ``mmap``), builds the model on the ``meta``
device and assigns the mapped tensors in place. Three exceptions keep the memory of a loaded
model to what it reads:

* The int8 layers' parts are packed for the CPU's int8 kernels in the background
  (engine.core.quantize), a few layers at a time, each group through a mapping of its own: the
  packed layers are copies, and a group's mapping goes (with its pages) once it is packed.
* Small tensors (norms, biases) are read as copies too: where the page cache holds large folios
  (ext4, Linux 6.16 and later) touching 1 KB of a mapped file maps the 2 MiB around it.
* Once the engine has replaced what it replaces at load (oneDNN re-lays the flow estimator's
  float32 weights out as copies), the tensors the model still reads from the file are mapped
  afresh, and the load's own mapping, with every page the replacements read, goes away.

What stays mapped is handed to the family's engine (:class:`PreparedLoad.mapped_weights`,
engine.core.mapped_weights), which may map weights it reads rarely afresh later on.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from engine.core.bf16_flow import use_bf16_linears
from engine.core.int4 import GROUP_SIZE, int4_format_parts, int4_format_specs, pack_int4_format
from engine.core.mapped_weights import MappedWeights, point_at
from engine.core.quantize import (
    Int8Packing,
    install_int8_layers,
    int8_part_specs,
    int8_parts,
    pack_lm_int8,
    replaced_float_keys,
)
from engine.core.transformer import store_position_rows
from engine.core.types import ModelLoadError
from engine.core.weights import PARTS, check_materialized, finish_assigned, list_keys

if TYPE_CHECKING:
    from engine.core.hift import HiFTGenerator

_LOGGER = logging.getLogger(__name__)

PREPARED_DIR = "prepared"
FILE_FORMAT = "2"  # bump when what a prepared file holds, or how, changes
WEIGHT_FORMATS = {
    "llm": ("fp32", "int8", "int4"),
    "flow": ("fp32", "int8", "bf16"),
    "hift": ("fp32", "bf16", "int8"),
}
# The formats whose quantised layers are the int8 format's layers, in their own parts.
QUANTISED = ("int8", "int4")
# How a part's quantised layers are packed at load, where not as pack_int8 (torch's int8 layer):
# the LM's on the engine's own kernel where it runs (its decode step reads one row), the int4
# format's in 4 bits where it can.
PACKERS: dict[tuple[str, str], Callable[[Mapping[str, torch.Tensor], str], nn.Module]] = {
    ("llm", "int8"): pack_lm_int8,
    ("llm", "int4"): pack_int4_format,
}
# Tensors up to this size, and every 1-D one, are read as copies rather than mapped (see above).
_COPY_BYTES = 64 << 10

Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class ModelParts:
    """How one model family's directory becomes its three models (``llm``, ``flow``, ``hift``,
    each in ``<part>.pt`` unless ``checkpoints`` names another file): what preparing and
    loading need to know of the family."""

    read_args: Callable[[Path], Any]  # checks the directory, reads its config
    build_on_meta: Callable[[Any, str], nn.Module]  # (args, part)
    read_part: Callable[[Path, Any, str], nn.Module]  # from the checkpoint, float32
    int8_names: Callable[[nn.Module, str], list[str]]  # the layers its int8 format swaps
    # State-dict keys a prepared file leaves out (a tied copy of another tensor), per part.
    left_out: Mapping[str, Collection[str]] = field(default_factory=dict)
    # After a part's tensors are assigned (e.g. tie the left-out tensors back).
    finish: Callable[[nn.Module, str], None] = lambda module, part: None
    # The built-in speakers' embeddings, read from the directory.
    read_speakers: Callable[[Path], dict[str, torch.Tensor]] = lambda model_dir: {}
    # A part's checkpoint when it is not ``<part>.pt`` (CosyVoice3's RL-tuned LM, llm.rl.pt);
    # ``read_part`` reads it, and its prepared files are named after it.
    checkpoints: Mapping[str, str] = field(default_factory=dict)

    def checkpoint(self, part: str) -> str:
        """The file name of ``part``'s checkpoint in a model directory."""
        return self.checkpoints.get(part, f"{part}.pt")


@dataclass(frozen=True)
class WeightFormats:
    """The weight format of each model: what ``CosyVoiceEngine.load`` is asked to run."""

    llm: str = "fp32"
    flow: str = "fp32"
    hift: str = "fp32"

    def __post_init__(self) -> None:
        for part, choices in WEIGHT_FORMATS.items():
            if self.of(part) not in choices:
                raise ValueError(f"{part} weights: {self.of(part)!r} is not one of {choices}")

    def of(self, part: str) -> str:
        return str(getattr(self, part))


def file_name(part: str, weights: str, checkpoint: str | None = None) -> str:
    """A prepared file's name: its checkpoint's stem (``part`` unless another ``checkpoint``
    is given) and its weight format."""
    stem = checkpoint.removesuffix(".pt") if checkpoint is not None else part
    return f"{stem}.{weights}.safetensors"


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/cosyvoice-engine``, else ``~/.cache/cosyvoice-engine``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative value.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "cosyvoice-engine"


def prepared_dirs(model_dir: Path, cache_dir: Path | None = None) -> list[Path]:
    """Where the prepared files of ``model_dir`` are looked for and written, in this order:
    beside the model files, then (a model directory that cannot be written) a folder in
    ``cache_dir`` named for the model directory."""
    model_dir = Path(model_dir).resolve()
    digest = hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return [model_dir / PREPARED_DIR, cache / f"{model_dir.name}-{digest}"]


def source_key(
    model_dir: Path, part: str, weights: str, checkpoint: str | None = None
) -> dict[str, str]:
    """What a prepared file must have been made from to be used (safetensors metadata: strings).

    The checkpoint's (``<part>.pt`` unless given) size and modification time, not a hash of its
    contents: hashing the full-size ``llm.pt`` (1.2 GB) would add seconds to every start.
    """
    checkpoint = checkpoint or f"{part}.pt"
    st = (Path(model_dir) / checkpoint).stat()
    key = {
        "file_format": FILE_FORMAT,
        "torch": str(torch.__version__),
        "weights": weights,
        "source": checkpoint,
        "source_size": str(st.st_size),
        "source_mtime_ns": str(st.st_mtime_ns),
    }
    if weights == "int4":  # another group size is another file
        key["group_size"] = str(GROUP_SIZE)
    return key


# --- what a prepared file holds ---------------------------------------------------------------


def _int8_names(module: nn.Module, part: str, weights: str, parts: ModelParts) -> list[str]:
    """The quantised layers of ``module`` in ``weights`` (int4's are int8's, some in 4 bits)."""
    return parts.int8_names(module, part) if weights in QUANTISED else []


def quantised_part_specs(module: nn.Module, names: list[str], weights: str) -> Spec:
    """Shape and dtype of the plain parts of the quantised layers ``names`` in ``weights``."""
    return (int4_format_specs if weights == "int4" else int8_part_specs)(module, names)


def quantised_parts(module: nn.Module, names: list[str], weights: str) -> dict[str, torch.Tensor]:
    """The plain parts of the quantised layers ``names`` in ``weights``, quantised now."""
    return (int4_format_parts if weights == "int4" else int8_parts)(module, names)


def _in_run_dtype(module: nn.Module, part: str, weights: str) -> nn.Module:
    if part == "hift" and weights == "bf16":
        cast("HiFTGenerator", module).use_bfloat16()
    if part == "flow" and weights == "bf16":
        use_bf16_linears(module)  # the file holds the estimator's Linear weights in bfloat16
    if part == "hift" and weights == "int8":
        cast("HiFTGenerator", module).use_int8()
    store_position_rows(module)  # the LM's causal layers: their rows are read, not linear_pos
    return module


def run_module_on_meta(args: Any, part: str, weights: str, parts: ModelParts) -> nn.Module:
    """The model as the engine runs it in ``weights``, built on meta (no memory for weights)."""
    return _in_run_dtype(parts.build_on_meta(args, part), part, weights)


def expected_tensors(
    module: nn.Module, int8_names: list[str], left_out: Collection[str] = (), weights: str = "int8"
) -> Spec:
    """Name → (shape, dtype) of every tensor a prepared file of ``module`` holds (``weights``:
    the format of the quantised layers ``int8_names``)."""
    replaced = replaced_float_keys(module, int8_names) | set(left_out)
    floats = {
        name: (tuple(t.shape), t.dtype)
        for name, t in module.state_dict(keep_vars=True).items()
        if name not in replaced
    }
    return floats | quantised_part_specs(module, int8_names, weights)


def run_tensors(
    module: nn.Module, int8_names: list[str], left_out: Collection[str] = (), weights: str = "int8"
) -> dict[str, torch.Tensor]:
    """The tensors of a loaded model that a prepared file holds (the int8 ones quantised)."""
    replaced = replaced_float_keys(module, int8_names) | set(left_out)
    floats = {k: v for k, v in module.state_dict().items() if k not in replaced}
    return floats | quantised_parts(module, int8_names, weights)


def _storage_order(tensor: torch.Tensor) -> list[int] | None:
    """The dim order in which a non-contiguous dense tensor (a channels-last weight) lies in
    memory; None for a contiguous one, or one that is not a permutation of a contiguous one."""
    if tensor.is_contiguous():
        return None
    strides = tensor.stride()
    order = sorted(range(tensor.dim()), key=lambda d: -strides[d])
    return order if tensor.permute(order).is_contiguous() else None


def _laid_out(tensor: torch.Tensor, order: list[int] | None) -> torch.Tensor:
    """A stored tensor back in its shape, keeping the memory layout it was stored in."""
    if order is None:
        return tensor
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return tensor.permute(inverse)


def write_prepared(path: Path, tensors: Mapping[str, torch.Tensor], key: dict[str, str]) -> None:
    """Save ``tensors`` with ``key`` as metadata, atomically (temporary file, fsync, rename).

    safetensors stores contiguous tensors only: each other one is stored as its memory order
    (recorded under ``layouts``), so that it loads with the layout it runs in.
    """
    layouts: dict[str, list[int]] = {}
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        order = _storage_order(tensor)
        if order is not None:
            layouts[name] = order
            tensor = tensor.permute(order)
        stored[name] = tensor.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    # One name per writer: two loads (processes or threads) may prepare the same file at once.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        save_file(stored, tmp, metadata={**key, "layouts": json.dumps(layouts)})
        os.chmod(tmp, 0o644)  # as the model files: readable by whoever may run the model
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)  # a reader sees the old file or the whole new one
    finally:
        tmp.unlink(missing_ok=True)


class _Unusable(Exception):
    """A prepared file that cannot be used; ``damaged`` unless it is merely out of date."""

    def __init__(self, reason: str, *, damaged: bool) -> None:
        super().__init__(reason)
        self.damaged = damaged


@dataclass
class _Checked:
    """A prepared file whose key and tensors fit the model."""

    path: Path
    layouts: dict[str, list[int]]
    tensors: Spec  # name → (shape, dtype) of each tensor it holds


# The names safetensors gives the dtypes a prepared file holds.
_DTYPE_NAMES = {
    torch.float32: "F32",
    torch.float64: "F64",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.int64: "I64",
    torch.int8: "I8",
    torch.uint8: "U8",
}


def _stored_shape(shape: list[int], order: list[int] | None) -> tuple[int, ...]:
    """The shape of a tensor that was stored in its memory order ``order``."""
    if order is None:
        return tuple(shape)
    logical = [0] * len(shape)
    for stored_dim, dim in enumerate(order):
        logical[dim] = shape[stored_dim]
    return tuple(logical)


def _open_checked(path: Path, key: dict[str, str], expected: Spec) -> _Checked:
    """Check a prepared file's key, tensor names, shapes and dtypes (reads its header only)."""
    try:
        with safe_open(path, framework="pt") as stored:
            metadata = stored.metadata() or {}
            changed = [k for k, v in key.items() if metadata.get(k) != v]
            if changed:
                raise _Unusable(", ".join(changed), damaged=False)
            layouts = json.loads(metadata.get("layouts", "{}"))
            found = {}
            for name in stored.keys():
                tensor = stored.get_slice(name)
                shape = _stored_shape(tensor.get_shape(), layouts.get(name))
                found[name] = (shape, tensor.get_dtype())
    except _Unusable:
        raise
    except Exception as err:  # whatever a damaged file makes safetensors or json raise
        raise _Unusable(f"{type(err).__name__}: {err}", damaged=True) from err
    problems = _mismatches(found, expected)
    if problems:
        raise _Unusable(problems, damaged=True)
    return _Checked(path, layouts, expected)


def _mismatches(found: Mapping[str, tuple[tuple[int, ...], str]], expected: Spec) -> str:
    """What does not fit the model in a prepared file's tensors ('' when everything does)."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(
        f"{name} {shape} {dtype}"
        for name, (shape, dtype) in found.items()
        if name in expected
        and (shape, dtype) != (expected[name][0], _DTYPE_NAMES.get(expected[name][1]))
    )
    problems = [
        f"{label}: {list_keys(names)}"
        for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong", wrong))
        if names
    ]
    return "; ".join(problems)


# --- preparing --------------------------------------------------------------------------------


def _prepare(
    model_dir: Path,
    args: Any,
    part: str,
    weights: str,
    dirs: list[Path],
    reason: str,
    parts: ModelParts,
) -> Path:
    """Write the prepared file of one model and format to the first of ``dirs`` that takes it."""
    name = file_name(part, weights, parts.checkpoint(part))
    label = name.removesuffix(".safetensors")
    _LOGGER.info("Preparing %s for %s (%s)…", label, model_dir, reason)
    start = time.perf_counter()
    # The key is taken first: a checkpoint that changes meanwhile is prepared again next time.
    key = source_key(model_dir, part, weights, parts.checkpoint(part))
    module = _in_run_dtype(parts.read_part(model_dir, args, part), part, weights)
    left_out = parts.left_out.get(part, ())
    names = _int8_names(module, part, weights, parts)
    tensors = run_tensors(module, names, left_out, weights)
    errors = []
    for directory in dirs:
        path = directory / name
        try:
            write_prepared(path, tensors, key)
        except OSError as err:  # e.g. a read-only model directory: the next place
            errors.append(f"{path}: {err}")
            _LOGGER.debug("Cannot write %s (%s)", path, err)
            continue
        _LOGGER.info("…done in %.1f s: %s", time.perf_counter() - start, path)
        return path
    raise ModelLoadError(f"cannot write the prepared {label} weights: {'; '.join(errors)}")


def ensure_prepared(
    model_dir: Path,
    args: Any,
    part: str,
    weights: str,
    cache_dir: Path | None,
    module: nn.Module | None,
    parts: ModelParts,
) -> tuple[_Checked, bool]:
    """The usable prepared file of one model and format; prepared first when it is missing,
    out of date or damaged (then the second value is True). ``module``: the model as
    :func:`run_module_on_meta` builds it, if the caller has it."""
    module = module if module is not None else run_module_on_meta(args, part, weights, parts)
    names = _int8_names(module, part, weights, parts)
    expected = expected_tensors(module, names, parts.left_out.get(part, ()), weights)
    key = source_key(model_dir, part, weights, parts.checkpoint(part))
    dirs = prepared_dirs(model_dir, cache_dir)
    reason = "first use of this model and format"
    for directory in dirs:
        path = directory / file_name(part, weights, parts.checkpoint(part))
        if not path.is_file():
            continue
        try:
            return _open_checked(path, key, expected), False
        except _Unusable as err:
            if err.damaged:
                _LOGGER.warning("Prepared file %s is damaged (%s): preparing it again", path, err)
                reason = f"{path.name} was damaged"
            else:
                reason = f"changed since it was prepared: {err}"
    path = _prepare(model_dir, args, part, weights, dirs, reason, parts)
    try:
        return _open_checked(path, key, expected), True
    except _Unusable as err:  # just written: the checkpoint changed meanwhile, or a bug
        raise ModelLoadError(f"{path}: the file just prepared is not usable ({err})") from err


def prepare_model(
    model_dir: Path,
    formats: Mapping[str, list[str]],
    cache_dir: Path | None = None,
    *,
    parts: ModelParts,
) -> list[tuple[str, Path, bool]]:
    """Make sure the prepared files of ``model_dir`` exist for the given formats of each part.

    ``parts``: the model family's (``engine.family`` knows which a directory holds).
    Returns (model.format, file, whether it was prepared now) per file.
    """
    model_dir = Path(model_dir)
    args = parts.read_args(model_dir)
    done = []
    for part, choices in formats.items():
        for weights in choices:
            checked, prepared_now = ensure_prepared(
                model_dir, args, part, weights, cache_dir, None, parts
            )
            done.append((f"{part}.{weights}", checked.path, prepared_now))
    return done


# --- loading ----------------------------------------------------------------------------------


def _is_small(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    return len(shape) <= 1 or math.prod(shape) * dtype.itemsize <= _COPY_BYTES


def _read(
    path: Path, names: list[str], layouts: Mapping[str, list[int]], *, copies: bool
) -> dict[str, torch.Tensor]:
    """Tensors of a prepared file: private copies (read with ``pread``), or views of one new
    mapping of the file (safetensors reads the first page of each)."""
    backend = "pread" if copies else "mmap"
    with safe_open(path, framework="pt", backend=backend) as stored:
        return {name: _laid_out(stored.get_tensor(name), layouts.get(name)) for name in names}


@dataclass
class _PartLoad:
    """One model being loaded from its prepared file."""

    module: nn.Module
    file: _Checked
    int8_names: list[str]
    part: str
    parts: ModelParts
    weights: str = "int8"  # the format of the quantised layers ``int8_names``
    packing: Int8Packing | None = None
    mapped: dict[str, torch.Tensor] = field(default_factory=dict)
    kept_mapped: list[str] = field(default_factory=list)  # what stays mapped once finished

    def start_packing(self, specs: Spec) -> None:
        """Pack the int8 layers in the background (they are not part of the state dict)."""
        if not self.int8_names:
            return
        path, layouts = self.file.path, self.file.layouts
        parts_of: dict[str, list[str]] = {name: [] for name in self.int8_names}
        for key in specs:  # NAME.weight, NAME.weight_scale, NAME.bias
            parts_of[key.rpartition(".")[0]].append(key)

        def read(names: list[str]) -> dict[str, torch.Tensor]:
            keys = [key for name in names for key in parts_of[name]]
            return _read(path, keys, layouts, copies=False)  # a mapping of their own

        pack = PACKERS.get((self.part, self.weights))
        self.packing = Int8Packing(self.int8_names, read, pack)

    def assign(self) -> None:
        """Assign the float tensors: the large ones mapped in place, small ones as copies."""
        path, layouts, expected = self.file.path, self.file.layouts, self.file.tensors
        part_names = set(quantised_part_specs(self.module, self.int8_names, self.weights))
        floats = [name for name in expected if name not in part_names]
        small = [name for name in floats if _is_small(*expected[name])]
        copies = _read(path, small, layouts, copies=True)
        self.mapped = _read(path, [n for n in floats if n not in copies], layouts, copies=False)
        result = self.module.load_state_dict(copies | self.mapped, strict=False, assign=True)
        replaced = replaced_float_keys(self.module, self.int8_names)
        replaced |= set(self.parts.left_out.get(self.part, ()))
        if set(result.missing_keys) != replaced or result.unexpected_keys:  # checked on opening
            raise ModelLoadError(f"{path}: internal error, keys do not fit the model")
        finish_assigned(self.module)
        self.parts.finish(self.module, self.part)

    def finish(self) -> None:
        """Put the packed int8 layers in, then map the file afresh for what the model reads."""
        if self.packing is not None:
            try:
                layers = self.packing.layers()
            except Exception as err:  # a read or packing error: name the file
                raise ModelLoadError(
                    f"{self.file.path}: cannot load its {self.weights} layers ({err})"
                ) from err
            install_int8_layers(self.module, layers)
            self.packing = None
        check_materialized(self.module, self.file.path)
        self._map_afresh()

    def _map_afresh(self) -> None:
        """Point the tensors the model still reads from the load's mapping at a new mapping.

        The load's mapping also holds every page that a replacement made at load read (oneDNN's
        re-laid weights are copies): it goes once nothing refers to it any more.
        """
        mapped, self.mapped = self.mapped, {}
        in_use = dict(self.module.named_parameters()) | dict(self.module.named_buffers())
        kept = [
            name
            for name, tensor in mapped.items()
            if name in in_use and in_use[name].data_ptr() == tensor.data_ptr()
        ]
        self.kept_mapped = kept
        if len(kept) == len(mapped):
            return  # nothing replaced: the load's mapping is the one to keep
        point_at(self.module, _read(self.file.path, kept, self.file.layouts, copies=False))

    def mapped_weights(self) -> MappedWeights:
        """The tensors the finished model still reads from its file's mapping."""
        path, layouts = self.file.path, self.file.layouts
        return MappedWeights(
            self.module,
            frozenset(self.kept_mapped),
            lambda names: _read(path, names, layouts, copies=False),
        )

    def cancel(self) -> None:
        if self.packing is not None:
            self.packing.cancel()


class PreparedLoad:
    """The three models of a directory loaded from their prepared files (prepared if needed).

    Opening prepares what is missing and starts packing the int8 layers in the background;
    :meth:`models` assigns the float tensors; the caller may then replace layers (oneDNN);
    :meth:`finish` installs the int8 layers and drops every page those replacements read.
    ``only``: load these of the three models (in ``formats``), e.g. a second flow and HiFT in
    other formats beside a full load; then :meth:`assigned` hands them out.
    """

    def __init__(
        self,
        model_dir: Path,
        formats: WeightFormats,
        cache_dir: Path | None,
        parts: ModelParts,
        only: Collection[str] = PARTS,
    ) -> None:
        self.model_dir = Path(model_dir)
        self.parts = parts
        self.args = parts.read_args(self.model_dir)
        self.prepared_now: list[str] = []
        self._parts: dict[str, _PartLoad] = {}
        self.speakers: dict[str, torch.Tensor] = {}
        try:
            for part in PARTS:
                if part in only:
                    self._open(part, formats.of(part), cache_dir)
            if set(PARTS) <= set(only):
                self.speakers = parts.read_speakers(self.model_dir)
        except BaseException:
            self.cancel()
            raise

    def _open(self, part: str, weights: str, cache_dir: Path | None) -> None:
        module = run_module_on_meta(self.args, part, weights, self.parts)
        checked, prepared_now = ensure_prepared(
            self.model_dir, self.args, part, weights, cache_dir, module, self.parts
        )
        if prepared_now:
            self.prepared_now.append(f"{part}.{weights}")
        names = _int8_names(module, part, weights, self.parts)
        load = _PartLoad(module, checked, names, part, self.parts, weights)
        load.start_packing(quantised_part_specs(module, names, weights))
        self._parts[part] = load

    def assigned(self) -> dict[str, nn.Module]:
        """Each loaded model by part, with its float tensors assigned (int8 layers still to
        come)."""
        for load in self._parts.values():
            load.assign()
        return {part: load.module for part, load in self._parts.items()}

    def modules(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        """The three models (``PARTS`` order), as :meth:`assigned`."""
        models = self.assigned()
        llm, flow, hift = (models[part] for part in PARTS)
        return llm, flow, hift

    def finish(self) -> None:
        for load in self._parts.values():
            load.finish()

    def mapped_weights(self, module: nn.Module) -> MappedWeights | None:
        """What ``module`` (one of this finished load's models) still reads mapped from its
        prepared file (None: not a model of this load)."""
        for load in self._parts.values():
            if load.module is module:
                return load.mapped_weights()
        return None

    def cancel(self) -> None:
        """Stop the background packing (the load failed)."""
        for load in self._parts.values():
            load.cancel()
