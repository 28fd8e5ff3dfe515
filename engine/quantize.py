"""Opt-in int8 weights for the speech-token LM and the flow (change outputs slightly).

The LM decode step reads every decoder weight once per token, so it is memory-bandwidth bound:
int8 weights (per-output-channel scales, activations quantised on the fly) read 4x fewer bytes.
The 14-layer decoder stack, the output head and the text encoder's blocks are quantised. The
text encoder runs once per sentence, so int8 buys it no speed, but its 300 MB of float32 weights
would otherwise stay resident for that one pass (int8: 75 MB). ``linear_pos`` stays float32: it
is folded into a cached table.
:func:`next_token_kl` measures what the user trades: the KL divergence of the next-token
distributions against the float32 model on the same inputs.

The flow's int8 layers (:func:`flow_int8_layer_names`: its encoder blocks and every Linear of
the estimator) are an approximation for the fast profiles: a quarter of the flow's 400 MB
resident, and faster estimator passes (the mel deviation is printed by the benchmark).

Quantising costs seconds at every start, so :class:`Int8Loader` keeps the result in a cache
file (int8 weights, per-channel scales and zero points, float biases) keyed on the checkpoint's
path, size and mtime, the cache format and the torch version. On a hit the int8 layers are
rebuilt from the cache in a background thread while the rest of the model loads, and the float32
weights of those layers are never read.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from engine.checkpoint_index import cache_file
from engine.cpu import ensure_int8_engine
from engine.pages import file_mapped_ranges, release_if_mapped

if TYPE_CHECKING:
    from engine.flow import FlowModel
    from engine.llm import TransformerLM

_LOGGER = logging.getLogger(__name__)


_QKV = ("linear_q", "linear_k", "linear_v")
FUSED_QKV = "linear_qkv"  # one int8 layer for the three projections of a decoder block


def _int8_names(block: nn.Module) -> list[str]:
    """The int8 layers of one decoder block (``linear_pos`` stays float).

    q, k and v become ONE int8 layer: per-output-channel quantisation makes stacking their rows
    exact, and one call reads the same bytes with a third of the per-call cost (7.0 -> 4.4 ms
    per token for the 14 blocks).
    """
    names = []
    for n, m in block.named_modules():
        if not isinstance(m, nn.Linear) or n.endswith("linear_pos"):
            continue
        parent, _, attr = n.rpartition(".")
        if attr == _QKV[0]:
            names.append(f"{parent}.{FUSED_QKV}" if parent else FUSED_QKV)
        elif attr not in _QKV:
            names.append(n)
    return names


def _float_sources(model: nn.Module, name: str) -> list[nn.Linear]:
    """The float Linear layers behind one int8 layer name (three for a fused q/k/v)."""
    parent, _, attr = name.rpartition(".")
    if attr != FUSED_QKV:
        return [cast(nn.Linear, model.get_submodule(name))]
    owner = model.get_submodule(parent)
    return [getattr(owner, a) for a in _QKV]


def _float_weight_bias(sources: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    if len(sources) == 1:
        return sources[0].weight, sources[0].bias
    biases = [s.bias for s in sources]
    bias = None if any(b is None for b in biases) else torch.cat(tuple(biases))
    return torch.cat(tuple(s.weight for s in sources)), bias


def _block_names(stack: str, blocks: nn.ModuleList) -> list[str]:
    return [f"{stack}.{i}.{name}" for i, block in enumerate(blocks) for name in _int8_names(block)]


def int8_layer_names(model: nn.Module) -> list[str]:
    """Dotted names (in ``llm``) of every layer :func:`quantize_lm_int8` swaps; call it before."""
    llm = cast("TransformerLM", model)  # any module with the LM's layout
    names = [
        *_block_names("text_encoder.encoders", llm.text_encoder.encoders),
        *_block_names("llm.encoders", llm.llm.encoders),
    ]
    return [*names, "llm_decoder"]


def flow_int8_layer_names(model: nn.Module) -> list[str]:
    """The flow's int8 layers: its encoder blocks (as in the LM) and every estimator Linear.

    The estimator is where the time goes (10 passes per chunk, 400 Linear layers at 77-250
    rows); its attention keeps three q/k/v layers, whose calls cost little at those rows.
    """
    flow = cast("FlowModel", model)  # any module with the flow's layout
    estimator = [
        f"decoder.estimator.{n}"
        for n, m in flow.decoder.estimator.named_modules()
        if isinstance(m, nn.Linear)
    ]
    return [*_block_names("encoder.encoders", flow.encoder.encoders), *estimator]


def quantize_lm_int8(llm: nn.Module, keep: FlatInt8Layers | None = None) -> nn.Module:
    """Swap the LM's block, head and text-encoder Linear layers for dynamic int8 ones, in place."""
    return quantize_int8(llm, int8_layer_names(llm), keep)


