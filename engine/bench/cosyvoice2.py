"""What a benchmark run needs of a CosyVoice2 or Fun-CosyVoice3 engine beyond v1's: a voice, the
FLOP count and the fast path's deviations (the same code for both: the v3 engine keeps v2's
surface, its flow v2's calls, its causal HiFT v2's ``inference``).

* The voice: CosyVoice2 has no built-in speakers, so a run speaks with a synthetic 5-second
  prompt (random embedding, speech tokens and mel, a transcript in the reference text's
  language: zero-shot, the LM's prompt as long as a real one), primed as a server primes its
  voice at warm-up (its prompt chunks are computed before the first request).
* FLOPs: the flow and HiFT of one whole answer of the request's length, without a prompt,
  with 1 and 2 ODE steps (:func:`engine.bench.work.count_stage_flops`).
* Deviations: the mel of random tokens against the float32 flow at 10 steps and guidance 0.7
  (same fixed noise); the next-token KL of the engine's int8 LM against the float32 checkpoint,
  teacher-forced; the bfloat16 HiFT's waveform against the float32 one on the same mel.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.bench.deviation import EXACT_CFG, EXACT_STEPS, hift_relative_l2
from engine.bench.work import StageFlops, count_stage_flops
from engine.core.quantize import next_token_kl
from engine.core.solver import EXACT_SOLVER

if TYPE_CHECKING:
    from engine.bench.timers import StageTimer
    from engine.cosyvoice2.engine import CosyVoice2Engine
    from engine.cosyvoice2.flow import CausalFlow
    from engine.cosyvoice2.lm import CosyVoice2LM

VOICE = "synthetic"
PROMPT_SECONDS = 5
SPEAKER_EMBED_DIM = 192
SEED = 0


def add_bench_voice(engine: CosyVoice2Engine, transcript: str) -> str:
    """Give the engine a synthetic prompt voice (seeded); its name."""
    from engine.prompt.extract import PromptFeatures
    from engine.prompt.voices import CustomVoice
    from engine.text.normalize import detect_language

    generator = torch.Generator().manual_seed(SEED)
    n_tokens = PROMPT_SECONDS * engine.token_rate
    frames = engine.models.flow.args.token_mel_ratio * n_tokens
    features = PromptFeatures(
        torch.randn(1, SPEAKER_EMBED_DIM, generator=generator),
        torch.randint(
            0, engine.models.args.lm.speech_token_size, (1, n_tokens), generator=generator
        ).to(torch.int32),
        torch.randn(1, frames, engine.models.args.flow.output_size, generator=generator) - 5,
    )
    language = detect_language(transcript)
    voice = CustomVoice(
        VOICE, transcript, language, features, float(PROMPT_SECONDS), family=engine.recipe.family
    )
    engine.add_voice(voice)
    return VOICE


def _random_tokens(flow: CausalFlow, n_tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED)
    return torch.randint(0, flow.args.vocab_size, (1, n_tokens), generator=generator)


def _mel(
    flow: CausalFlow,
    tokens: torch.Tensor,
    embedding: torch.Tensor,
    steps: int,
    cfg: float,
    solver: str = EXACT_SOLVER,
) -> torch.Tensor:
    return flow.inference(
        tokens,
        torch.zeros(1, 0, dtype=torch.int64),
        torch.zeros(1, 0, flow.args.output_size),
        embedding,
        streaming=False,
        finalize=True,
        n_timesteps=steps,
        cfg_rate=cfg,
        solver=solver,
    )


def stage_flops(
    engine: CosyVoice2Engine, timer: StageTimer, n_timesteps: int, cfg_rate: float, n_tokens: int
) -> StageFlops:
    """FLOPs of flow and HiFT per audio second on one whole answer of ``n_tokens`` tokens."""
    models = engine.models
    embedding = engine.voices[VOICE].prompt.embedding if VOICE in engine.voices else None
    embedding = embedding if embedding is not None else torch.zeros(1, SPEAKER_EMBED_DIM)
    tokens = _random_tokens(models.flow, max(n_tokens, 1))

    def run_chunk(steps: int) -> None:
        with torch.inference_mode():
            mel = _mel(models.flow, tokens, embedding, steps, cfg_rate)
            models.hift.inference(mel, generator=torch.Generator().manual_seed(SEED))

    return count_stage_flops(run_chunk, timer, n_timesteps, cfg_rate)


def deviations(
    engine: CosyVoice2Engine,
    n_timesteps: int,
    cfg_rate: float,
    text: str,
    *,
    lm_int8: bool,
    flow_approx: bool,
    n_tokens: int = 100,
    n_steps: int = 50,
    solver: str = EXACT_SOLVER,
) -> dict[str, float]:
    """How far this run's fast-path options are from the exact path (0 when exact)."""
    models = engine.models
    hift_approx = engine.hift_dtype != "float32"
    exact = _float32_models(engine) if lm_int8 or flow_approx or hift_approx else None
    embedding = engine.voices[VOICE].prompt.embedding
    tokens = _random_tokens(models.flow, n_tokens)
    out = {"mel_rel_l2_vs_exact": 0.0, "wave_rel_l2_vs_exact_hift": 0.0}
    exact_maths = (n_timesteps, cfg_rate, solver) == (EXACT_STEPS, EXACT_CFG, EXACT_SOLVER)
    flow_differs = flow_approx or not exact_maths
    with torch.inference_mode():
        exact_flow = exact.flow if exact is not None and flow_approx else models.flow
        # The exact mel only where something is compared with it (at full size it costs as
        # much as seconds of exact speech).
        need_reference = flow_differs or (hift_approx and exact is not None)
        reference = (
            _mel(exact_flow, tokens, embedding, EXACT_STEPS, EXACT_CFG) if need_reference else None
        )
        if flow_differs and reference is not None:
            mel = _mel(models.flow, tokens, embedding, n_timesteps, cfg_rate, solver)
            out["mel_rel_l2_vs_exact"] = float((mel - reference).norm() / reference.norm())
        if lm_int8 and exact is not None:
            text_ids = engine.frontend.segments(text)[0].token_ids
            out.update(_lm_int8_kl(exact.llm, models.llm, text_ids, n_steps))
    if hift_approx and exact is not None and reference is not None:
        out["wave_rel_l2_vs_exact_hift"] = hift_relative_l2(models.hift, exact.hift, reference)
    return out


