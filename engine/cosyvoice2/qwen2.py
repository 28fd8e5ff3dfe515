"""The Qwen2 decoder stack that CosyVoice2's speech LM runs on (no ``transformers`` inside).

Sizes come from the model folder's ``CosyVoice-BlankEN/config.json``; the weights come from
``llm.pt`` (the folder's own weights are not used). Attribute names equal the checkpoint's keys
below ``llm.model.``, so ``load_state_dict(strict=True)`` works on the official file.

A block is pre-norm: ``x + o_proj(attention(rope(q), rope(k), v))`` over ``input_layernorm(x)``,
then ``x + down_proj(silu(gate_proj(h)) * up_proj(h))`` over ``post_attention_layernorm(x)``.
Norms are RMSNorm without bias; q/k/v have biases, o_proj and the MLP do not. Attention is
grouped-query: ``num_attention_heads`` query heads share ``num_key_value_heads`` K/V heads, so
the cache holds only the K/V heads. Rotary positions rotate the two halves of each head
(``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``), angle ``position * theta^(-2i/head_dim)``.

Decoding uses a preallocated :class:`engine.core.transformer.KVCache` (layers, 2, B, K/V heads,
max_len, head_dim): :meth:`Qwen2Model.forward_cached` appends any number of positions (a prompt
prefill or one decode step). The single-sequence decode step has its own path with a handful of
ops per layer (it runs 24 times a token). Optional int8 layers fuse q/k/v and gate/up into one
int8 layer each (:func:`quantize_qwen2_int8`; per-output-channel scales make the stacking exact).
"""

from __future__ import annotations

import functools
import json
import math
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core import decode_step, native
from engine.core.decode_attention import attend_one
from engine.core.hparams import ModelConfigError
from engine.core.quantize import lm_int8_linear
from engine.core.transformer import KVCache

CONFIG_FILE = "config.json"

# int8 layer name -> the float layers it replaces (rows stacked in this order)
FUSED_SOURCES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


