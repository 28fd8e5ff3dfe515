"""What every engine does around its models: choose the CPU's kernels and threads at load, run a
block on one thread, and give the heap back between chunks. Shared by the model families."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from engine.core import cpu
from engine.core.thread_budget import configure_threads
from engine.core.types import AudioChunk, raise_if_cancelled

if TYPE_CHECKING:
    from pathlib import Path

    from engine.core.prepared import ModelParts, PreparedLoad, WeightFormats

_LOGGER = logging.getLogger(__name__)
T = TypeVar("T")

# oneDNN keeps every convolution it JIT-compiles, one set per input length, up to 1024 by
# default. A server vocodes chunks of ever-new lengths: measured over 37 lengths,
# HiFT's memory in use grew by 156 MB, by 73 MB with 256 (50 MB with no cache, but 10-15 %
# slower passes); 256 is as fast as the default when a length repeats.
_ONEDNN_CACHE_CAPACITY = "256"
# On a CPU with AMX oneDNN runs the int8 HiFT's convolutions on AMX, and JIT-compiles each one
# for every new input length in ≈ 50 ms (1 ms below AMX; a run 25 % faster does not repay it):
# a streamed answer's vocoder took five times as long, and the primitives kept doubled the
# process's memory. Capped below AMX they take AVX-512 VNNI. The bfloat16 formats want AMX
# (the flow's products 1.8×, HiFT 3× as fast), so the cap is applied only to loads without them.
_ONEDNN_ISA_BELOW_AMX = "AVX512_CORE_BF16"


@dataclass(frozen=True)
class CpuSetup:
    """What a load chose for this CPU: threads, kernels, and the weight formats it can run."""

    threads: int | None
    choices: cpu.CpuChoices
    formats: WeightFormats


def setup_cpu(
    threads: int | None,
    *,
    lm_int8: bool,
    flow_int8: bool,
    hift_bf16: bool,
    lm_int4: bool = False,
    flow_bf16: bool = False,
    hift_int8: bool = False,
    extra_formats: Iterable[str] = (),
) -> CpuSetup:
    """Cap the threads, pick the int8 kernels and fall back to float32 where the CPU lacks them
    (an int4 LM: to int8 where no int4 kernel works). ``extra_formats`` ("hift.int8", ...): what
    the load adds beside these, for the oneDNN settings the whole process shares.

    Called before any torch op: past the ceiling the first multi-threaded op would crash, and
    oneDNN reads its settings once, at its first query or primitive.
    """
    from engine.core.prepared import WeightFormats

    extra = set(extra_formats)
    configure_onednn(
        int8_hift=hift_int8 or "hift.int8" in extra,
        bf16=hift_bf16 or flow_bf16 or any(name.endswith(".bf16") for name in extra),
    )
    threads = cpu.capped_threads(threads, cpu.thread_ceiling())
    configure_threads(threads)
    choices = cpu.detect()
    _LOGGER.info("CPU %s", choices.describe())
    if lm_int4 and not int4_kernel_for_lm():
        lm_int4, lm_int8 = False, True
    if choices.int8_kernels is not None:
        torch.backends.quantized.engine = choices.int8_kernels
    elif lm_int8 or flow_int8:
        _LOGGER.warning("No int8 kernel works on this CPU: the LM and flow run float32")
        lm_int8 = flow_int8 = False
    if hift_bf16 and not choices.bfloat16:
        _LOGGER.warning("This CPU has no fast bfloat16 convolutions: HiFT stays float32")
        hift_bf16 = False
    if flow_bf16 and not flow_int8 and not choices.bfloat16:
        _LOGGER.warning("This CPU has no native bfloat16 matrix units: the flow stays float32")
        flow_bf16 = False
    if hift_int8 and not int8_hift_fast():
        _LOGGER.warning(
            "This CPU has no int8 convolutions measured faster than float32 (%s %s): HiFT "
            "stays float32",
            platform.machine(),
            torch.backends.cpu.get_cpu_capability(),
        )
        hift_int8 = False
    formats = WeightFormats(
        llm="int4" if lm_int4 else "int8" if lm_int8 else "fp32",
        flow="int8" if flow_int8 else "bf16" if flow_bf16 else "fp32",
        hift="bf16" if hift_bf16 else "int8" if hift_int8 else "fp32",
    )
    return CpuSetup(threads, choices, formats)


def int8_hift_fast() -> bool:
    """Whether HiFT's int8 convolutions run here, faster than float32 (engine.core.hift_int8)."""
    from engine.core.hift_int8 import int8_conv_fast

    return int8_conv_fast()


