"""Opt-in int8 weights for the speech-token LM (the fast path; changes outputs slightly).

The LM decode step reads every decoder weight once per token, so it is memory-bandwidth bound:
int8 weights (per-output-channel scales, activations quantised on the fly) read 4x fewer bytes.
Only the 14-layer decoder stack and the output head are quantised; the text encoder runs once
per sentence and ``linear_pos`` is folded into a cached table, so both stay float32.
:func:`next_token_kl` measures what the user trades: the KL divergence of the next-token
distributions against the float32 model on the same inputs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import warnings

import torch
from torch import nn

_LOGGER = logging.getLogger(__name__)


_MADV_DONTNEED = 4


def release_pages(tensor: torch.Tensor) -> None:
    """Drop the resident pages of a memory-mapped, never-written tensor from this process.

    The checkpoint stays mapped as long as any of its tensors lives, so float32 weights that
    were replaced by int8 copies would otherwise keep counting towards the RSS. The pages stay
    in the page cache and fault back in from the file if touched again. Only whole pages inside
    the tensor are released; a no-op off Linux.
    """
    if not sys.platform.startswith("linux") or tensor.numel() == 0:
        return
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    first, last = -(-start // page) * page, end // page * page
    if last > first:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


def quantize_lm_int8(llm: nn.Module) -> nn.Module:
    """Swap the LM decoder's and head's Linear layers for dynamic int8 ones, in place.

    One block at a time, releasing each block's float32 pages right after, so the float32
    decoder is never resident as a whole (peak memory stays near the final footprint).
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    file_ranges = _file_mapped_ranges()
    parents = [*llm.llm.encoders, llm]
    count = 0
    for parent in parents:
        names = (["llm_decoder"] if parent is llm else
                 [n for n, m in parent.named_modules()
                  if isinstance(m, nn.Linear) and not n.endswith("linear_pos")])
        replaced = [parent.get_submodule(name).weight for name in names]
        with warnings.catch_warnings():
            # torch.ao.quantization is deprecated in favour of torchao, which we do not ship.
            warnings.simplefilter("ignore")
            quantize_dynamic(parent, qconfig_spec=dict.fromkeys(names, per_channel_dynamic_qconfig),
                             dtype=torch.qint8, inplace=True)
        for weight in replaced:
            # Only pages of a mapped checkpoint: released anonymous memory reads back as zeros.
            if any(lo <= weight.data_ptr() < hi for lo, hi in file_ranges):
                release_pages(weight)
        count += len(names)
    _LOGGER.info("LM decoder quantised to int8 (%d Linear layers)", count)
    return llm


def _file_mapped_ranges() -> list[tuple[int, int]]:
    """Address ranges of this process that map a file (from /proc/self/maps; [] elsewhere)."""
    ranges = []
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith("/"):
                    lo, hi = fields[0].split("-")
                    ranges.append((int(lo, 16), int(hi, 16)))
    except OSError:
        return []
    return ranges


def next_token_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per row, in nats, from two (N, V) logit tensors."""
    ref = reference.float().log_softmax(-1)
    cand = candidate.float().log_softmax(-1)
    return (ref.exp() * (ref - cand)).sum(-1)
