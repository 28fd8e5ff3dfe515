"""What one step of a speech-token LM gives, the token ids it takes, and how every family's
LM draws its speech tokens step by step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from engine.core.hparams import SamplingArgs
from engine.core.sampling import Sampler, ras_sampling
from engine.core.types import raise_if_cancelled

TokenIds = Sequence[int] | Tensor


class StepOut(NamedTuple):
    """The last hidden state (B, D) after the LM's final norm and the decoder's raw logits
    (B, speech tokens + the family's stop tokens)."""

    hidden: Tensor
    logits: Tensor


def token_ids(ids: TokenIds | None, device: torch.device) -> Tensor:
    """Token ids as a (1, N) int64 tensor; accepts lists, (N,) and (1, N) tensors (None: none)."""
    if ids is None:
        return torch.zeros(1, 0, dtype=torch.long, device=device)
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)


def draw_token(
    logits: Tensor,
    history: Sequence[int],
    masked: Iterable[int],
    sampler: Sampler | None,
    sampling: SamplingArgs,
    generator: torch.Generator | None,
) -> int:
    """The next token of one row of raw ``logits``: float32 log-probs with the ``masked``
    tokens at −inf, drawn by ``sampler`` (tests) or repetition-aware nucleus sampling."""
    logp = logits.float().log_softmax(dim=0)
    for token in masked:
        logp[token] = float("-inf")
    if sampler is not None:
        return int(sampler(logp, history))
    return ras_sampling(logp, history, sampling, generator)


def speech_tokens(
    out: StepOut,
    decode_step: Callable[[int], StepOut],
    *,
    min_len: int,
    max_len: int,
    eos: int,
    stop_tokens: Container[int],
    sampling: SamplingArgs,
    sampler: Sampler | None = None,
    generator: torch.Generator | None = None,
    cancel: threading.Event | None = None,
) -> Iterator[int]:
    """Speech tokens from the prefilled step ``out`` until a stop token (not yielded) or
    ``max_len``; EOS is masked for the first ``min_len``. ``cancel`` is checked before each."""
    history: list[int] = []
    for step in range(max_len):
        raise_if_cancelled(cancel)
        # inference_mode blocks never span a yield: the mode is thread-local state of the caller.
        with torch.inference_mode():
            masked = (eos,) if step < min_len else ()
            token = draw_token(out.logits[0], history, masked, sampler, sampling, generator)
        if token in stop_tokens:
            return
        yield token
        history.append(token)
        if step + 1 < max_len:
            with torch.inference_mode():
                out = decode_step(token)
