"""CosyVoice2's speech-token LM (``llm.pt``): the Qwen2 backbone with speech input and output.

Input layout (one sequence of embeddings, each row ``llm_input_size`` wide)::

    [SOS | embed_tokens(prompt_text ++ text) | TASK_ID | speech_embedding(prompt speech tokens)]

``SOS`` and ``TASK_ID`` are rows 0 and 1 of ``llm_embedding``; text goes through the Qwen2
token embedding, speech tokens through ``speech_embedding``. Zero-shot fills every part;
instruct2 puts the instruction (ending in ``<|endofprompt|>``) where the prompt text goes and
no prompt speech; cross-lingual has neither. The LM takes no speaker embedding.

``llm_decoder`` maps the backbone's last (normed) hidden state to ``speech_token_size + 3``
classes: the speech tokens, then EOS and two more stop tokens (the last one is the "fill" token
of interleaved text input). Sampling any of the three ends the answer; only EOS is masked while
fewer than ``min_len`` tokens were drawn. Lengths count the text tokens only (prompt excluded):
``min_len = int(2 n)``, ``max_len = int(20 n)``. The draw is v1's repetition-aware nucleus
sampling (:mod:`engine.core.sampling`) with the yaml's top-p / top-k / window.

Text that arrives in pieces (an LLM's reply) goes through :class:`BistreamSession`
(:meth:`CosyVoice2LM.bistream`): text and speech tokens interleaved by ``mix_ratio``, speech
drawn as soon as the text read so far allows, one KV cache for the whole answer.

Loading: build on the ``meta`` device and assign a state dict with the official keys
(:func:`load_speech_lm`); missing, unexpected or misshapen keys raise :class:`ModelLoadError`
naming them. :meth:`CosyVoice2LM.int8_layer_names` lists the layers the int8 option replaces.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from engine.core.hparams import (
    ModelConfigError,
    SamplingArgs,
    Section,
    TaggedNode,
    read_model_yaml,
    sampling_args,
)
from engine.core.sampling import Sampler, forced_sampler, ras_sampling
from engine.core.transformer import KVCache
from engine.core.types import ModelLoadError, SynthesisCancelled
from engine.core.weights import state_dict_problems
from engine.cosyvoice2.qwen2 import (
    Qwen2CausalLM,
    Qwen2Config,
    Qwen2Model,
    float_sources,
    int8_layer_names,
    quantize_int8,
)

CONFIG_FILE = "cosyvoice2.yaml"
BACKBONE_DIR = "CosyVoice-BlankEN"  # config.json and tokenizer files of the Qwen2 backbone
LM_CLASS = "Qwen2LM"  # the yaml's class name for this layout
# Read by nothing at inference (the text head of the backbone): a prepared file may leave it out.
UNUSED_KEYS = ("llm.model.lm_head.weight",)

TokenIds = Sequence[int] | Tensor


@dataclass(frozen=True)
class SpeechLMArgs:
    """The speech LM's hyperparameters: the yaml's ``llm`` section plus the backbone config."""

    llm_input_size: int
    llm_output_size: int
    speech_token_size: int
    mix_ratio: tuple[int, int]
    sampling: SamplingArgs
    backbone: Qwen2Config
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0


def speech_lm_args(llm_section: object, backbone: Qwen2Config, source: str) -> SpeechLMArgs:
    """The args from a parsed yaml ``llm`` section (``!new:...Qwen2LM``) and the backbone's."""
    if isinstance(llm_section, TaggedNode) and llm_section.target.rsplit(".", 1)[-1] != LM_CLASS:
        raise ModelConfigError(f"{source}: 'llm' is {llm_section.target}, expected {LM_CLASS}")
    sec = Section(llm_section, "llm", source)
    mix_ratio = sec.ints("mix_ratio", [5, 15])
    if len(mix_ratio) != 2:
        raise ModelConfigError(f"{source}: 'llm.mix_ratio' must hold two integers")
    args = SpeechLMArgs(
        llm_input_size=sec.int("llm_input_size"),
        llm_output_size=sec.int("llm_output_size"),
        speech_token_size=sec.int("speech_token_size"),
        mix_ratio=(mix_ratio[0], mix_ratio[1]),
        sampling=sampling_args(sec.sub("sampling")),
        backbone=backbone,
    )
    if not args.llm_input_size == args.llm_output_size == backbone.hidden_size:
        raise ModelConfigError(
            f"{source}: llm_input_size / llm_output_size ({args.llm_input_size} / "
            f"{args.llm_output_size}) must equal the backbone's hidden_size "
            f"({backbone.hidden_size})"
        )
    return args


def load_speech_lm_args(model_dir: Path) -> SpeechLMArgs:
    """Read ``cosyvoice2.yaml`` and ``CosyVoice-BlankEN/config.json`` of a model folder."""
    model_dir = Path(model_dir)
    doc = read_model_yaml(model_dir / CONFIG_FILE)
    if "llm" not in doc:
        raise ModelConfigError(f"{model_dir / CONFIG_FILE}: missing top-level section 'llm'")
    backbone = Qwen2Config.read(model_dir / BACKBONE_DIR)
    return speech_lm_args(doc["llm"], backbone, CONFIG_FILE)


