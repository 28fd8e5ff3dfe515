"""What one step of a speech-token LM gives, the token ids it takes, and how every family's
LM draws its speech tokens step by step."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from engine.core.hparams import SamplingArgs
from engine.core.sampling import Sampler, forced_sampler, ras_sampling
from engine.core.transformer import KVCache
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
    stop_tokens: Collection[int],
    sampling: SamplingArgs,
    sampler: Sampler | None = None,
    generator: torch.Generator | None = None,
    cancel: threading.Event | None = None,
    mask_every_stop: bool = False,
) -> Iterator[int]:
    """Speech tokens from the prefilled step ``out`` until a stop token (not yielded) or
    ``max_len``; EOS is masked for the first ``min_len`` (``mask_every_stop``: every stop
    token). ``cancel`` is checked before each."""
    early = tuple(sorted(stop_tokens)) if mask_every_stop else (eos,)
    history: list[int] = []
    for step in range(max_len):
        raise_if_cancelled(cancel)
        # inference_mode blocks never span a yield: the mode is thread-local state of the caller.
        with torch.inference_mode():
            masked = early if step < min_len else ()
            token = draw_token(out.logits[0], history, masked, sampler, sampling, generator)
        if token in stop_tokens:
            return
        yield token
        history.append(token)
        if step + 1 < max_len:
            with torch.inference_mode():
                out = decode_step(token)


class SpeechTokenLM(nn.Module):
    """What every family's speech-token LM shares: its speech tokens drawn one by one from its
    assembled input. A family gives the input's layout and its steps."""

    eos: int  # the stop token masked while fewer than min_len tokens were drawn
    stop_tokens: frozenset[int]  # any of these ends the answer
    args: Any  # the family's LM args, with ``sampling``

    def build_input(
        self,
        text_ids: TokenIds,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
        embedding: Tensor | None = None,
    ) -> Tensor:
        """The input embeddings (1, L0, D) of one answer."""
        raise NotImplementedError

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        raise NotImplementedError

    def prefill(self, lm_input: Tensor, cache: KVCache) -> StepOut:
        raise NotImplementedError

    def decode_step(self, tokens: Tensor | int, cache: KVCache) -> StepOut:
        raise NotImplementedError

    def length_limits(self, n_tts_text: int) -> tuple[int, int]:
        """(min_len, max_len) in speech tokens for ``n_tts_text`` text tokens (prompt excluded)."""
        raise NotImplementedError

    def generate(
        self,
        text_ids: TokenIds,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
        embedding: Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        max_tokens: int | None = None,
        forced_tokens: Sequence[int] | None = None,
        sampler: Sampler | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Yield speech tokens until a stop token or the length cap (stop tokens not yielded).

        ``max_tokens`` fixes the count (benchmarks, ``SynthesisOptions.force_tokens``): it
        replaces both limits and masks every stop token, so exactly that many tokens are drawn
        (fewer only if a forced one ends them; CosyVoice3's 200 stop ids would otherwise end a
        random-weight answer within tens of tokens). ``forced_tokens`` /
        ``sampler`` replace the draw (tests; they receive the EOS-masked log-probs and the
        history). ``cancel`` is checked before each token: :class:`SynthesisCancelled` once
        it is set.
        """
        n_text = token_ids(text_ids, torch.device("cpu")).shape[1]
        min_len, max_len = self.length_limits(n_text)
        if max_tokens is not None:
            max_len = min_len = max(0, int(max_tokens))  # EOS masked throughout: exact count
        if forced_tokens is not None:
            sampler = forced_sampler(forced_tokens)
        if max_len == 0:
            return
        raise_if_cancelled(cancel)
        # inference_mode blocks never span a yield: the mode is thread-local state of the caller.
        with torch.inference_mode():
            lm_input = self.build_input(text_ids, prompt_text_ids, prompt_speech_ids, embedding)
            cache = self.new_cache(lm_input.shape[1] + max_len)
            out = self.prefill(lm_input, cache)
        yield from speech_tokens(
            out,
            lambda token: self.decode_step(token, cache),
            min_len=min_len,
            max_len=max_len,
            eos=self.eos,
            stop_tokens=self.stop_tokens,
            sampling=self.args.sampling,
            sampler=sampler,
            generator=generator,
            cancel=cancel,
            mask_every_stop=max_tokens is not None,
        )
