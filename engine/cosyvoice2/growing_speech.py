"""Speech tokens for one sentence whose text is still arriving (an LLM's reply): its safely
cut pieces (:class:`~engine.cosyvoice2.growing_text.GrowingTextIds`) fed to the LM's bistream
session while it grows, or the usual layout when it ended before the LM could start."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from engine.core.text_feed import TextFeed
from engine.core.types import SynthesisOptions, raise_if_cancelled
from engine.cosyvoice2.bistream import BistreamSession
from engine.cosyvoice2.growing_text import GrowingTextIds

if TYPE_CHECKING:
    from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
    from engine.cosyvoice2.lm import CosyVoice2LM
    from engine.cosyvoice2.prompt import VoiceConditioning

# How often a wait for more of a sentence's text looks at the request's cancel event.
TEXT_POLL_S = 0.05


def growing_tokens(
    lm: CosyVoice2LM,
    frontend: CosyVoice2TextFrontend,
    text: TextFeed,
    cond: VoiceConditioning,
    options: SynthesisOptions,
    generator: torch.Generator,
    cancel: threading.Event | None,
    *,
    new_session: Callable[..., BistreamSession] | None = None,
) -> Iterator[int]:
    """Speech tokens for a growing sentence: its safely cut pieces fed to a bistream
    session while it grows; the usual layout when it ends before the LM could start.
    ``new_session``: the family's session class, called as :class:`BistreamSession` (None:
    that one)."""
    ids = GrowingTextIds(frontend)
    session = (new_session or BistreamSession)(
        lm,
        cond.prompt_text_ids,
        cond.llm_prompt_tokens,
        generator=generator,
        cancel=cancel,
        max_tokens=options.force_tokens,
    )
    seen = None
    while not (now := text.wait(seen, TEXT_POLL_S)).final:
        raise_if_cancelled(cancel)
        if now != seen:
            session.feed_text(ids.update(now.text))
            seen = now
        yield from session.ready_tokens()
        if session.done:
            return
    raise_if_cancelled(cancel)
    if session.cache is None:  # the LM never started: the sentence's own layout
        segments = frontend.segments(now.text, split=False) if now.text.strip() else []
        if segments:
            yield from lm.generate(
                segments[0].token_ids,
                cond.prompt_text_ids,
                cond.llm_prompt_tokens,
                generator=generator,
                max_tokens=options.force_tokens,
                cancel=cancel,
            )
        return
    session.feed_text(ids.finish(now.text))
    session.finish()
    yield from session.tokens()


def whole_text(text: TextFeed, cancel: threading.Event | None) -> str:
    """The sentence once it has ended (waits; :class:`SynthesisCancelled` on ``cancel``)."""
    now = text.now
    while not now.final:
        raise_if_cancelled(cancel)
        now = text.wait(now, TEXT_POLL_S)
    return now.text
