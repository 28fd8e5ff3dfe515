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

Quantising is done once, by ``engine.core.prepared``: :func:`int8_parts` gives each layer's plain
parts (int8 weight, per-channel scales, float bias), which the prepared file stores. A load packs
them for the CPU's int8 kernels (:class:`Int8Packing`, in the background while the rest loads);
:func:`quantize_int8` does both steps on a float model, the same way.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear

from engine.core import int8_avx2, qnnpack
from engine.core.cpu import ensure_int8_engine

_LOGGER = logging.getLogger(__name__)


_QKV = ("linear_q", "linear_k", "linear_v")
FUSED_QKV = "linear_qkv"  # one int8 layer for the three projections of a decoder block
# A fused int8 layer -> the float layers whose rows it stacks, in this order: v1's q/k/v, and
# the Qwen2 blocks' q/k/v and gate/up of CosyVoice2's LM (engine.cosyvoice2.qwen2).
FUSED_SOURCES: dict[str, tuple[str, ...]] = {
    FUSED_QKV: _QKV,
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
# The plain parts of int8 layer NAME: NAME.weight (int8, out x in), NAME.weight_scale (float64,
# one per output channel; the weights are symmetric, so no zero points) and NAME.bias (float32).
WEIGHT, SCALE, BIAS = "weight", "weight_scale", "bias"


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


def _source_names(name: str) -> list[str]:
    """The float Linear layers behind one int8 layer name (several for a fused one)."""
    parent, _, attr = name.rpartition(".")
    if attr not in FUSED_SOURCES:
        return [name]
    return [f"{parent}.{a}" if parent else a for a in FUSED_SOURCES[attr]]


def _float_sources(model: nn.Module, name: str) -> list[nn.Linear]:
    return [cast(nn.Linear, model.get_submodule(n)) for n in _source_names(name)]


def _float_weight_bias(sources: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    if len(sources) == 1:
        return sources[0].weight, sources[0].bias
    biases = [s.bias for s in sources]
    bias = None if any(b is None for b in biases) else torch.cat(tuple(biases))
    return torch.cat(tuple(s.weight for s in sources)), bias


def float_layer(model: nn.Module, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the float layer(s) behind quantised layer ``name``, rows stacked."""
    return _float_weight_bias(_float_sources(model, name))


def layer_shape(model: nn.Module, name: str) -> tuple[int, int, bool]:
    """(out, in, has bias) of quantised layer ``name`` (reads no weight)."""
    sources = _float_sources(model, name)
    out = sum(s.out_features for s in sources)
    return out, sources[0].in_features, all(s.bias is not None for s in sources)


def _block_names(stack: str, blocks: nn.ModuleList) -> list[str]:
    return [f"{stack}.{i}.{name}" for i, block in enumerate(blocks) for name in _int8_names(block)]


def int8_layer_names(model: nn.Module) -> list[str]:
    """Dotted names (in ``llm``) of every layer :func:`quantize_lm_int8` swaps; call it before."""
    llm: Any = model  # any module with v1's LM layout (engine.cosyvoice1.llm)
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
    flow: Any = model  # any module with v1's flow layout (engine.cosyvoice1.flow)
    estimator = [
        f"decoder.estimator.{n}"
        for n, m in flow.decoder.estimator.named_modules()
        if isinstance(m, nn.Linear)
    ]
    return [*_block_names("encoder.encoders", flow.encoder.encoders), *estimator]


# --- plain parts: what a prepared file stores ---------------------------------------------------


def replaced_float_keys(model: nn.Module, names: list[str]) -> set[str]:
    """The float state-dict keys that the int8 layers ``names`` replace."""
    keys = set()
    for name in names:
        for source, layer in zip(_source_names(name), _float_sources(model, name), strict=True):
            keys.add(f"{source}.weight")
            if layer.bias is not None:
                keys.add(f"{source}.bias")
    return keys


def int8_part_specs(
    model: nn.Module, names: list[str]
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every plain part of the int8 layers ``names`` (reads no weight)."""
    specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for name in names:
        sources = _float_sources(model, name)
        out = sum(s.out_features for s in sources)
        specs[f"{name}.{WEIGHT}"] = ((out, sources[0].in_features), torch.int8)
        specs[f"{name}.{SCALE}"] = ((out,), torch.float64)
        if all(s.bias is not None for s in sources):
            specs[f"{name}.{BIAS}"] = ((out,), torch.float32)
    return specs


def _quantize_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """Per-channel symmetric qint8, as ``per_channel_dynamic_qconfig`` observes and rounds."""
    from torch.ao.nn.quantized.modules.utils import _quantize_weight
    from torch.ao.quantization import per_channel_dynamic_qconfig

    observer = per_channel_dynamic_qconfig.weight()
    observer(weight)
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, which we do not ship.
        warnings.simplefilter("ignore")
        return _quantize_weight(weight.float(), observer)


def int8_parts(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """Quantise the float layers behind ``names``: their plain parts, keyed as a prepared file
    stores them (``NAME.weight``, ``NAME.weight_scale``, ``NAME.bias``)."""
    parts: dict[str, torch.Tensor] = {}
    for name in names:
        weight, bias = _float_weight_bias(_float_sources(model, name))
        qweight = _quantize_per_channel(weight.detach())
        if qweight.q_per_channel_axis() != 0 or qweight.q_per_channel_zero_points().any():
            raise ValueError(f"{name}: the int8 recipe is no longer per-channel symmetric")
        parts[f"{name}.{WEIGHT}"] = qweight.int_repr()
        parts[f"{name}.{SCALE}"] = qweight.q_per_channel_scales()
        if bias is not None:
            parts[f"{name}.{BIAS}"] = bias.detach().float().contiguous()
    return parts


# --- the run-time layer -------------------------------------------------------------------------


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


def _per_channel_view(
    weight: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor
) -> torch.Tensor:
    """A per-channel qint8 tensor over ``weight``'s own bytes (axis 0), without a copy.

    ``torch._make_per_channel_quantized_tensor`` copies the int8 data: for the full-size LM that
    is 255 MB of fresh pages written once and freed right after packing. The kernels' packing
    only reads the weight (QNNPACK's keeps it until it packs: engine.core.qnnpack), so a view is
    enough.
    """
    qweight = torch._empty_per_channel_affine_quantized(
        [0, weight.shape[1]], scales=scales, zero_points=zero_points, axis=0, dtype=torch.qint8
    )
    qweight.set_(weight.untyped_storage(), weight.storage_offset(), weight.shape, weight.stride())
    return qweight


def _pack(qweight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """A dynamic int8 Linear around a per-channel qint8 weight, packed as ``from_float`` does."""
    # torch's default engine is not chosen for the CPU (on aarch64 it cannot pack).
    ensure_int8_engine()
    # A 1x1 shell resized: the full-size constructor packs a zero weight first (~15 ms a layer).
    module = Int8Linear(1, 1, dtype=torch.qint8)
    module.in_features, module.out_features = qweight.shape[1], qweight.shape[0]
    # fbgemm keeps the bias tensor it is given: a copy, so that no packed layer holds on to the
    # storage of a loaded file.
    module.set_weight_bias(qweight, None if bias is None else bias.detach().clone())
    under_qnnpack = torch.backends.quantized.engine == qnnpack.ENGINE
    module.reduce_range = not under_qnnpack
    if under_qnnpack:
        # QNNPACK packs at a layer's first call and until then holds the weight it was given
        # (a view of the loaded file): packed now, the layer lets it go (engine.core.qnnpack).
        qnnpack.release_packed_originals()
        qnnpack.pack_now(module, module.in_features)
    return module


def pack_int8(parts: Mapping[str, torch.Tensor], name: str) -> Int8Linear:
    """Int8 layer ``name`` packed for this CPU's kernels from its plain parts."""
    weight = parts[f"{name}.{WEIGHT}"].contiguous()
    scales = parts[f"{name}.{SCALE}"]
    zero_points = torch.zeros(scales.shape, dtype=torch.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices of quantised tensors
        return _pack(_per_channel_view(weight, scales, zero_points), parts.get(f"{name}.{BIAS}"))


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
    """One float Linear's weight as the engine's int8 layer (same recipe, same kernel)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation notices, as above
        return _pack(_quantize_per_channel(weight), bias)


def pack_lm_int8(parts: Mapping[str, torch.Tensor], name: str) -> nn.Module:
    """An LM's int8 layer ``name`` from its plain parts: on the engine's AVX2 kernel where it
    runs (the same products as torch's, read faster at one row: engine.core.int8_avx2), else
    as :func:`pack_int8`."""
    weight = parts[f"{name}.{WEIGHT}"]
    if not int8_avx2.fits(weight.shape[1]):
        return pack_int8(parts, name)
    return int8_avx2.Avx2Int8Linear(weight, parts[f"{name}.{SCALE}"], parts.get(f"{name}.{BIAS}"))


def lm_int8_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """One float Linear of an LM as its int8 layer (:func:`pack_lm_int8`, same recipe)."""
    if not int8_avx2.fits(weight.shape[1]):
        return int8_linear(weight, bias)
    qweight = _quantize_per_channel(weight)
    return int8_avx2.Avx2Int8Linear(qweight.int_repr(), qweight.q_per_channel_scales(), bias)


INT8_LINEAR_TYPES = (Int8Linear, int8_avx2.Avx2Int8Linear)  # the engine's int8 Linear layers


def install_int8_layers(model: nn.Module, layers: Mapping[str, nn.Module]) -> None:
    """Put packed int8 layers in place; a fused layer replaces the layers it stacks."""
    for name, module in layers.items():
        parent, _, attr = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        module.train(owner.training)
        setattr(owner, attr, module)
        for source in FUSED_SOURCES.get(attr, ()):
            delattr(owner, source)


def quantize_int8(
    model: nn.Module,
    names: list[str],
    pack: Callable[[Mapping[str, torch.Tensor], str], nn.Module] | None = None,
) -> nn.Module:
    """Swap the Linear layers ``names`` of ``model`` for dynamic int8 ones, in place.

    The recipe of ``quantize_dynamic`` with ``per_channel_dynamic_qconfig`` (per-channel
    symmetric qint8 weights, packed for torch's quantized engine: engine.core.cpu picks one that
    works on this CPU), through the plain parts a prepared file stores. ``pack``: how a layer is
    packed from its parts (default :func:`pack_int8`; an LM's: :func:`pack_lm_int8`).
    """
    pack_layer = pack or pack_int8
    for name in names:  # one layer at a time: never two float copies of the whole model
        install_int8_layers(model, {name: pack_layer(int8_parts(model, [name]), name)})
    _LOGGER.info("%s quantised to int8 (%d Linear layers)", type(model).__name__, len(names))
    return model


def quantize_lm_int8(llm: nn.Module) -> nn.Module:
    """Swap the LM's block, head and text-encoder Linear layers for dynamic int8 ones, in place."""
    return quantize_int8(llm, int8_layer_names(llm), pack_lm_int8)


def quantize_flow_int8(flow: nn.Module) -> nn.Module:
    """Swap the flow's encoder-block and estimator Linear layers for int8 ones, in place."""
    return quantize_int8(flow, flow_int8_layer_names(flow))


# --- packing while the rest loads ---------------------------------------------------------------


def _prime_quantized_warnings() -> None:
    """Trigger torch's once-per-process deprecation warnings of quantised tensors here.

    The packing threads cannot filter them (``warnings.catch_warnings`` is process-global, not
    thread-safe); torchao, their replacement, is not shipped.
    """
    parts = {
        f"x.{WEIGHT}": torch.zeros(1, 1, dtype=torch.int8),
        f"x.{SCALE}": torch.ones(1, dtype=torch.float64),
    }
    pack_int8(parts, "x")


def _pack_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


class Int8Packing:
    """The int8 layers ``names`` packed by background workers while the rest of a model loads.

    ``read(names)`` returns those layers' plain parts; packing copies them, and they are
    dropped right after. Packing costs ~7 ns per weight and releases the GIL: one
    worker per core (at most four) halves it. :meth:`layers` waits for them. ``pack``: how a
    layer is packed from its parts (another format's, e.g. engine.core.int4's; default int8).
    """

    def __init__(
        self,
        names: list[str],
        read: Callable[[list[str]], Mapping[str, torch.Tensor]],
        pack: Callable[[Mapping[str, torch.Tensor], str], nn.Module] | None = None,
    ) -> None:
        self._pack_layer = pack or pack_int8
        _prime_quantized_warnings()
        self._cancelled = threading.Event()
        workers = _pack_workers()
        size = max(1, math.ceil(len(names) / (4 * workers)))  # a few groups per worker
        groups = [names[i : i + size] for i in range(0, len(names), size)]
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="int8-pack")
        self._futures = [self._pool.submit(self._pack, group, read) for group in groups]

    def _pack(
        self, names: list[str], read: Callable[[list[str]], Mapping[str, torch.Tensor]]
    ) -> dict[str, nn.Module]:
        if self._cancelled.is_set():
            return {}
        parts = read(names)
        return {name: self._pack_layer(parts, name) for name in names}

    def layers(self) -> dict[str, nn.Module]:
        """Every packed layer, by name (re-raises a worker's error)."""
        try:
            packed: dict[str, nn.Module] = {}
            for future in self._futures:
                packed.update(future.result())
            return packed
        finally:  # a failed group: the groups not yet started are not packed for nothing
            self._pool.shutdown(wait=True, cancel_futures=True)

    def cancel(self) -> None:
        """Stop packing (the model load failed)."""
        self._cancelled.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


def next_token_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per row, in nats, from two (N, V) logit tensors."""
    ref = reference.float().log_softmax(-1)
    cand = candidate.float().log_softmax(-1)
    return (ref.exp() * (ref - cand)).sum(-1)