@dataclass(frozen=True)
class Qwen2Config:
    """The backbone's sizes (the fields of a Qwen2 ``config.json`` the maths depends on)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ModelConfigError("hidden_size must be a multiple of num_attention_heads")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = CONFIG_FILE) -> Qwen2Config:
        """Read the fields from a parsed ``config.json``; refuse variants we do not compute."""
        unsupported = []
        if data.get("hidden_act", "silu") != "silu":
            unsupported.append(f"hidden_act {data.get('hidden_act')!r}")
        if data.get("use_sliding_window", False):
            unsupported.append("use_sliding_window")
        if data.get("rope_scaling"):
            unsupported.append("rope_scaling")
        if unsupported:
            raise ModelConfigError(f"{source}: unsupported Qwen2 setting: {', '.join(unsupported)}")

        def number(key: str, kind: type, default: Any = ...) -> Any:
            value = data.get(key, default)
            if value is ... or isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ModelConfigError(f"{source}: '{key}' must be a number")
            if kind is int and value != int(value):
                raise ModelConfigError(f"{source}: '{key}' must be an integer")
            return kind(value)

        heads = number("num_attention_heads", int)
        return cls(
            vocab_size=number("vocab_size", int),
            hidden_size=number("hidden_size", int),
            intermediate_size=number("intermediate_size", int),
            num_hidden_layers=number("num_hidden_layers", int),
            num_attention_heads=heads,
            num_key_value_heads=number("num_key_value_heads", int, heads),
            rope_theta=number("rope_theta", float, 10000.0),
            rms_norm_eps=number("rms_norm_eps", float, 1e-6),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )

    @classmethod
    def read(cls, path: Path) -> Qwen2Config:
        """``config.json`` (or the folder holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / CONFIG_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as err:
            raise ModelConfigError(f"cannot read {path}: {err.strerror or err}") from err
        except json.JSONDecodeError as err:
            raise ModelConfigError(f"{path} is not valid JSON: {err}") from err
        if not isinstance(data, dict):
            raise ModelConfigError(f"{path}: expected a JSON object")
        return cls.from_dict(data, str(path))


# --- rotary positions ---------------------------------------------------------------------------


_MIN_ROTARY_LEN = 256
_rotary_tables: dict[tuple[int, float], tuple[Tensor, Tensor]] = {}
_rotary_lock = threading.Lock()


def inverse_frequencies(head_dim: int, theta: float) -> Tensor:
    """theta^(-2i/head_dim), computed from an integer range in float32 as the reference does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


def rotary_rows(head_dim: int, theta: float, length: int) -> tuple[Tensor, Tensor]:
    """(cos, signed sin) of the angles of positions 0…N-1, (N >= length, head_dim) each, shared.

    angle = position * inverse frequency (both halves of a head use the same angles); the sin
    row's first half is negated, the sign :func:`rotate` needs. Grown by doubling; the values
    of a row do not depend on the table's length.
    """
    key = (head_dim, theta)
    table = _rotary_tables.get(key)
    if table is not None and table[0].shape[0] >= length:
        return table
    with _rotary_lock:
        table = _rotary_tables.get(key)
        have = 0 if table is None else table[0].shape[0]
        if have < length:
            size = max(_MIN_ROTARY_LEN, 2 * have)
            while size < length:
                size *= 2
            positions = torch.arange(size, dtype=torch.float32, device="cpu").unsqueeze(1)
            angles = positions * inverse_frequencies(head_dim, theta)
            sin = angles.sin()
            cos = angles.cos()
            table = _rotary_tables[key] = (torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1))
        assert table is not None
        return table


def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor, out: Tensor | None = None) -> Tensor:
    """Rotary embedding of x (..., T, head_dim) with the rows of :func:`rotary_rows` (T, hd).

    ``[x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]``: the halves swapped by one ``roll``
    times the signed sin (the same products as negating x2, bit for bit). ``out`` may be x.
    """
    turned = x.roll(x.shape[-1] // 2, -1).mul_(signed_sin)
    return torch.add(turned, x * cos, out=out)


# --- blocks -----------------------------------------------------------------------------------


@functools.cache
def _norm_kernel() -> ModuleType | None:
    """The engine's one-operator RMS norm (engine/core/native/norm_avx2.cpp), where built and
    this CPU runs it."""
    return native.load("norm_avx2")


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) * weight, computed in float32.

    In float32 without autograd it is one operator: the engine's kernel where it runs (a decode
    step normalises 49 single rows, and torch's rms_norm spends several operators' dispatch on
    each), else torch's rms_norm. Both compute the same formula in the same order.
    """

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            kernel = _norm_kernel()
            if kernel is not None and x.device.type == "cpu" and not torch.is_grad_enabled():
                return kernel.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Qwen2Attention(nn.Module):
    """Grouped-query self-attention with rotary positions (``self_attn``)."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        d, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
        self.q_proj = nn.Linear(d, d)
        self.k_proj = nn.Linear(d, kv)
        self.v_proj = nn.Linear(d, kv)
        self.o_proj = nn.Linear(d, d, bias=False)
        # The int8 stack puts q, k and v in one layer here and drops the three.
        self.qkv_proj: nn.Module | None = None
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, T, heads·hd), k and v (B, T, kv_heads·hd)."""
        if self.qkv_proj is not None:
            q_dim = self.heads * self.head_dim
            kv_dim = self.kv_heads * self.head_dim
            q, k, v = self.qkv_proj(x).split([q_dim, kv_dim, kv_dim], dim=-1)
            return q, k, v
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward_cached(
        self, x: Tensor, cache: KVCache, layer: int, start: int, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """x (B, T, d) at positions start…start+T-1, causal; appends its K/V to the cache."""
        b, t, _ = x.shape
        length = start + t
        q, k, v = self._project(x)
        q = rotate(q.view(b, t, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        k = rotate(k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2), cos, sin)
        kc, vc = cache.kv[layer, 0], cache.kv[layer, 1]  # (B, kv_heads, max_len, hd)
        kc[:, :, start:length] = k
        vc[:, :, start:length] = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        mask = None
        if t > 1:  # causal over the new positions; every cached one is visible
            mask = torch.ones(t, length, dtype=torch.bool, device=x.device).tril(start)
        out = F.scaled_dot_product_attention(
            q, kc[:, :, :length], vc[:, :, :length], attn_mask=mask, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def decode_position(
        self, x: Tensor, slot: Tensor, keys: Tensor, values: Tensor, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """One new position of one sequence, in few ops (same maths as ``forward_cached``).

        x (1, 1, d); ``slot`` (2, kv_heads, hd) is the cache's room for this position's K/V;
        ``keys``/``values`` (kv_heads, L, hd) the cache up to and including it; cos/sin (hd,)
        the position's rows of :func:`rotary_rows`.
        The query heads of a group are one batch row against their shared K/V head.
        """
        q_dim = self.heads * self.head_dim
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(-1)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).view(-1)
        kv_dim = self.kv_heads * self.head_dim
        # q and k rotated in one go, in place: (heads + kv_heads, hd) rows at the same position.
        # qkv then holds [q | k | v] as the cache stores them, and k and v go in with one copy.
        qk = qkv[: q_dim + kv_dim].view(-1, self.head_dim)
        rotate(qk, cos, sin, out=qk)
        slot.copy_(qkv[q_dim:].view(2, self.kv_heads, self.head_dim))
        group = self.heads // self.kv_heads
        q = qkv[:q_dim].view(self.kv_heads, group, self.head_dim)
        out = attend_one(q, keys, values, self.scale)  # (kv_heads, group, hd)
        return self.o_proj(out.view(1, 1, -1))


class Qwen2MLP(nn.Module):
    """SwiGLU feed-forward (``mlp``): down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        d, units = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, units, bias=False)
        self.up_proj = nn.Linear(d, units, bias=False)
        self.down_proj = nn.Linear(units, d, bias=False)
        # The int8 stack puts gate and up in one layer here and drops the two.
        self.gate_up_proj: nn.Module | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        # in place: gate and up are the products' fresh outputs (one allocation less per call)
        return self.down_proj(F.silu(gate, inplace=True).mul_(up))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_cached(
        self, x: Tensor, cache: KVCache, layer: int, start: int, cos: Tensor, sin: Tensor
    ) -> Tensor:
        x = x + self.self_attn.forward_cached(
            self.input_layernorm(x), cache, layer, start, cos, sin
        )
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_position(
        self, x: Tensor, slot: Tensor, keys: Tensor, values: Tensor, cos: Tensor, sin: Tensor
    ) -> Tensor:
        """One position; adds to ``x`` in place (the decode step's own running row)."""
        attn = self.self_attn.decode_position(self.input_layernorm(x), slot, keys, values, cos, sin)
        x.add_(attn)
        return x.add_(self.mlp(self.post_attention_layernorm(x)))


class Qwen2Model(nn.Module):
    """Token embedding, the decoder layers and the final norm (``llm.model.model``)."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # The decode step in one native call (engine.core.decode_step), built from the layers
        # at each prefill: (the layers it was built from, the step or None where it cannot run).
        self._native_step: tuple[tuple[nn.Module, ...], Any] | None = None

    def _layers(self) -> Iterable[Qwen2DecoderLayer]:
        return cast(Iterable[Qwen2DecoderLayer], self.layers)

    def new_cache(
        self,
        batch: int,
        max_len: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> KVCache:
        """An empty cache for ``max_len`` positions (uninitialised: only written rows are read)."""
        w = self.norm.weight  # stays float when the Linear layers are int8
        cfg = self.cfg
        kv = torch.empty(
            cfg.num_hidden_layers,
            2,
            batch,
            cfg.num_key_value_heads,
            max_len,
            cfg.head_dim,
            dtype=dtype or w.dtype,
            device=device or w.device,
        )
        return KVCache(kv=kv)

    def forward_cached(self, x: Tensor, cache: KVCache) -> Tensor:
        """Append T input embeddings (B, T, d) at the cache's next positions; (B, T, d) normed."""
        b, t, _ = x.shape
        start = cache.length
        length = start + t
        if length > cache.max_len:
            raise ValueError(f"KV cache full: {length} > {cache.max_len} positions")
        cos, sin = rotary_rows(self.cfg.head_dim, self.cfg.rope_theta, length)
        cos = cos[start:length].to(dtype=x.dtype, device=x.device)
        sin = sin[start:length].to(dtype=x.dtype, device=x.device)
        if t == 1 and b == 1:
            step = self._native_layers(x, cache)
            if step is not None:
                x = step.step(x, cache.kv, start, cos[0], sin[0])
                cache.length = length
                return self.norm(x)
            return self._decode_position(x, cache, cos[0], sin[0])
        self._native_step = None  # a prefill starts each answer: the step is built anew
        for i, layer in enumerate(self._layers()):
            x = layer.forward_cached(x, cache, i, start, cos, sin)
        cache.length = length
        return self.norm(x)

    def _native_layers(self, x: Tensor, cache: KVCache) -> Any | None:
        """The native decode step over these layers, where every one of them runs natively."""
        if not decode_step.runs(x, cache.kv, self.cfg.head_dim):
            return None
        layers = tuple(self._layers())
        if self._native_step is None or self._native_step[0] != layers:
            self._native_step = (layers, _native_qwen2_layers(layers, self.cfg))
        return self._native_step[1]

    def _decode_position(self, x: Tensor, cache: KVCache, cos: Tensor, sin: Tensor) -> Tensor:
        start = cache.length
        length = start + 1
        kv = cache.kv[:, :, 0]  # (layers, 2, kv_heads, max_len, hd)
        slots = kv[:, :, :, start].unbind(0)  # per layer (2, kv_heads, hd)
        keys = kv[:, 0, :, :length].unbind(0)  # per layer (kv_heads, L, hd)
        values = kv[:, 1, :, :length].unbind(0)
        x = x.clone()  # the layers add to it in place; the caller's row may be a weight's view
        for layer, slot, k, v in zip(self._layers(), slots, keys, values, strict=True):
            x = layer.decode_position(x, slot, k, v, cos, sin)
        cache.length = length
        return self.norm(x)


def _native_qwen2_layers(layers: Sequence[Qwen2DecoderLayer], cfg: Qwen2Config) -> Any | None:
    """The native step's copy of ``layers`` (the same tensors), or None unless each layer's
    q/k/v, output and fused gate/up and down products are the engine's kernels and its norms
    float32."""
    step = decode_step.kernel()
    assert step is not None
    native_layers = []
    eps = layers[0].input_layernorm.eps
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if attn.qkv_proj is None or mlp.gate_up_proj is None:
            return None
        if layer.input_layernorm.eps != eps or layer.post_attention_layernorm.eps != eps:
            return None
        if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
            return None
        linears = [
            decode_step.native_linear(m)
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ]
        if any(linear is None for linear in linears):
            return None
        native_layers.append(step.Qwen2Layer(norms[0].detach(), norms[1].detach(), *linears))
    return step.Qwen2Layers(
        native_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps
    )


class Qwen2CausalLM(nn.Module):
    """The backbone plus its text head (``llm.model``).

    The speech LM reads hidden states only: ``lm_head`` is kept so the checkpoint loads
    strictly, and it is the embedding matrix itself when the config ties them.
    """

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tie_weights(self) -> None:
        """Point the head at the embedding again (loading by assignment replaces both)."""
        if self.model.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


# --- int8 -------------------------------------------------------------------------------------


def int8_layer_names(model: Qwen2Model, prefix: str = "") -> list[str]:
    """Dotted names of the int8 layers :func:`quantize_qwen2_int8` installs, per block:
    ``self_attn.qkv_proj``, ``self_attn.o_proj``, ``mlp.gate_up_proj``, ``mlp.down_proj``."""
    names = []
    for i in range(len(model.layers)):
        block = f"{prefix}layers.{i}"
        names += [
            f"{block}.self_attn.qkv_proj",
            f"{block}.self_attn.o_proj",
            f"{block}.mlp.gate_up_proj",
            f"{block}.mlp.down_proj",
        ]
    return names


def float_sources(name: str) -> list[str]:
    """The float layers (dotted names) whose rows an int8 layer ``name`` holds, in order."""
    parent, _, attr = name.rpartition(".")
    sources = FUSED_SOURCES.get(attr, (attr,))
    return [f"{parent}.{s}" if parent else s for s in sources]


def install_int8_layer(model: nn.Module, name: str, layer: nn.Module) -> None:
    """Put an int8 layer in place of its float sources (a fused name drops all of them)."""
    parent, _, attr = name.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    layer.train(owner.training)
    for source in FUSED_SOURCES.get(attr, ()):
        delattr(owner, source)
    setattr(owner, attr, layer)


def quantize_int8(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """Swap the layers ``names`` of ``model`` for per-channel int8 ones, in place."""
    for name in names:
        sources = [cast(nn.Linear, model.get_submodule(s)) for s in float_sources(name)]
        weight = torch.cat([s.weight.detach() for s in sources])
        biases = [s.bias for s in sources]
        bias = None if any(b is None for b in biases) else torch.cat([b.detach() for b in biases])
        install_int8_layer(model, name, lm_int8_linear(weight.float(), bias))
    return model


def quantize_qwen2_int8(model: Qwen2Model) -> Qwen2Model:
    """Every block's Linear layers as int8 (q/k/v fused, gate/up fused); embeddings stay float."""
    quantize_int8(model, int8_layer_names(model))
    return model
