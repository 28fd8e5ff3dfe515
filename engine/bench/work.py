"""The work of one second of speech, counted on the loaded model: what each stage must move or
compute whatever the implementation.

* LM: the bytes one decode step reads. Its weights, counted from the tensors the loaded model
  holds in the format it runs (float32, int8 packed for the CPU's kernels, or any other: a
  format is counted by the bytes of its tensors, not by a table of formats), and its KV cache
  (with v1's relative-position rows) at the positions the measured request's decode steps read.
* Flow: FLOPs of the encoder once per call and of one estimator pass per mel frame (both CFG
  rows when guidance is on), counted with ``torch.utils.flop_counter`` on the loaded modules with
  1 and 2 ODE steps, on the timed request's window (the attention grows with its square).
* HiFT: FLOPs per second of audio, counted in the same run.

Multiplied by a machine's read bandwidth and matrix rate (engine.bench.limits, or a board's
published figures: engine.bench.boards) they give the time no implementation of this maths can
beat there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.bench.timers import StageEvent, StageTimer
from engine.core.onednn_layers import onednn_conv_available, onednn_linear_available

# Sub-modules of the LM that a decode step does not read as weights: ``linear_pos`` (v1: its
# projection depends only on positions; the engine holds the projected rows, read like the K
# cache) and ``lm_head`` (CosyVoice2's backbone text head, never computed by the speech LM).
NOT_READ_PER_TOKEN = ("linear_pos", "lm_head")
POSITION_ROWS = "pos_rows"  # v1's held relative-position rows: read per position, not weights


# --- LM bytes per decode step ----------------------------------------------------------------


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _packed_bytes(module: nn.Module) -> int:
    """A packed int8 layer's weights (torch.ao's dynamic Linear: an opaque blob of the kernel
    library): the int8 weight, one float32 scale per output channel and the bias."""
    weight, bias = module.weight(), module.bias()  # type: ignore[operator]
    scales = weight.q_per_channel_scales().numel() if weight.qscheme() in _PER_CHANNEL else 1
    return _tensor_bytes(weight) + 4 * scales + (_tensor_bytes(bias) if bias is not None else 0)


_PER_CHANNEL = (torch.per_channel_affine, torch.per_channel_symmetric)


def _held_bytes(module: nn.Module) -> int:
    """Bytes of the tensors a module holds itself (its children's not included)."""
    if callable(getattr(module, "weight", None)) and hasattr(module, "_packed_params"):
        return _packed_bytes(module)
    tensors: list[torch.Tensor] = [*module.parameters(recurse=False)]
    tensors += [t for name, t in module.named_buffers(recurse=False) if name != POSITION_ROWS]
    return sum(_tensor_bytes(t) for t in tensors)


def _read_modules(module: nn.Module, name: str = "") -> Iterator[nn.Module]:
    """``module`` and its descendants whose weights a decode step reads: not the ones of
    :data:`NOT_READ_PER_TOKEN`, nor embedding tables (a step reads one row of them)."""
    if name.rpartition(".")[2] in NOT_READ_PER_TOKEN or isinstance(module, nn.Embedding):
        return
    yield module
    for child_name, child in module.named_children():
        yield from _read_modules(child, f"{name}.{child_name}" if name else child_name)


def lm_weight_bytes_per_token(llm: nn.Module) -> int:
    """Weight bytes one decode step reads: the LM stack and its speech-token head.

    Counted on the official sub-modules ``llm`` (v1: the 14 layers and their input layer;
    CosyVoice2: the Qwen2 stack) and ``llm_decoder``, from the tensors they hold in their loaded
    format. The token embeddings are not counted (a step reads one row), nor the modules of
    :data:`NOT_READ_PER_TOKEN`.
    """
    parts = [m for name in ("llm", "llm_decoder") if (m := getattr(llm, name, None)) is not None]
    if not parts:
        raise ValueError("LM has no 'llm'/'llm_decoder' sub-modules to count weights of")
    seen: set[int] = set()
    total = 0
    for part in parts:
        for module in _read_modules(part):
            if id(module) not in seen:
                seen.add(id(module))
                total += _held_bytes(module)
    return total


def lm_cache_bytes_per_position(llm: nn.Module) -> int:
    """Bytes a decode step reads per position already in its sequence: every layer's K and V
    (the engine's own cache layout, in its dtype) and v1's relative-position rows."""
    cache = llm.new_cache(1)  # type: ignore[operator]
    per_position = _tensor_bytes(cache.kv) // cache.max_len
    stack = llm.get_submodule("llm")  # not v1's text encoder: it runs once, at the prefill
    for module in stack.modules():
        rows = getattr(module, POSITION_ROWS, None)
        if isinstance(rows, torch.Tensor):  # (blocks, heads, rows per block, d_k)
            per_position += rows.shape[1] * rows.shape[3] * rows.element_size()
    return per_position


# --- FLOPs of the flow and HiFT per second of audio ------------------------------------------


@dataclass(frozen=True)
class StageFlops:
    """FLOPs per second of audio of the flow (at the profile's steps) and of HiFT, and the
    flow's parts: its encoder and one estimator pass per mel frame."""

    flow_gflop_per_audio_s: float
    hift_gflop_per_audio_s: float
    estimator_mflop_per_frame_step: float  # per ODE step, every CFG row (300M: 172.4 with CFG)
    estimator_mflop_per_frame_pass: float  # per ODE step and row of the CFG batch
    flow_passes: int  # estimator rows per step: 2 with guidance, 1 without
    flow_encoder_gflop_per_audio_s: float
    mel_frames_per_audio_s: float


def _cpu_attention_flops(
    query_shape: tuple[int, ...],
    key_shape: tuple[int, ...],
    value_shape: tuple[int, ...],
    *args: object,
    **kwargs: object,
) -> int:
    """Q·Kᵀ and P·V of torch's CPU attention kernel, which the FLOP counter does not know.

    Without it the flow's attention, quadratic in the chunk length, would be missing from its
    bound (a third of the estimator's time on an 8-second utterance).
    """
    *batch, t_q, d = query_shape
    t_k, d_v = key_shape[-2], value_shape[-1]
    rows = 1
    for size in batch:
        rows *= size
    return 2 * rows * t_q * t_k * (d + d_v)


def _packed_linear_flops(
    input_shape: tuple[int, ...], *args: object, out_shape: tuple[int, ...], **kwargs: object
) -> int:
    """The engine's Linear layers on packed weights (the int8 flow's, the float flow's oneDNN
    ones), which the FLOP counter does not know.

    Without it the flow would count only its convolutions and attention, and its bound would
    shrink by three quarters. Counted as the float product it replaces.
    """
    return 2 * math.prod(input_shape) * out_shape[-1]


def _int8_conv_flops(
    input_shape: tuple[int, ...],
    x_scale: object,
    x_zero_point: object,
    weight_shape: tuple[int, ...],
    *args: object,
    out_shape: tuple[int, ...],
    **kwargs: object,
) -> int:
    """oneDNN's int8 convolutions (``onednn::qconv2d_pointwise``, ``qconv_pointwise``: the int8
    HiFT's residual blocks), which the FLOP counter does not know.

    Without it a vocoder on int8 convolutions would count almost none of its work. Counted as
    the float convolution it replaces: the packed weight keeps the float weight's shape
    (out, in ÷ groups, kernel…), so the count is the float convolution's, product for product.
    """
    return _conv_flops(input_shape, weight_shape, out_shape)


def _packed_conv_flops(
    input_shape: tuple[int, ...],
    *args: tuple[int, ...],
    out_shape: tuple[int, ...],
    **kwargs: object,
) -> int:
    """oneDNN's float convolutions on reordered weights (``mkldnn::_convolution_pointwise``: v1's
    flow estimator), which the FLOP counter does not know either. The weight is the second
    argument, the third in the overloads that add a second operand (``binary``: 13 arguments)."""
    weight_shape = args[1] if len(args) == _BINARY_CONV_ARGS - 1 else args[0]
    return _conv_flops(input_shape, weight_shape, out_shape)


def _conv_flops(
    input_shape: tuple[int, ...], weight_shape: tuple[int, ...], out_shape: tuple[int, ...]
) -> int:
    """torch's own count of a convolution (2 FLOPs a multiply-add, no bias)."""
    from torch.utils.flop_counter import conv_flop_count

    return int(conv_flop_count(list(input_shape), list(weight_shape), list(out_shape)))


_BINARY_CONV_ARGS = 13  # mkldnn::_convolution_pointwise.binary's arguments


def _onednn_int8_convs() -> list[object]:
    """The int8 convolution ops this torch build has (none without oneDNN's quantised ops)."""
    ops = []
    for name in ("qconv2d_pointwise", "qconv_pointwise"):
        try:
            ops.append(getattr(torch.ops.onednn, name))
        except (AttributeError, RuntimeError):  # a build without the op
            continue
    return ops


_EXTRA_FLOPS: dict[object, Callable[..., int]] = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.quantized.linear_dynamic: _packed_linear_flops,
}
if onednn_linear_available():
    _EXTRA_FLOPS[torch.ops.mkldnn._linear_pointwise] = _packed_linear_flops
