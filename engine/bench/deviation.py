"""What the fast-path options trade: their distance from the exact path on the same inputs.

* flow steps / guidance / int8 flow: relative L2 distance of the mel from the float32 flow's
  10-step, CFG 0.7 mel, same tokens, same speaker, same initial noise;
* int8 LM: KL divergence of the next-token distributions from the float32 LM, teacher-forced
  on the same token sequence.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from engine.constants import N_MELS, SPEECH_VOCAB, tokens_to_frames
from engine.quantize import next_token_kl, quantize_lm_int8

EXACT_STEPS = 10
EXACT_CFG = 0.7


def mel_relative_l2(flow: torch.nn.Module, embedding: torch.Tensor, *, n_timesteps: int,
                    cfg_rate: float, n_tokens: int = 100, seed: int = 0,
                    exact_flow: torch.nn.Module | None = None) -> float:
    """||mel(n_timesteps, cfg_rate) − mel(exact)|| / ||mel(exact)|| for random tokens.

    The exact mel comes from ``exact_flow`` (the float32 flow when ``flow`` is int8), else from
    ``flow`` itself at the exact settings.
    """
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SPEECH_VOCAB, (1, n_tokens), generator=gen)
    z = torch.randn(1, N_MELS, tokens_to_frames(n_tokens), generator=gen)
    prompt_tokens = torch.zeros(1, 0, dtype=torch.int64)
    prompt_feat = torch.zeros(1, 0, N_MELS)

    def mel(model: torch.nn.Module, steps: int, cfg: float) -> torch.Tensor:
        with torch.inference_mode():
            out, _ = model.inference(tokens, prompt_tokens, prompt_feat, embedding, None,
                                     noise=z.clone(), n_timesteps=steps, cfg_rate=cfg)
        return out

    exact = mel(exact_flow if exact_flow is not None else flow, EXACT_STEPS, EXACT_CFG)
    return float((mel(flow, n_timesteps, cfg_rate) - exact).norm() / exact.norm())


def lm_int8_kl(llm: torch.nn.Module, text_ids: list[int], embedding: torch.Tensor, *,
               n_steps: int = 50, seed: int = 0) -> dict[str, float]:
    """Mean and max next-token KL(fp32 || int8) over a teacher-forced token sequence."""
    gen = torch.Generator().manual_seed(seed)
    forced = torch.randint(0, SPEECH_VOCAB, (n_steps,), generator=gen).tolist()
    int8 = quantize_lm_int8(copy.deepcopy(llm))

    def logits(model: Any) -> torch.Tensor:
        with torch.inference_mode():
            lm_input = model.build_input(text_ids, [], [], embedding)
            cache = model.new_cache(lm_input.shape[1] + n_steps)
            outs = [model.prefill(lm_input, cache).logits]
            outs += [model.decode_step(tok, cache).logits for tok in forced[:-1]]
        return torch.cat(outs)

    kl = next_token_kl(logits(llm), logits(int8))
    return {"lm_int8_kl_mean": float(kl.mean()), "lm_int8_kl_max": float(kl.max())}