def int4_kernel_for_lm() -> bool:
    """Whether the LM runs int4 here: a kernel works and beats int8 (engine.core.int4). Otherwise a
    WARNING says why and the LM runs int8: int4 only trades exactness for speed."""
    from engine.core.int4 import choose_int4_kernel, int4_fast_here

    kernel = choose_int4_kernel()
    if kernel is None:
        _LOGGER.warning("No int4 kernel of this torch build works on this CPU: the LM runs int8")
        return False
    if not int4_fast_here():
        _LOGGER.warning(
            "torch's int4 kernel (%s) has no fast path on this CPU (%s %s) and would run the "
            "LM slower than int8: the LM runs int8 (docs/dev/int4.md)",
            kernel,
            platform.machine(),
            torch.backends.cpu.get_cpu_capability(),
        )
        return False
    _LOGGER.info("int4 LM: torch's %s kernel", kernel)
    return True


def extra_weight_formats(extra: Iterable[str], setup: CpuSetup) -> dict[str, str]:
    """The formats of ``extra`` ("llm.int4", "flow.int8", "hift.bf16", ...) a load adds beside
    its primary ones, by part: those this CPU runs (as ``setup_cpu`` falls back) that are not
    primary.

    A request chooses between a part's formats (engine.core.types' ``SynthesisOptions``
    ``lm_weights``, ``flow_weights``, ``hift_weights``); ValueError names a format no part has.
    Each part gets one extra at most (the last one named).
    """
    from engine.core.prepared import WEIGHT_FORMATS

    known = [f"{part}.{weights}" for part, formats in WEIGHT_FORMATS.items() for weights in formats]
    chosen: dict[str, str] = {}
    for name in extra:
        part, _, weights = name.partition(".")
        if name not in known:
            raise ValueError(f"extra weight format {name!r}: not one of {', '.join(known)}")
        if not _runs_here(part, weights, setup):
            continue
        if weights != setup.formats.of(part):
            chosen[part] = weights
    return chosen


def _runs_here(part: str, weights: str, setup: CpuSetup) -> bool:
    """Whether this CPU runs ``part`` in ``weights``, as the primary formats fall back."""
    if part == "llm" and weights == "int4":
        return setup.choices.int8_kernels is not None and int4_kernel_for_lm()
    if part == "hift" and weights == "int8" and not int8_hift_fast():
        return False
    if weights == "int8":
        return setup.choices.int8_kernels is not None  # no int8 kernel: float32 only
    if weights == "bf16":
        return setup.choices.bfloat16
    return True


@contextlib.contextmanager
def prepared_loads(
    model_dir: Path,
    formats: WeightFormats,
    extras: Mapping[str, str],
    cache_dir: Path | None,
    parts: ModelParts,
) -> Iterator[list[PreparedLoad]]:
    """The model's prepared load (``parts``: its family's) in its primary formats
    and, with ``extras``, a second one of just those parts in their extra formats: finished
    when the block ends, cancelled (the int8 layers still packing in the background stop) when
    it fails.

    While int8 layers are packed on every core the block runs on one torch thread: an OpenMP
    region there would wait for a free core, several times slower than one thread alone.
    """
    from engine.core.prepared import PreparedLoad, WeightFormats

    loads = [PreparedLoad(model_dir, formats, cache_dir, parts)]
    if extras:
        extra = WeightFormats(**extras)
        loads.append(PreparedLoad(model_dir, extra, cache_dir, parts, only=tuple(extras)))
    quantised = {formats.llm, formats.flow, extras.get("llm"), extras.get("flow")}
    packing = bool({"int8", "int4"} & quantised)
    try:
        with one_torch_thread() if packing else contextlib.nullcontext():
            yield loads
        for loading in loads:
            loading.finish()
    except BaseException:
        for loading in loads:
            loading.cancel()
        raise