if onednn_conv_available():
    _EXTRA_FLOPS[torch.ops.mkldnn._convolution_pointwise] = _packed_conv_flops
for _op in _onednn_int8_convs():
    _EXTRA_FLOPS[_op] = _int8_conv_flops


def count_stage_flops(
    run_chunk: Callable[[int], object], timer: StageTimer, n_timesteps: int, cfg_rate: float
) -> StageFlops:
    """Count FLOPs by running one vocoder chunk with 1 and with 2 ODE steps.

    ``run_chunk(steps)`` runs flow + HiFT once on a fixed token window through the timed model
    methods, with guidance at ``cfg_rate``. The difference between 2 and 1 steps isolates one
    estimator pass from the flow encoder, so the count scales to any number of steps without
    running all of them.
    """
    from torch.utils.flop_counter import FlopCounterMode

    runs: dict[int, tuple[StageEvent, StageEvent]] = {}
    for steps in (1, 2):
        timer.reset()
        with FlopCounterMode(display=False, custom_mapping=_EXTRA_FLOPS) as counter:
            timer.counter = counter
            try:
                run_chunk(steps)
            finally:
                timer.counter = None
        runs[steps] = (timer.of("flow")[-1], timer.of("hift")[-1])
    timer.reset()
    (flow1, hift1), (flow2, _) = runs[1], runs[2]
    per_step = flow2.flops - flow1.flops
    encoder = flow1.flops - per_step
    frames_per_s = timer.sample_rate / timer.samples_per_frame
    frames = flow1.audio_s * frames_per_s
    passes = 2 if cfg_rate > 0 else 1
    return StageFlops(
        flow_gflop_per_audio_s=(encoder + n_timesteps * per_step) / flow1.audio_s / 1e9,
        hift_gflop_per_audio_s=hift1.flops / hift1.audio_s / 1e9,
        estimator_mflop_per_frame_step=per_step / frames / 1e6,
        estimator_mflop_per_frame_pass=per_step / frames / passes / 1e6,
        flow_passes=passes,
        flow_encoder_gflop_per_audio_s=encoder / flow1.audio_s / 1e9,
        mel_frames_per_audio_s=frames_per_s,
    )