class StepOut(NamedTuple):
    """Last hidden state (B, D) after the backbone's final norm and the decoder logits (B, V+3)."""

    hidden: Tensor
    logits: Tensor


def _ids(ids: TokenIds | None, device: torch.device) -> Tensor:
    """Token ids as a (1, N) int64 tensor; accepts lists, (N,) and (1, N) tensors."""
    if ids is None:
        return torch.zeros(1, 0, dtype=torch.long, device=device)
    return torch.as_tensor(ids, dtype=torch.long, device=device).reshape(1, -1)


class _Backbone(nn.Module):
    """Holds the Qwen2 model under the checkpoint's ``llm.model`` prefix."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2CausalLM(cfg)


class CosyVoice2LM(nn.Module):
    """The CosyVoice2 speech-token LM."""

    SOS = 0  # rows of llm_embedding
    TASK_ID = 1

    def __init__(self, args: SpeechLMArgs) -> None:
        super().__init__()
        self.args = args
        d = args.llm_input_size
        n_speech = args.speech_token_size
        self.llm_embedding = nn.Embedding(2, d)
        self.llm = _Backbone(args.backbone)
        self.llm_decoder = nn.Linear(args.llm_output_size, n_speech + 3)
        self.speech_embedding = nn.Embedding(n_speech + 3, d)
        self.speech_token_size = n_speech
        self.eos = n_speech
        self.fill_token = n_speech + 2
        self.stop_tokens = frozenset(range(n_speech, n_speech + 3))

    @property
    def backbone(self) -> Qwen2Model:
        """The Qwen2 decoder stack (``llm.model.model``)."""
        return self.llm.model.model

    @property
    def _device(self) -> torch.device:
        return self.llm_embedding.weight.device

    # --- input assembly ------------------------------------------------------------------------

    def embed_text(self, ids: TokenIds | None) -> Tensor:
        """(1, N, D) Qwen2 token embeddings of text ids."""
        return self.llm.model.model.embed_tokens(_ids(ids, self._device))

    def embed_speech(self, ids: TokenIds | None) -> Tensor:
        """(1, N, D) embeddings of speech tokens."""
        return self.speech_embedding(_ids(ids, self._device))

    def special_input(self, row: int) -> Tensor:
        """(1, 1, D): ``SOS`` or ``TASK_ID``."""
        return self.llm_embedding.weight[row].view(1, 1, -1)

    def build_input(
        self,
        text_ids: TokenIds,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
    ) -> Tensor:
        """(1, L0, D) = [SOS | text(prompt ++ text) | TASK_ID | prompt speech]."""
        dev = self._device
        text = torch.cat([_ids(prompt_text_ids, dev), _ids(text_ids, dev)], dim=1)
        return torch.cat(
            [
                self.special_input(self.SOS),
                self.embed_text(text),
                self.special_input(self.TASK_ID),
                self.embed_speech(prompt_speech_ids),
            ],
            dim=1,
        )

    # --- decoding ------------------------------------------------------------------------------

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return self.llm.model.model.new_cache(batch, max_len)

    def _step(self, x: Tensor, cache: KVCache) -> StepOut:
        hidden = self.llm.model.model.forward_cached(x, cache)[:, -1]
        return StepOut(hidden, self.llm_decoder(hidden))

    def prefill(self, lm_input: Tensor, cache: KVCache) -> StepOut:
        """Append embeddings (B, T, D) to the sequence; the outputs of its last position."""
        return self._step(lm_input, cache)

    def decode_step(self, tokens: Tensor | int, cache: KVCache) -> StepOut:
        """Feed the previous token(s) (B,) (or one int) and return the next step's outputs."""
        if isinstance(tokens, int):
            tokens = torch.tensor([tokens], device=self._device)
        return self._step(self.speech_embedding(tokens.view(-1, 1)), cache)

    def length_limits(self, n_tts_text: int) -> tuple[int, int]:
        """(min_len, max_len) in speech tokens for ``n_tts_text`` text tokens (prompt excluded)."""
        return (
            int(n_tts_text * self.args.min_token_text_ratio),
            int(n_tts_text * self.args.max_token_text_ratio),
        )

    def generate(
        self,
        text_ids: TokenIds,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
        *,
        generator: torch.Generator | None = None,
        max_tokens: int | None = None,
        forced_tokens: Sequence[int] | None = None,
        sampler: Sampler | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Yield speech tokens until a stop token or the length cap (stop tokens not yielded).

        ``max_tokens`` fixes the count (benchmarks: EOS stays masked throughout, exactly that
        many tokens unless another stop token is drawn). ``forced_tokens`` / ``sampler`` replace
        the draw (tests); the sampler receives the EOS-masked log-probs and the history.
        ``cancel`` is checked before each token: :class:`SynthesisCancelled` once it is set.
        """
        n_text = _ids(text_ids, torch.device("cpu")).shape[1]
        min_len, max_len = self.length_limits(n_text)
        if max_tokens is not None:
            max_len = min_len = max(0, int(max_tokens))
        if forced_tokens is not None:
            sampler = forced_sampler(forced_tokens)
        if max_len == 0:
            return
        _check_cancel(cancel)
        # inference_mode blocks never span a yield: the mode is thread-local state of the caller.
        with torch.inference_mode():
            lm_input = self.build_input(text_ids, prompt_text_ids, prompt_speech_ids)
            cache = self.new_cache(lm_input.shape[1] + max_len)
            out = self.prefill(lm_input, cache)
        history: list[int] = []
        for step in range(max_len):
            _check_cancel(cancel)
            with torch.inference_mode():
                token = self._draw(out.logits[0], history, step < min_len, sampler, generator)
            if token in self.stop_tokens:
                return
            yield token
            history.append(token)
            if step + 1 < max_len:
                with torch.inference_mode():
                    out = self.decode_step(token, cache)

    def _draw(
        self,
        logits: Tensor,
        history: Sequence[int],
        eos_masked: bool,
        sampler: Sampler | None,
        generator: torch.Generator | None,
    ) -> int:
        logp = logits.float().log_softmax(dim=0)
        if eos_masked:  # before sampling; the other stop tokens stay drawable
            logp[self.eos] = float("-inf")
        if sampler is not None:
            return sampler(logp, history)
        return ras_sampling(logp, history, self.args.sampling, generator)

    def bistream(
        self,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
        **options: Any,
    ) -> BistreamSession:
        """A session whose text arrives in pieces (:class:`BistreamSession`)."""
        return BistreamSession(self, prompt_text_ids, prompt_speech_ids, **options)

    # --- int8 ----------------------------------------------------------------------------------

    def int8_layer_names(self) -> list[str]:
        """Dotted names of the int8 layers: every backbone block's, then ``llm_decoder``.

        A name ending in ``qkv_proj`` / ``gate_up_proj`` stands for the float layers whose
        weights it stacks (:func:`int8_sources`).
        """
        return [*int8_layer_names(self.backbone, "llm.model.model."), "llm_decoder"]

    def quantize_int8(self) -> CosyVoice2LM:
        """Swap the int8 layers in, in place (embeddings, norms and the unused head stay)."""
        quantize_int8(self, self.int8_layer_names())
        return self


def int8_sources(name: str) -> list[str]:
    """The float layers (dotted names in the speech LM) an int8 layer's rows come from."""
    return float_sources(name)


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        raise SynthesisCancelled("synthesis cancelled")


# --- text arriving in pieces ("bistream") ----------------------------------------------------


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
    ) -> None:
        """``forced_tokens`` / ``sampler`` replace the draws (tests; forced fills draw nothing).

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
        self._pending: list[Tensor] = [lm.special_input(lm.SOS)]  # rows not read yet
        self._last_input: Tensor | None = None  # rows of the last LM call
        self._awaiting_group = not self._prompt_speech
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
            _check_cancel(self._cancel)
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
                _check_cancel(self._cancel)
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no text for {timeout:g} s")
                self._lock.wait(_WAIT_POLL_S)
        _check_cancel(self._cancel)

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
            logp = logits.float().log_softmax(dim=0)
            for token in masked:
                logp[token] = float("-inf")
            if self._sampler is not None:
                return int(self._sampler(logp, self._history))
            return ras_sampling(logp, self._history, self.lm.args.sampling, self._generator)

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


# --- loading ---------------------------------------------------------------------------------


def check_speech_lm_state(
    model: CosyVoice2LM, state: Mapping[str, Tensor], source: str = "llm.pt"
) -> None:
    """Raise :class:`ModelLoadError` naming every missing, unexpected or misshapen key.

    With a tied head, ``llm.model.lm_head.weight`` may be absent (it is the embedding).
    """
    optional = set(UNUSED_KEYS) if model.args.backbone.tie_word_embeddings else set()
    if problems := state_dict_problems(model, state, optional):
        raise ModelLoadError(f"{source} does not fit the CosyVoice2 LM: " + "; ".join(problems))


def build_speech_lm(args: SpeechLMArgs, device: torch.device | str = "meta") -> CosyVoice2LM:
    """The module with uninitialised (``meta``: absent) weights, to be assigned."""
    with torch.device(device):
        return CosyVoice2LM(args)


def load_speech_lm(
    state: Mapping[str, Tensor],
    args: SpeechLMArgs,
    *,
    int8: bool = False,
    source: str = "llm.pt",
) -> CosyVoice2LM:
    """Build on ``meta``, check ``state`` strictly and assign it (tensors used in place)."""
    model = build_speech_lm(args)
    check_speech_lm_state(model, state, source)
    floats = {k: v if v.dtype == torch.float32 else v.float() for k, v in state.items()}
    head = UNUSED_KEYS[0]
    if head not in floats:  # tied: the head is the embedding (checked above)
        floats[head] = floats["llm.model.model.embed_tokens.weight"]
    model.load_state_dict(floats, strict=True, assign=True)
    model.llm.model.tie_weights()
    model.eval().requires_grad_(False)
    if int8:
        model.quantize_int8()
    return model
