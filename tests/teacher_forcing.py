"""An LM's logits along a stored token sequence (teacher forcing), for comparing weight formats."""

from __future__ import annotations

import torch

from engine.cosyvoice1.llm import TransformerLM


def teacher_forced_logits(model: TransformerLM, fx: dict, case: str) -> torch.Tensor:
    """The logits of the prefill and of each decode step over ``case``'s forced tokens."""
    lm_input = fx[f"{case}/lm_input"].unsqueeze(0)
    tokens = fx[f"{case}/forced_tokens"].tolist()
    with torch.inference_mode():
        cache = model.new_cache(lm_input.shape[1] + len(tokens))
        outs = [model.prefill(lm_input, cache).logits]
        outs += [model.decode_step(tok, cache).logits for tok in tokens]
    return torch.cat(outs)
