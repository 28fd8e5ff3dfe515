"""Opt-in int8 weights for the speech-token LM (the fast path; changes outputs slightly).

The LM decode step reads every decoder weight once per token, so it is memory-bandwidth bound:
int8 weights (per-output-channel scales, activations quantised on the fly) read 4x fewer bytes.
Only the 14-layer decoder stack and the output head are quantised; the text encoder runs once
per sentence and ``linear_pos`` is folded into a cached table, so both stay float32.
:func:`next_token_kl` measures what the user trades: the KL divergence of the next-token
distributions against the float32 model on the same inputs.
"""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

_LOGGER = logging.getLogger(__name__)


def quantize_lm_int8(llm: nn.Module) -> nn.Module:
    """Swap the LM decoder's and head's Linear layers for dynamic int8 ones, in place."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    spec: dict[str, object] = {
        f"llm.{name}": per_channel_dynamic_qconfig
        for name, sub in llm.llm.named_modules()
        if isinstance(sub, nn.Linear) and not name.endswith("linear_pos")
    }
    spec["llm_decoder"] = per_channel_dynamic_qconfig
    with warnings.catch_warnings():
        # torch.ao.quantization is deprecated in favour of torchao, which we do not ship.
        warnings.simplefilter("ignore")
        quantize_dynamic(llm, qconfig_spec=spec, dtype=torch.qint8, inplace=True)
    _LOGGER.info("LM decoder quantised to int8 (%d Linear layers)", len(spec))
    return llm


def next_token_kl(reference: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """KL(reference || candidate) per row, in nats, from two (N, V) logit tensors."""
    ref = reference.float().log_softmax(-1)
    cand = candidate.float().log_softmax(-1)
    return (ref.exp() * (ref - cand)).sum(-1)