def quantize_flow_int8(flow: nn.Module, keep: FlatInt8Layers | None = None) -> nn.Module:
    """Swap the flow's encoder-block and estimator Linear layers for int8 ones, in place."""
    return quantize_int8(flow, flow_int8_layer_names(flow), keep)


def quantize_int8(
    model: nn.Module, names: list[str], keep: FlatInt8Layers | None = None
) -> nn.Module:
    """Swap the Linear layers ``names`` of ``model`` for dynamic int8 ones, in place.

    The recipe of ``quantize_dynamic`` with ``per_channel_dynamic_qconfig`` (per-channel
    symmetric qint8 weights, packed for torch's quantized engine: engine.cpu picks one that
    works on this CPU), one layer at a time, releasing each float32
    weight's pages right after, so the float32 layers are never resident as a whole. ``keep``
    receives each layer's plain int8 parts (for the cache: unpacking later costs seconds).
    """
    file_ranges = file_mapped_ranges()
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, which we do not ship.
        warnings.simplefilter("ignore")
        for name in names:
            sources = _float_sources(model, name)
            weight, bias = _float_weight_bias(sources)
            qweight = _quantize_per_channel(weight)
            if keep is not None:
                try:
                    keep.add(name, _plain_parts(qweight, bias))
                except ValueError as err:  # only the cache is lost, never the load
                    _LOGGER.warning("Int8 layers cannot be cached: %s", err)
                    keep.abandon()
                    keep = None
            _replace(model, name, _pack(qweight, bias))
            for source in sources:
                release_if_mapped(source.weight, file_ranges)
    _LOGGER.info("%s quantised to int8 (%d Linear layers)", type(model).__name__, len(names))
    return model


def _quantize_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """Per-channel symmetric qint8, as ``per_channel_dynamic_qconfig`` observes and rounds."""
    from torch.ao.nn.quantized.modules.utils import _quantize_weight
    from torch.ao.quantization import per_channel_dynamic_qconfig

    observer = per_channel_dynamic_qconfig.weight()
    observer(weight)
    return _quantize_weight(weight.float(), observer)


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """One float Linear's weight as the engine's int8 layer (same recipe, same kernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices, as above
        return _pack(_quantize_per_channel(weight), bias)


def _op_entry(overload: Any) -> Callable[..., torch.Tensor]:
    """The C++ entry point of an op overload (its Python wrapper if none)."""
    return getattr(overload, "_op", overload)


_LINEAR_DYNAMIC = _op_entry(torch.ops.quantized.linear_dynamic.default)
_LINEAR_RELU_DYNAMIC = _op_entry(torch.ops.quantized.linear_relu_dynamic.default)


class Int8Linear(DynamicLinear):
    """torch's dynamic int8 Linear (same packing, same kernel), called without its wrappers.

    The module's forward goes through the op packet's torchbind checks, keyword parsing and a
    no-op ``.to``: ~30 us a call on top of the kernel, and a generated token makes 57 calls.
    This forward makes the same kernel call (``reduce_range=True``, as torch's does, except
    under QNNPACK, which ignores it and warns each process that it does).
    """

    reduce_range = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LINEAR_DYNAMIC(x, self._packed_params._packed_params, self.reduce_range)

    def forward_relu(self, x: torch.Tensor) -> torch.Tensor:
        """relu(forward(x)) in one kernel call: the ReLU runs in the kernel's epilogue."""
        return _LINEAR_RELU_DYNAMIC(x, self._packed_params._packed_params, self.reduce_range)


