"""What the fast-path options trade: their distance from the exact path on the same inputs.

* flow steps / guidance / int8 flow: relative L2 distance of the mel from the float32 flow's
  10-step, CFG 0.7 mel, same tokens, same speaker, same initial noise;
* int8 LM: KL divergence of the next-token distributions from the float32 LM, teacher-forced
  on the same token sequence;
* bfloat16 HiFT: relative L2 distance of the waveform from the float32 HiFT's, same mel, same
  source noise.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch

from engine.core.constants import N_MELS, SPEECH_VOCAB, tokens_to_frames
from engine.core.quantize import next_token_kl, quantize_lm_int8
from engine.core.solver import EXACT_SOLVER

if TYPE_CHECKING:
    from engine.core.hift import HiFTGenerator
    from engine.cosyvoice1.flow import FlowModel
    from engine.cosyvoice1.llm import TransformerLM

EXACT_STEPS = 10
EXACT_CFG = 0.7


def mel_relative_l2(
    flow: FlowModel,
    embedding: torch.Tensor,
    *,
    n_timesteps: int,
    cfg_rate: float,
    n_tokens: int = 100,
    seed: int = 0,
    exact_flow: FlowModel | None = None,
    solver: str = EXACT_SOLVER,
) -> float:
    """||mel(n_timesteps, cfg_rate) − mel(exact)|| / ||mel(exact)|| for random tokens.

    The exact mel comes from ``exact_flow`` (the float32 flow when ``flow`` is int8), else from
    ``flow`` itself at the exact settings.
    """
    exact = random_tokens_mel(
        exact_flow if exact_flow is not None else flow,
        embedding,
        n_timesteps=EXACT_STEPS,
        cfg_rate=EXACT_CFG,
        n_tokens=n_tokens,
        seed=seed,
    )
    mel = random_tokens_mel(
        flow,
        embedding,
        n_timesteps=n_timesteps,
        cfg_rate=cfg_rate,
        n_tokens=n_tokens,
        seed=seed,
        solver=solver,
    )
    return float((mel - exact).norm() / exact.norm())


def random_tokens_mel(
    flow: FlowModel,
    embedding: torch.Tensor,
    *,
    n_timesteps: int,
    cfg_rate: float,
    n_tokens: int = 100,
    seed: int = 0,
    solver: str = EXACT_SOLVER,
) -> torch.Tensor:
    """The flow's mel (1, 80, T) of ``n_tokens`` random speech tokens, seeded noise."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, SPEECH_VOCAB, (1, n_tokens), generator=gen)
    z = torch.randn(1, N_MELS, tokens_to_frames(n_tokens), generator=gen)
    with torch.inference_mode():
        out, _ = flow.inference(
            tokens,
            torch.zeros(1, 0, dtype=torch.int64),
            torch.zeros(1, 0, N_MELS),
            embedding,
            None,
            noise=z,
            n_timesteps=n_timesteps,
            cfg_rate=cfg_rate,
            solver=solver,
        )
    return out


def hift_relative_l2(
    hift: HiFTGenerator, exact_hift: HiFTGenerator, mel: torch.Tensor, *, seed: int = 0
) -> float:
    """||wave(hift) − wave(exact_hift)|| / ||wave(exact_hift)||, same mel and source noise."""

    def wave(model: HiFTGenerator) -> torch.Tensor:
        out, _ = model.inference(mel, generator=torch.Generator().manual_seed(seed))
        return out

    exact = wave(exact_hift)
    return float((wave(hift) - exact).norm() / exact.norm())


def lm_int8_kl(
    llm: TransformerLM,
    text_ids: list[int],
    embedding: torch.Tensor,
    *,
    n_steps: int = 50,
    seed: int = 0,
) -> dict[str, float]:
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
