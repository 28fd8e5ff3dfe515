"""Text arriving in pieces for Fun-CosyVoice3: CosyVoice2's :class:`BistreamSession` with the
system prompt read first.

The official CosyVoice3 LM reads its prompt text up to and including the first
``<|endofprompt|>`` (the system prompt, with the instruction when there is one) right after
``SOS``; only the rest of it (a zero-shot transcript) joins the interleaving of five text and
fifteen speech tokens. Its first input being longer than ``SOS`` alone, it does not wait for a
first group of five text tokens: without prompt speech the first speech token is drawn as soon
as one text token has arrived, from the system prompt alone, and the first fill comes 15
tokens later. Everything else (fills, the end, what is masked) is CosyVoice2's session on this
LM's ids: ``SOS`` and ``EOS`` are masked while text may still come.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.core.lm_step import TokenIds
from engine.cosyvoice2.bistream import BistreamSession
from engine.cosyvoice3.lm import CosyVoice3LM


class CosyVoice3BistreamSession(BistreamSession):
    """One CosyVoice3 answer whose text is fed while its speech tokens are drawn."""

    def __init__(
        self,
        lm: CosyVoice3LM,
        prompt_text_ids: TokenIds,
        prompt_speech_ids: TokenIds | None = None,
        *,
        end_of_prompt_id: int,
        **options: Any,
    ) -> None:
        """``prompt_text_ids`` must hold ``end_of_prompt_id`` (the official LM asserts it);
        ``options`` are :class:`BistreamSession`'s."""
        ids = [int(i) for i in torch.as_tensor(prompt_text_ids).reshape(-1).tolist()]
        if end_of_prompt_id not in ids:
            raise ValueError("the prompt text has no <|endofprompt|>: the system prompt is missing")
        cut = ids.index(end_of_prompt_id) + 1
        super().__init__(lm, ids[cut:], prompt_speech_ids, lead_text_ids=ids[:cut], **options)