def _pack(qweight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """A dynamic int8 Linear around a per-channel qint8 weight, packed as ``from_float`` does."""
    # torch's default engine is not chosen for the CPU (on aarch64 it cannot pack).
    ensure_int8_engine()
    # A 1x1 shell resized: the full-size constructor packs a zero weight first (~15 ms a layer).
    module = Int8Linear(1, 1, dtype=torch.qint8)
    module.in_features, module.out_features = qweight.shape[1], qweight.shape[0]
    # fbgemm keeps the bias tensor it is given: a copy, so that no packed layer holds on to
    # (or reads) a mapped checkpoint or cache file, whose unused pages are fenced off.
    module.set_weight_bias(qweight, None if bias is None else bias.detach().clone())
    module.reduce_range = torch.backends.quantized.engine != "qnnpack"
    return module


def _plain_parts(qweight: torch.Tensor, bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """int8 weight, float64 scales, int64 zero points and float32 bias (absent if none)."""
    if qweight.qscheme() != torch.per_channel_affine or qweight.q_per_channel_axis() != 0:
        raise ValueError(f"unexpected quantisation scheme {qweight.qscheme()}")
    parts = {
        "weight": qweight.int_repr(),
        "scales": qweight.q_per_channel_scales(),
        "zero_points": qweight.q_per_channel_zero_points(),
    }
    if bias is not None:
        parts["bias"] = bias.detach().clone()  # a view would save its whole (mapped) storage
    return parts


# --- the on-disk cache of the int8 layers -----------------------------------------------------

CACHE_FORMAT = 4  # bump when the file layout or the quantisation recipe changes
_DTYPES = {
    "weight": torch.int8,
    "scales": torch.float64,
    "zero_points": torch.int64,
    "bias": torch.float32,
}
_PARTS = tuple(_DTYPES)


def _part_sizes(out: int, n_in: int, has_bias: bool) -> dict[str, int]:
    """Elements of each part of one ``out`` x ``n_in`` int8 layer."""
    return {"weight": out * n_in, "scales": out, "zero_points": out, "bias": out if has_bias else 0}


class CacheError(Exception):
    """A cache file that must not be used: stale, truncated, corrupt or not fitting the model."""


class CachedLayer(NamedTuple):
    module: nn.Module  # a packed dynamic int8 Linear
    has_bias: bool  # known without unpacking (``module.bias()`` unpacks the whole weight)


def default_int8_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/wyoming-cosyvoice/int8``, else ``~/.cache/wyoming-cosyvoice/int8``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says to ignore a relative value.
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "wyoming-cosyvoice" / "int8"


def cache_path(cache_dir: Path, source: Path) -> Path:
    """The int8 cache file of one checkpoint (``llm.pt``, ``flow.pt``)."""
    return cache_file(cache_dir, source, ".int8.pt")


def source_key(source: Path) -> dict[str, object]:
    """What a cache must match to be used: format, torch version and the checkpoint's identity."""
    source = Path(source).resolve()
    st = source.stat()
    return {
        "format": CACHE_FORMAT,
        "torch": str(torch.__version__),
        "source": str(source),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
    }


def _crc(tensor: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes: torch.load does not check mmap'd data, a flipped byte would
    otherwise go unnoticed."""
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy()
    return zlib.crc32(data)  # type: ignore[arg-type]  # an ndarray is a buffer; numpy's stubs say so from Python 3.12


class FlatInt8Layers:
    """The int8 layers' plain parts as the cache file holds them: one flat tensor per part
    (``weight`` has every layer's int8 weight back to back, in layer order) and an index of
    shapes and per-layer CRCs.

    Four tensors instead of ~320 small ones: unpickling those cost 0.1-0.35 s of GIL-bound work
    at every cached start before the first layer could be packed.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], index: list[dict]) -> None:
        self.tensors, self.index = tensors, index
        self._offsets = dict.fromkeys(_PARTS, 0)

    @classmethod
    def for_model(cls, model: nn.Module, names: list[str]) -> FlatInt8Layers:
        """Room for the int8 layers ``names`` of ``model``, to be filled with :meth:`add`."""
        totals = dict.fromkeys(_PARTS, 0)
        for name in names:
            sources = _float_sources(model, name)
            sizes = _part_sizes(
                sum(s.out_features for s in sources),
                sources[0].in_features,
                all(s.bias is not None for s in sources),
            )
            for part, size in sizes.items():
                totals[part] += size
        return cls({part: torch.empty(n, dtype=_DTYPES[part]) for part, n in totals.items()}, [])

    def add(self, name: str, parts: dict[str, torch.Tensor]) -> None:
        """Copy one layer's parts into the next free slices (layers in :meth:`for_model` order).

        ValueError when they do not fit: only the cache is lost then, never the load.
        """
        for part, t in parts.items():
            start = self._offsets[part]
            if start + t.numel() > self.tensors[part].numel():
                raise ValueError(f"{name}.{part} does not fit the space set aside for it")
            self.tensors[part][start : start + t.numel()] = t.reshape(-1)
            self._offsets[part] = start + t.numel()
        self.index.append(
            {
                "name": name,
                "out": int(parts["weight"].shape[0]),
                "in": int(parts["weight"].shape[1]),
                "bias": "bias" in parts,
                "crc32": {part: _crc(t) for part, t in parts.items()},
            }
        )

    def abandon(self) -> None:
        """Give the memory back: these layers will not be cached."""
        self.tensors, self.index = {}, []

    @property
    def complete(self) -> bool:
        return bool(self.tensors) and all(
            self._offsets[part] == t.numel() for part, t in self.tensors.items()
        )

    @classmethod
    def from_saved(cls, index: object, tensors: object) -> FlatInt8Layers:
        """Check a loaded index against its tensors (raises CacheError if they do not fit)."""
        if not isinstance(index, list) or not isinstance(tensors, dict):
            raise CacheError("corrupt index")
        for part in _PARTS:
            t = tensors.get(part)
            if not torch.is_tensor(t) or t.dim() != 1 or t.dtype != _DTYPES[part]:
                raise CacheError(f"corrupt {part} data")
        flat = cls(tensors, index)
        for entry in index:
            try:
                name, out, n_in, crcs = entry["name"], entry["out"], entry["in"], entry["crc32"]
                has_bias = entry["bias"] is True
            except (KeyError, TypeError) as err:
                raise CacheError("corrupt index") from err
            if (
                not isinstance(name, str)
                or not isinstance(crcs, dict)
                or not all(isinstance(n, int) and n > 0 for n in (out, n_in))
            ):
                raise CacheError("corrupt index")
            sizes = _part_sizes(out, n_in, has_bias)
            if set(crcs) != {part for part, size in sizes.items() if size}:
                raise CacheError(f"corrupt index entry for {name}")
            for part, size in sizes.items():
                flat._offsets[part] += size
                if flat._offsets[part] > tensors[part].numel():
                    raise CacheError(f"truncated {part} data")
        if not flat.complete:
            raise CacheError("data left over after the last layer")
        return flat

    def layers(self) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, int]]]:
        """Each layer's parts, as views of the flat tensors, with the CRCs recorded for them."""
        offsets = dict.fromkeys(_PARTS, 0)
        layers = {}
        for entry in self.index:
            out, n_in = entry["out"], entry["in"]
            parts = {}
            for part, size in _part_sizes(out, n_in, entry["bias"]).items():
                if size:
                    parts[part] = self.tensors[part][offsets[part] : offsets[part] + size]
                offsets[part] += size
            parts["weight"] = parts["weight"].view(out, n_in)
            layers[entry["name"]] = (parts, entry["crc32"])
        return layers