def _float32_models(engine: CosyVoice2Engine) -> Any:
    """The engine's family's three models straight from the checkpoints, float32 on torch's
    default kernels: the exact reference (the engine's may be int8, bfloat16 or on oneDNN)."""
    from engine.core.weights import PARTS

    parts, model_dir = engine.model_parts, engine.model_dir
    args = parts.read_args(model_dir)
    llm, flow, hift = (parts.read_part(model_dir, args, part) for part in PARTS)
    return type(engine.models).of(model_dir, args, (llm, flow, hift))


def _lm_int8_kl(
    exact: CosyVoice2LM, int8: CosyVoice2LM, text_ids: list[int], n_steps: int
) -> dict[str, float]:
    """Mean and max next-token KL(fp32 || int8) over a teacher-forced token sequence."""
    generator = torch.Generator().manual_seed(SEED)
    forced = torch.randint(0, exact.speech_token_size, (n_steps,), generator=generator).tolist()

    def logits(model: Any) -> torch.Tensor:
        lm_input = model.build_input(text_ids)
        cache = model.new_cache(lm_input.shape[1] + n_steps)
        outs = [model.prefill(lm_input, cache).logits]
        outs += [model.decode_step(token, cache).logits for token in forced[:-1]]
        return torch.cat(outs)

    kl = next_token_kl(logits(exact), logits(int8))
    return {"lm_int8_kl_mean": float(kl.mean()), "lm_int8_kl_max": float(kl.max())}
