"""Speech-token sampling of the LM: repetition-aware nucleus sampling (RAS, VALL-E 2 style).

Variant implemented: the official code's current behaviour (upstream commits ``f2ddcbe`` and
``0e62489``). Older code re-drew until the token was not EOS, and its fallback could draw the
repeated token again; most published v1 audio was made that way, so outputs differ from it.

1. EOS suppression: while the step index is below ``min_len`` the EOS log-prob is set to -inf
   *before* sampling (not the older "re-draw until not EOS" loop), see :func:`sample_next`.
2. Nucleus: softmax, stable descending sort, keep tokens while the float32 running mass of the
   kept ones is < ``top_p`` and fewer than ``top_k`` are kept (the token crossing top_p is
   included); draw from the kept probabilities *without* renormalising them (multinomial does).
3. Repetition check: if the drawn token occurs at least ``win_size * tau_r`` times (= once with
   the defaults) among the last ``win_size`` emitted tokens, set that token to -inf and re-draw
   from the full softmax (no top-p/top-k).

All randomness goes through an explicit ``torch.Generator`` (None = torch's global generator);
``draw`` can replace the multinomial draw (tests mock it with argmax) and :func:`forced_sampler`
injects fixed tokens (teacher forcing).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from engine.core.hparams import SamplingArgs

# draw(probabilities (N,), generator) -> index into probabilities
Draw = Callable[[Tensor, "torch.Generator | None"], int]
# sampler(logp (V,), history) -> token id
Sampler = Callable[[Tensor, Sequence[int]], int]


def multinomial_draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One multinomial draw (torch normalises the weights), as the official code does."""
    return int(probs.multinomial(1, replacement=True, generator=generator))


def argmax_draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """Deterministic stand-in for :func:`multinomial_draw` (first maximum)."""
    return int(probs.argmax())


def top_sorted(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The first ``k`` of ``probs.sort(descending=True, stable=True)`` (values, indices).

    Found with ``topk(k + 1)`` instead of sorting the whole vocabulary (0.3 ms of a 17 ms token):
    ties inside are put in index order as a stable sort would; a tie across the cut needs the
    full order to know which tokens are in, so it falls back to the sort. Few calls: each
    runs on caches the decode step has just flushed.
    """
    n = probs.numel()
    if 0 < k < n:
        values, indices = probs.topk(k + 1)
        v = values.numpy()
        if v[k - 1] != v[k]:
            if not (v[1:k] == v[: k - 1]).any():  # no tie inside: topk's order is the stable one
                return values[:k], indices[:k]
            order = torch.from_numpy(np.lexsort((indices.numpy(), -v))[:k])
            return values[order], indices[order]
    values, indices = probs.sort(descending=True, stable=True)
    return values[:k], indices[:k]


def nucleus_candidates(logp: Tensor, top_p: float, top_k: int) -> tuple[Tensor, Tensor]:
    """(probs, indices) of the nucleus of ``logp`` (V,): unrenormalised, in sorted order."""
    probs = logp.float().softmax(dim=0)
    head, head_idx = top_sorted(probs, top_k)
    # The mass kept before each token after the first, summed sequentially in float32 like
    # the reference loop (torch.cumsum would accumulate in float64). Monotone, so a count
    # gives the cut; the first token is always kept.
    before = np.cumsum(head.numpy()[:-1], dtype=np.float32)
    keep = 1 + int(np.count_nonzero(before < np.float32(top_p)))
    return head[:keep], head_idx[:keep]


def nucleus_sampling(
    logp: Tensor,
    top_p: float,
    top_k: int,
    generator: torch.Generator | None,
    draw: Draw = multinomial_draw,
) -> int:
    probs, indices = nucleus_candidates(logp, top_p, top_k)
    return int(indices[draw(probs, generator)])


def ras_sampling(
    logp: Tensor,
    history: Sequence[int],
    args: SamplingArgs,
    generator: torch.Generator | None = None,
    draw: Draw = multinomial_draw,
) -> int:
    """Repetition-aware sampling of one token from log-probs ``logp`` (V,); ``logp`` is kept."""
    token = nucleus_sampling(logp, args.top_p, args.top_k, generator, draw)
    recent = list(history[-args.win_size :]) if args.win_size > 0 else []
    if recent.count(token) >= args.win_size * args.tau_r:
        scores = logp.float().clone()
        scores[token] = float("-inf")  # HEAD: the repeated token cannot be re-drawn
        token = draw(scores.softmax(dim=0), generator)
    return token


def sample_next(
    logp: Tensor,
    history: Sequence[int],
    step: int,
    min_len: int,
    eos: int,
    args: SamplingArgs,
    generator: torch.Generator | None = None,
    draw: Draw = multinomial_draw,
) -> int:
    """One LM step: forbid EOS while ``step < min_len``, then :func:`ras_sampling`."""
    if step < min_len:
        logp = logp.clone()
        logp[eos] = float("-inf")
    return ras_sampling(logp, history, args, generator, draw)


def forced_sampler(tokens: Iterable[int]) -> Sampler:
    """A sampler that ignores the scores and returns ``tokens`` in order (teacher forcing)."""
    it = iter(tokens)

    def sampler(logp: Tensor, history: Sequence[int]) -> int:
        return int(next(it))

    return sampler