def write_cache(path: Path, key: dict[str, object], flat: FlatInt8Layers) -> bool:
    """Save atomically (temp file + rename); False, with a warning, when it cannot be written."""
    meta = {**key, "layers": flat.index}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(tmp, "wb") as f:
                torch.save({"meta": meta, "tensors": flat.tensors}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)  # a reader sees the old file or the whole new one
        finally:
            tmp.unlink(missing_ok=True)
    except (OSError, RuntimeError) as err:  # torch.save reports a full disk as RuntimeError
        _LOGGER.warning("Cannot write the int8 cache %s (%s); going on without it", path, err)
        return False
    _LOGGER.info("Saved the int8 weights to %s", path)
    return True


def _per_channel_view(
    weight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """A per-channel qint8 tensor over ``weight``'s own bytes (axis 0), without a copy.

    ``torch._make_per_channel_quantized_tensor`` copies the int8 data: for the full-size LM that
    is 255 MB of fresh pages written once and freed right after packing, ~0.3 s of CPU at
    every cached start. fbgemm's packing only reads the weight, so a view of the (mapped)
    cache bytes is enough.
    """
    qweight = torch._empty_per_channel_affine_quantized(
        [0, weight.shape[1]], scales=scales, zero_points=zero_points, axis=0, dtype=torch.qint8
    )
    qweight.set_(weight.untyped_storage(), weight.storage_offset(), weight.shape, weight.stride())
    return qweight


def _build_layer(parts: dict[str, torch.Tensor]) -> nn.Module:
    """A dynamic int8 Linear from cached parts, packed exactly as a fresh quantisation."""
    weight = parts["weight"].contiguous()
    return _pack(
        _per_channel_view(weight, parts["scales"], parts["zero_points"]), parts.get("bias")
    )


def read_cache(
    path: Path, key: dict[str, object], cancel: threading.Event | None = None
) -> dict[str, CachedLayer]:
    """Validate a cache file and build its int8 layers (raises CacheError).

    Each layer's CRC is checked right before it is packed, then its mapped int8 pages are
    released: the packed copy is what stays resident. Layers are packed by one worker per core.
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # whatever torch raises for a damaged file: rebuild, never crash
        first_line = (str(err).strip().splitlines() or [""])[0]
        raise CacheError(f"unreadable: {type(err).__name__}: {first_line}") from err
    meta = obj.get("meta") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or "tensors" not in obj:
        raise CacheError("not an int8 cache")
    changed = [k for k, v in key.items() if meta.get(k) != v]
    if changed:
        raise CacheError(f"stale: {', '.join(changed)} changed")
    layers = FlatInt8Layers.from_saved(meta.get("layers"), obj["tensors"]).layers()
    file_ranges = file_mapped_ranges()

    def build(name: str) -> CachedLayer:
        if cancel is not None and cancel.is_set():
            raise CacheError("cancelled")
        parts, crcs = layers[name]
        for part, t in parts.items():
            if _crc(t) != crcs[part]:
                raise CacheError(f"corrupt data in {name}.{part}")
        layer = CachedLayer(_build_layer(parts), "bias" in parts)
        release_if_mapped(parts["weight"], file_ranges)
        return layer

    # Packing releases the GIL and is the bulk of a cached start (~1.7 s single-threaded for
    # the full-size LM, ~0.7 s for the flow): one worker per core halves it.
    pool = ThreadPoolExecutor(max_workers=_pack_workers(), thread_name_prefix="int8-pack")
    try:
        return dict(zip(layers, pool.map(build, layers), strict=True))
    finally:  # a bad layer: the layers not yet started are not packed for nothing
        pool.shutdown(wait=True, cancel_futures=True)


def _pack_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _mismatch(model: nn.Module, names: list[str], layers: dict[str, CachedLayer]) -> str | None:
    """Why cached layers do not fit this model (None when they do); reads no weight."""
    if list(layers) != names:
        return "its layers are not this model's"
    for name, (module, has_bias) in layers.items():
        sources = _float_sources(model, name)
        shape = (sources[0].in_features, sum(s.out_features for s in sources))
        if (
            any(s.in_features != shape[0] for s in sources)
            or shape != (module.in_features, module.out_features)
            or all(s.bias is not None for s in sources) != has_bias
        ):
            return f"{name} has another shape"
    return None


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    """Install an int8 layer; a fused q/k/v replaces the block's three float projections."""
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    module.train(owner.training)
    setattr(owner, attr, module)
    if attr == FUSED_QKV:
        for source in _QKV:
            delattr(owner, source)


def _prime_quantized_warnings() -> None:
    """Trigger torch's once-per-process deprecation warnings of quantised tensors here.

    The loader thread cannot filter them (``warnings.catch_warnings`` is process-global, not
    thread-safe); torchao, their replacement, is not shipped.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _build_layer(
            {
                "weight": torch.zeros(1, 1, dtype=torch.int8),
                "scales": torch.ones(1, dtype=torch.float64),
                "zero_points": torch.zeros(1, dtype=torch.int64),
            }
        )


class Int8Loader:
    """The int8 layers ``layer_names(model)`` of one checkpoint, through an on-disk cache.

    Create it before loading the float32 model: a present cache is then validated and packed in
    the background (packing costs ~7 ns per weight, releases the GIL and runs one worker per
    core) while the rest loads. :meth:`apply` swaps the cached layers in, or, when there is no
    usable cache, quantises afresh with :func:`quantize_int8` and writes the cache. A cache
    that cannot be used is logged as a warning and rebuilt; one that cannot be written is
    skipped.
    """

    def __init__(
        self, source: Path, cache_dir: Path | None, layer_names: Callable[[nn.Module], list[str]]
    ) -> None:
        self.path = cache_path(cache_dir, source) if cache_dir is not None else None
        self._source = Path(source)
        self._layer_names = layer_names
        self._cancel = threading.Event()
        self._layers: dict[str, CachedLayer] | None = None
        self._problem: str | None = None
        self._thread: threading.Thread | None = None
        try:
            # Taken now: a checkpoint replaced during the load must not be cached under its key.
            self._key: dict[str, object] | None = source_key(self._source)
        except OSError:
            self._key = None  # no checkpoint: the model load reports it
        if self.path is not None and self._key is not None and self.path.is_file():
            _prime_quantized_warnings()
            self._thread = threading.Thread(target=self._read, name="int8-cache", daemon=True)
            self._thread.start()

    @classmethod
    def for_lm(cls, model_dir: Path, cache_dir: Path | None) -> Int8Loader:
        return cls(Path(model_dir) / "llm.pt", cache_dir, int8_layer_names)

    @classmethod
    def for_flow(cls, model_dir: Path, cache_dir: Path | None) -> Int8Loader:
        return cls(Path(model_dir) / "flow.pt", cache_dir, flow_int8_layer_names)

    def _read(self) -> None:
        assert self.path is not None and self._key is not None
        try:
            self._layers = read_cache(self.path, self._key, self._cancel)
        except CacheError as err:
            self._problem = str(err)
        except Exception as err:  # a damaged cache must never take the load down
            self._problem = f"{type(err).__name__}: {err}"

    def cancel(self) -> None:
        """Stop the background read (the model load failed)."""
        self._cancel.set()

    def apply(self, model: nn.Module) -> bool:
        """Make the layers of ``model`` int8, in place; True when the cache was used."""
        if self._thread is not None:
            self._thread.join()
        names = self._layer_names(model)
        if self._layers is not None:
            self._problem = _mismatch(model, names, self._layers)
            if self._problem is None:
                for name, layer in self._layers.items():
                    _replace(model, name, layer.module)
                _LOGGER.info("%s: int8 weights read from %s", self._source.name, self.path)
                self._layers = None
                return True
            self._layers = None
        if self._problem is not None:
            _LOGGER.warning("Int8 cache %s not used (%s); rebuilding it", self.path, self._problem)
        if self.path is None or self._key is None:
            quantize_int8(model, names)
            return False
        flat = FlatInt8Layers.for_model(model, names)
        quantize_int8(model, names, keep=flat)
        try:
            changed = source_key(self._source) != self._key
        except OSError:
            changed = True
        if changed:
            _LOGGER.warning("%s changed while loading; int8 cache not written", self._source)
        elif flat.complete and [entry["name"] for entry in flat.index] == names:
            write_cache(self.path, self._key, flat)
        return False


def next_token_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per row, in nats, from two (N, V) logit tensors."""
    ref = reference.float().log_softmax(-1)
    cand = candidate.float().log_softmax(-1)
    return (ref.exp() * (ref - cand)).sum(-1)