def pick_weights(loaded: Mapping[str, T], wanted: str | None) -> tuple[str, T]:
    """(format, model) of ``wanted`` if loaded, else the primary (first) one."""
    if wanted is not None and wanted in loaded:
        return wanted, loaded[wanted]
    return next(iter(loaded.items()))


def loaded_format(module: torch.nn.Module) -> str:
    """The weight format a loaded model runs in: int4 (an LM's 4-bit layers), int8 (int8
    layers or convolutions), bf16 (a bfloat16 filter or bfloat16 estimator layers) or fp32."""
    from engine.core.bf16_flow import has_bf16_linears
    from engine.core.int4 import Int4Linear
    from engine.core.quantize import INT8_LINEAR_TYPES

    if any(isinstance(sub, Int4Linear) for sub in module.modules()):
        return "int4"
    if getattr(module, "quantized", False):
        return "int8"
    if any(isinstance(sub, INT8_LINEAR_TYPES) for sub in module.modules()):
        return "int8"
    if has_bf16_linears(module):
        return "bf16"
    return "bf16" if getattr(module, "filter_dtype", None) == torch.bfloat16 else "fp32"


def weight_combinations(*loaded: Iterable[str]) -> list[tuple[str, ...]]:
    """One format per part (``loaded``: each part's formats, the primary first) for each run
    that together run every loaded format at least once: the primary ones, then each part's
    other formats (beside the other parts' same-numbered ones, or their primary)."""
    lists = [list(formats) for formats in loaded]
    return [
        tuple(formats[index] if index < len(formats) else formats[0] for formats in lists)
        for index in range(max(len(formats) for formats in lists))
    ]


def configure_onednn(*, int8_hift: bool, bf16: bool) -> None:
    """oneDNN's settings for this process, unless the user set them (either of oneDNN's names):
    its primitive cache capped, and on a CPU with AMX, for a load with the int8 HiFT and no
    bfloat16 format, its instructions capped below AMX.

    oneDNN reads the cache's size at its first primitive and its instruction set at its first
    query (torch's bfloat16 probe is one): this only takes effect in a process that has used
    neither yet (the server, the benchmark, the batch CLI), hence before the CPU's probes.
    """
    if "DNNL_PRIMITIVE_CACHE_CAPACITY" not in os.environ:
        os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", _ONEDNN_CACHE_CAPACITY)
    if onednn_isa_cap(int8_hift=int8_hift, bf16=bf16, amx=cpu.has_amx()) is None:
        return
    if "DNNL_MAX_CPU_ISA" not in os.environ and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        os.environ["ONEDNN_MAX_CPU_ISA"] = _ONEDNN_ISA_BELOW_AMX
        _LOGGER.info("oneDNN below AMX (%s): the int8 HiFT compiles faster", _ONEDNN_ISA_BELOW_AMX)


def onednn_isa_cap(*, int8_hift: bool, bf16: bool, amx: bool) -> str | None:
    """The instruction set oneDNN is capped to for a load (None: as it chooses)."""
    return _ONEDNN_ISA_BELOW_AMX if amx and int8_hift and not bf16 else None


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: musl has none, nor have other systems)."""
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def give_back_free_heap() -> None:
    """Return the memory malloc holds free to the kernel, once a chunk's passes are done.

    glibc keeps what a flow and vocoder pass frees, all of it still resident, and a streamed
    request's free heap keeps growing chunk by chunk; a trim costs a few milliseconds against
    the seconds a chunk takes.
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def audio_chunks(
    waves: Iterator[torch.Tensor], sample_rate: int, cancel: threading.Event | None
) -> Iterator[AudioChunk]:
    """Drive a model family's waveform generator: each wave as an :class:`AudioChunk`, the
    request's cancel checked after every chunk, the free heap given back between chunks."""
    while True:
        # inference_mode is thread-local and callers may resume us on any thread.
        with torch.inference_mode():
            wave = next(waves, None)
        if wave is None:
            return
        raise_if_cancelled(cancel)
        if wave.numel() == 0:  # a chunk whose frames the speed's resampling still holds
            continue
        chunk = AudioChunk(wave.reshape(-1).float().numpy().copy(), sample_rate)
        del wave
        give_back_free_heap()
        yield chunk


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch ops of this block on one thread (the setting is process-wide, then restored)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
