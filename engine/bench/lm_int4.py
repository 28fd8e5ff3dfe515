"""How far the int4 LM's next-token distributions move from float32's, beside int8's.

    python -m engine.bench.lm_int4 [--family v1|cosyvoice2|both] [--steps 64] [--groups 32,64,128]
    python -m engine.bench.lm_int4 --matvec [--family ...] [--groups ...]

On the full-size random-weight LMs of ``engine.bench.synthetic`` (generated once, as the
benchmark does): a random text (fixed seed) is read, then ``--steps`` speech tokens drawn with a
fixed seed are teacher-forced through the float32 LM and through each quantised copy of it (the
int4 format at each group size, and "all int4": its int8 layers in 4 bits too). Per
format it prints the next-token KL(fp32 || format) (mean, max), top-1 agreement (the same most
likely token) and top-5 agreement (the share of float32's five most likely tokens among the
format's five), the int4 kernel, the float32 LM's mean next-token entropy (random weights
give flat distributions) and decode milliseconds per token (informative only: on a
shared machine they move with its load). ``--matvec`` measures the kernels alone instead: one
row through LM-shaped blocks, far beyond the caches, in float32, int8 and int4 (ms per block and
GB/s of weights read). docs/dev/int4.md has the figures.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.bench.synthetic import (
    DEFAULT_CACHE_DIR,
    ensure_synthetic_cosyvoice2,
    ensure_synthetic_model,
)
from engine.core.int4 import KEPT_INT8, choose_int4_kernel, quantize_lm_int4
from engine.core.prepared import ModelParts
from engine.core.quantize import next_token_kl, quantize_int8
from engine.cosyvoice1.model_dir import PARTS as V1_PARTS

SEED = 4
TEXT_TOKENS = 30
TOP_K = 5


def _family(name: str, cache_dir: Path) -> tuple[Path, ModelParts]:
    if name == "v1":
        return ensure_synthetic_model(cache_dir), V1_PARTS
    from engine.cosyvoice2.model_dir import PARTS

    return ensure_synthetic_cosyvoice2(cache_dir), PARTS


def _inputs(llm: Any, family: str, steps: int) -> tuple[Callable[[Any], torch.Tensor], list[int]]:
    """How a model's input is built, and the forced tokens (all from SEED)."""
    gen = torch.Generator().manual_seed(SEED)
    if family == "v1":
        vocab = llm.text_embedding.num_embeddings
        text = torch.randint(0, vocab, (TEXT_TOKENS,), generator=gen).tolist()
        embedding = torch.randn(1, llm.spk_embed_affine_layer.in_features, generator=gen)

        def build(model: Any) -> torch.Tensor:
            return model.build_input(text, [], [], embedding)

    else:
        vocab = llm.llm.model.model.embed_tokens.num_embeddings
        text = torch.randint(0, vocab, (TEXT_TOKENS,), generator=gen).tolist()

        def build(model: Any) -> torch.Tensor:
            return model.build_input(text)

    forced = torch.randint(0, llm.speech_token_size, (steps,), generator=gen).tolist()
    return build, forced


def teacher_forced(
    model: Any, build: Callable[[Any], torch.Tensor], forced: list[int]
) -> tuple[torch.Tensor, float]:
    """(logits of every step, decode milliseconds per token) of ``forced`` fed to ``model``."""
    with torch.inference_mode():
        lm_input = build(model)
        cache = model.new_cache(lm_input.shape[1] + len(forced))
        outs = [model.prefill(lm_input, cache).logits]
        start = time.perf_counter()
        outs += [model.decode_step(token, cache).logits for token in forced[:-1]]
        ms = (time.perf_counter() - start) * 1e3 / max(1, len(forced) - 1)
    return torch.cat(outs).float(), ms


def agreement(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """KL mean and max, top-1 agreement and top-5 overlap of two (steps, V) logit tensors."""
    kl = next_token_kl(reference, candidate)
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).float().mean()
    ref5, cand5 = reference.topk(TOP_K).indices, candidate.topk(TOP_K).indices
    overlap = (ref5.unsqueeze(-1) == cand5.unsqueeze(-2)).any(-1).float().mean()
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": float(top1),
        "top5": float(overlap),
    }


def measure(family: str, steps: int, groups: list[int], cache_dir: Path) -> list[dict[str, Any]]:
    model_dir, parts = _family(family, cache_dir)
    args = parts.read_args(model_dir)
    llm = parts.read_part(model_dir, args, "llm").eval()
    names = parts.int8_names(llm, "llm")
    build, forced = _inputs(llm, family, steps)
    reference, ms = teacher_forced(llm, build, forced)
    logp = reference.log_softmax(-1)
    entropy = float(-(logp.exp() * logp).sum(-1).mean())
    rows: list[dict[str, Any]] = [{"format": "fp32", "ms_per_token": ms, "entropy": entropy}]
    variants: list[tuple[str, int, tuple[str, ...]]] = [("int8", 0, KEPT_INT8)]
    variants += [(f"int4 g{g}", g, KEPT_INT8) for g in groups]
    variants += [(f"all int4 g{g}", g, ()) for g in groups[:1]]
    for label, group, kept in variants:
        model: nn.Module = copy.deepcopy(llm)
        if group:
            quantize_lm_int4(model, names, group=group, kept=kept)
        else:
            quantize_int8(model, names)
        logits, ms = teacher_forced(model, build, forced)
        rows.append({"format": label, "ms_per_token": ms, **agreement(reference, logits)})
        del model
        gc.collect()
    return rows


