"""Text arriving in pieces (an LLM's reply): one CosyVoice2 answer whose text is fed while its
speech tokens are already being drawn (:class:`BistreamSession` on a
:class:`~engine.cosyvoice2.lm.CosyVoice2LM`)."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from torch import Tensor

from engine.core.lm_step import StepOut, TokenIds, draw_token
from engine.core.sampling import Sampler, forced_sampler
from engine.core.transformer import KVCache
from engine.core.types import raise_if_cancelled
from engine.cosyvoice2.lm import CosyVoice2LM

_WAIT_POLL_S = 0.05  # how often a wait for text looks at an external cancel event
_CACHE_HEADROOM = 256  # positions allocated beyond the prompt; the cache doubles when full


class BistreamSession:
    """One answer whose text is fed while speech tokens are already being drawn.

    The LM reads its input as groups of ``mix_ratio = (5, 15)``: five text tokens, then the
    fifteen speech tokens they allow, then a *fill* decision (the fill token is never fed; the
    next five text tokens take its place). The layout, step by step::

        [SOS | text 5 | prompt speech 15 | text 5 | prompt speech ≤ 15 ]   prompt, interleaved
        → speech… (up to the next fill) | text 5 | speech × 15 | fill | text 5 | …
        → at the end: [last input again | the remaining text | TASK_ID] → speech… → EOS

    * The prompt text counts as text that arrived first; each group of prompt speech needs
      five text tokens, so nothing is drawn until the prompt speech is interleaved (text that
      is not there when :meth:`finish` is called leaves the rest of the prompt speech out).
    * Without prompt speech the first group is ``SOS`` + five text tokens.
    * A fill is forced 15 speech tokens after the last one (the sampler may draw it
      earlier). The first comes after ``15 - P mod 15`` tokens for ``P`` prompt speech
      tokens, which completes the prompt's last group, and after a full 15 when ``P`` is a
      multiple of 15 (as the reference does). EOS is masked until the end.
    * At the end the last input the LM read is fed again ahead of the remaining text and
      ``TASK_ID`` (the reference implementation does this; kept for parity), then speech is
      drawn until a stop token, at most ``max_token_text_ratio`` times the fed text.

    Text tokens are taken one at a time, and only when the layout can use one: the speech
    drawn depends on the tokens, never on how they were split into pieces or when they came.
    At most one text group is read per text token taken, as in the reference.

    Differences from the reference, where it fails: token ``eos + 1`` (the stop token v2 does
    not use) is masked while text may still come, and any stop token ends the answer
    after the end (the reference raises on both); the end has a length cap.

    Threads: :meth:`feed_text`, :meth:`finish` and :meth:`cancel` may be called from any
    thread; :meth:`tokens` (blocks for text) or :meth:`ready_tokens` (never blocks) is
    iterated by one consumer. The KV cache lives as long as the session: every input row is
    computed once.
    """

    def __init__(
        self,
        lm: CosyVoice2LM,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
        *,
        generator: torch.Generator | None = None,
        sampler: Sampler | None = None,
        forced_tokens: Sequence[int] | None = None,
        cancel: threading.Event | None = None,
        text_timeout: float | None = None,
        observer: Callable[[Tensor, StepOut], None] | None = None,
        max_tokens: int | None = None,
        lead_text_ids: TokenIds | None = None,
    ) -> None:
        """``forced_tokens`` / ``sampler`` replace the draws (tests; forced fills draw nothing).

        ``lead_text_ids``: text read right after ``SOS``, outside the interleaving (a later
        family's system prompt). With it, the first speech token is drawn as soon as one text
        token has arrived, as the reference does when its first input is longer than ``SOS``.

        ``max_tokens`` fixes the count, as :meth:`CosyVoice2LM.generate`'s (benchmarks): no
        stop token is drawn after the end either, and the answer ends at that many tokens.

        ``text_timeout``: :meth:`tokens` raises :class:`TimeoutError` after waiting that long
        for text. ``observer(rows, outputs)`` sees every LM call (tests).
        """
        self.lm = lm
        self._n_text, self._n_speech = lm.args.mix_ratio
        self._text: list[int] = _checked_ids(prompt_text_ids, self._text_vocab, "prompt text")
        self._prompt_speech: list[int] = _checked_ids(
            prompt_speech_ids, lm.speech_token_size, "prompt speech"
        )
        self._generator = generator
        self._sampler = forced_sampler(forced_tokens) if forced_tokens is not None else sampler
        self._cancel = cancel if cancel is not None else threading.Event()
        self._text_timeout = text_timeout
        self._observer = observer
        # fed by other threads, taken one token at a time by the consumer
        self._arrived: deque[int] = deque()
        self._fed = 0
        self._finished = False
        self._lock = threading.Condition()
        # LM state (consumer thread only)
        lead = _checked_ids(lead_text_ids, self._text_vocab, "lead text")
        self._pending: list[Tensor] = [lm.special_input(lm.SOS)]  # rows not read yet
        if lead:
            self._pending.append(lm.embed_text(lead))
        self._last_input: Tensor | None = None  # rows of the last LM call
        self._awaiting_group = not self._prompt_speech and not lead
        self._drawing = False  # drawing speech until the next fill (or the end)
        self._final = False
        self._done = False
        self._history: list[int] = []  # every decision, fills included (the sampler's window)
        self._yielded = 0
        self._max_len = 0
        self._fixed_len = None if max_tokens is None else max(0, int(max_tokens))
        # decision index of the next forced fill (decisions count fills too)
        self._next_fill = self._n_speech - len(self._prompt_speech) % self._n_speech
        self._cache: KVCache | None = None
        self._taken = 0  # text tokens taken from the arrivals

    @property
    def _text_vocab(self) -> int:
        return self.lm.args.backbone.vocab_size

    # --- producer side -------------------------------------------------------------------------

    def feed_text(self, ids: TokenIds) -> None:
        """Text token ids that arrived (any number; order is kept)."""
        new = _checked_ids(ids, self._text_vocab, "text")
        with self._lock:
            if self._finished:
                raise RuntimeError("text fed after finish()")
            self._arrived.extend(new)
            self._fed += len(new)
            self._lock.notify_all()

    def finish(self) -> None:
        """No more text: the rest of it is read and the answer drawn to its end."""
        with self._lock:
            self._finished = True
            self._lock.notify_all()

    def cancel(self) -> None:
        """Stop: the consumer raises :class:`SynthesisCancelled` before its next token."""
        self._cancel.set()
        with self._lock:
            self._lock.notify_all()

    # --- consumer side -------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """The answer has ended (stop token or length cap)."""
        return self._done

    @property
    def text_taken(self) -> int:
        """Text tokens the LM has taken so far (prompt text excluded)."""
        return self._taken

    def tokens(self) -> Iterator[int]:
        """Speech tokens until the end of the answer, waiting for text when the layout needs it."""
        while True:
            yield from self.ready_tokens()
            if self._done:
                return
            self._wait_for_text()

    def ready_tokens(self) -> Iterator[int]:
        """The speech tokens the text fed so far allows; ends when more text is needed."""
        while not self._done:
            raise_if_cancelled(self._cancel)
            if self._drawing:
                token = self._decide()
                if token is not None:
                    yield token
                continue
            with self._lock:
                arrived = self._arrived.popleft() if self._arrived else None
                ended = self._finished and not self._arrived
            if arrived is None and not ended:
                return
            with torch.inference_mode():
                if arrived is not None:
                    self._take(arrived)
                else:
                    self._start_final()

    def _wait_for_text(self) -> None:
        timeout = self._text_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not (self._arrived or self._finished):
                raise_if_cancelled(self._cancel)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no text for {timeout:g} s")
                self._lock.wait(_WAIT_POLL_S)
        raise_if_cancelled(self._cancel)

    # --- the layout ----------------------------------------------------------------------------

    def _take(self, token: int) -> None:
        """One text token taken: interleave prompt speech, or open the next group."""
        self._taken += 1
        self._text.append(token)
        lm = self.lm
        while self._prompt_speech and len(self._text) >= self._n_text:
            speech = self._prompt_speech[: self._n_speech]
            del self._prompt_speech[: self._n_speech]
            self._pending += [lm.embed_text(self._pop_group()), lm.embed_speech(speech)]
        if self._prompt_speech:
            return
        if self._awaiting_group:
            if len(self._text) < self._n_text:
                return
            self._pending.append(lm.embed_text(self._pop_group()))
            self._awaiting_group = False
        self._drawing = True

    def _pop_group(self) -> list[int]:
        group = self._text[: self._n_text]
        del self._text[: self._n_text]
        return group

    def _start_final(self) -> None:
        """No more text: [last input again | remaining text | TASK_ID], then draw to the end."""
        lm = self.lm
        if self._pending:  # nothing drawn yet
            head = self._pending
        else:
            assert self._last_input is not None
            head = [self._last_input]
        self._pending = [*head, lm.embed_text(self._text), lm.special_input(lm.TASK_ID)]
        self._text, self._prompt_speech = [], []
        self._final = self._drawing = True
        self._max_len = int(self._fed * lm.args.max_token_text_ratio)
        if self._fixed_len is not None:
            self._max_len = self._fixed_len
        if self._yielded >= self._max_len:
            self._done = True

    @property
    def _unused_stop(self) -> int:
        """The stop token between EOS and fill: it ends neither a group nor the text."""
        return self.lm.eos + 1

    def _decide(self) -> int | None:
        """Read the pending rows, take one decision; the speech token to yield, if any."""
        lm = self.lm
        with torch.inference_mode():
            rows = torch.cat(self._pending, dim=1)
            out = lm.prefill(rows, self._room_for(rows.shape[1]))
            if self._observer is not None:
                self._observer(rows, out)
        self._last_input, self._pending = rows, []
        if self._final:
            fixed = self._fixed_len is not None
            token = self._draw(out.logits[0], masked=lm.stop_tokens if fixed else ())
        elif len(self._history) == self._next_fill:
            token = lm.fill_token
        else:
            token = self._draw(out.logits[0], masked=(lm.eos, self._unused_stop))
        if not self._final and token == lm.fill_token:
            self._next_fill = len(self._history) + self._n_speech + 1
        self._history.append(token)
        if token in lm.stop_tokens:
            if self._final:
                self._done = True
            else:  # a fill: the next text group takes its place
                self._drawing, self._awaiting_group = False, True
            return None
        self._yielded += 1
        if self._final and self._yielded >= self._max_len:
            self._done = True
        elif self._fixed_len is not None and self._yielded >= self._fixed_len:
            self._done = True
        else:
            with torch.inference_mode():
                self._pending = [lm.embed_speech([token])]
        return token

    def _draw(self, logits: Tensor, masked: Iterable[int]) -> int:
        with torch.inference_mode():
            sampling = self.lm.args.sampling
            return draw_token(
                logits, self._history, masked, self._sampler, sampling, self._generator
            )

    def _room_for(self, rows: int) -> KVCache:
        """The session's cache with room for ``rows`` more positions (doubled when full)."""
        cache = self._cache
        if cache is None:
            size = rows + len(self._prompt_speech) + len(self._text) + _CACHE_HEADROOM
            cache = self._cache = self.lm.new_cache(size)
        need = cache.length + rows
        if need > cache.max_len:
            grown = self.lm.new_cache(max(need, 2 * cache.max_len))
            grown.kv[..., : cache.length, :] = cache.kv[..., : cache.length, :]
            grown.length = cache.length
            cache = self._cache = grown
        return cache

    @property
    def cache(self) -> KVCache | None:
        """The KV cache (None before the first LM call)."""
        return self._cache


def _checked_ids(ids: TokenIds | None, vocab: int, what: str) -> list[int]:
    """Ids as a list of ints, each in [0, vocab); ValueError naming the first bad one."""
    if ids is None:
        return []
    values = [int(i) for i in torch.as_tensor(ids).reshape(-1).tolist()]
    bad = next((i for i in values if not 0 <= i < vocab), None)
    if bad is not None:
        raise ValueError(f"{what} token id {bad} is outside [0, {vocab})")
    return values