# One decoder block's matrix products as (out, in), as the int8 and int4 LMs run them (q/k/v and
# CosyVoice2's gate/up fused): v1 (d 1024, FFN 4096) and CosyVoice2 (Qwen2-0.5B: d 896, k/v
# 128 each, FFN 4864).
BLOCK_SHAPES = {
    "v1": ((3072, 1024), (1024, 1024), (4096, 1024), (1024, 4096)),
    "cosyvoice2": ((1152, 896), (896, 896), (9728, 896), (896, 4864)),
}
MATVEC_BYTES = 100 * 10**6  # int8 weights per pass: several times any L3 cache


def measure_matvec(family: str, groups: list[int], rounds: int = 7) -> list[dict[str, Any]]:
    """One row through enough LM-shaped blocks to leave the caches, per format: ms per block
    and GB/s of weights read (float32, int8, int4 at each group size on this CPU's kernel).
    The formats take turns, ``rounds`` times, and each keeps its fastest: on a shared machine
    a busy moment then slows every format alike."""
    from engine.core.int4 import Int4Linear, quantize_groups
    from engine.core.quantize import lm_int8_linear

    shapes = BLOCK_SHAPES[family]
    per_block = sum(out * n_in for out, n_in in shapes)
    blocks = max(1, MATVEC_BYTES // per_block)
    gen = torch.Generator().manual_seed(SEED)
    weights = [torch.randn(out, n_in, generator=gen) * 0.02 for out, n_in in shapes]
    rows = [torch.randn(1, n_in, generator=gen) for _, n_in in shapes]
    kernel = choose_int4_kernel()
    makers: list[tuple[str, Callable[[torch.Tensor], Any], float]] = [
        ("fp32", lambda w: lambda x, w=w: nn.functional.linear(x, w), 4.0),
        ("int8", lm_int8_linear, 1.0),
    ]
    for group in groups if kernel else []:

        def int4_layer(w: torch.Tensor, g: int = group) -> nn.Module:
            assert kernel is not None
            return Int4Linear(*quantize_groups(w, g), None, kernel)

        makers.append((f"int4 g{group}", int4_layer, 0.5 + 2 / group))  # + bf16 scales
    # Each block its own weights (copies of one block's values: speed does not depend on them).
    stacks = {
        label: [[make(w) for w in weights] for _ in range(blocks)] for label, make, _ in makers
    }
    best = dict.fromkeys(stacks, float("inf"))
    with torch.inference_mode():
        for _ in range(rounds):
            for label, stack in stacks.items():
                start = time.perf_counter()
                for block in stack:
                    for layer, x in zip(block, rows, strict=True):
                        layer(x)
                best[label] = min(best[label], time.perf_counter() - start)
    results = []
    for label, _, bytes_per_weight in makers:
        ms = best[label] * 1e3 / blocks
        gbps = per_block * bytes_per_weight / (ms / 1e3) / 1e9
        results.append({"format": label, "ms_per_block": ms, "gbps": gbps})
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", choices=("v1", "cosyvoice2", "both"), default="both")
    parser.add_argument("--steps", type=int, default=64, help="teacher-forced speech tokens")
    parser.add_argument("--groups", default="32,64,128", help="int4 group sizes, comma-separated")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE_DIR)
    parser.add_argument(
        "--matvec",
        action="store_true",
        help="instead: ms and GB/s of one row through LM-shaped blocks in each format",
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    groups = [int(g) for g in args.groups.split(",") if g]
    families = ("v1", "cosyvoice2") if args.family == "both" else (args.family,)
    print(
        f"int4 kernel: {choose_int4_kernel()}, CPU capability "
        f"{torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    if args.matvec:
        for family in families:
            print(f"\n{family}: one row through {BLOCK_SHAPES[family]} (out, in) blocks")
            print(f"{'format':<12}{'ms/block':>10}{'GB/s':>8}")
            for row in measure_matvec(family, groups):
                print(f"{row['format']:<12}{row['ms_per_block']:>10.3f}{row['gbps']:>8.2f}")
        return
    for family in families:
        print(f"\n{family}: {args.steps} teacher-forced tokens, seed {SEED}")
        print(f"{'format':<12}{'KL mean':>10}{'KL max':>10}{'top-1':>8}{'top-5':>8}{'ms/tok':>9}")
        for row in measure(family, args.steps, groups, args.cache_dir):
            stats = (
                f"{row['kl_mean']:>10.2e}{row['kl_max']:>10.2e}{row['top1']:>8.3f}"
                f"{row['top5']:>8.3f}"
                if "kl_mean" in row
                else f"{'':>36}"
            )
            print(f"{row['format']:<12}{stats}{row['ms_per_token']:>9.1f}", flush=True)
            if "entropy" in row:  # how flat the reference is: random weights, not trained ones
                print(f"{'':<12}(next-token entropy {row['entropy']:.2f} nats)")


if __name__ == "__main__":
    main()
