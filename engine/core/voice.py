"""What conditions the LM and the flow for one voice: built by the engine for a built-in speaker
and by ``engine.prompt.voices`` for a custom one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.core.streaming import FlowPrompt


@dataclass(frozen=True)
class Voice:
    """Everything that conditions the LM and the flow for one voice."""

    name: str
    llm_embedding: torch.Tensor  # (1, 192), or (0, 192) when the LM gets no speaker (instruct)
    flow_embedding: torch.Tensor  # (1, 192)
    prompt_text_ids: list[int] = field(default_factory=list)
    llm_prompt_tokens: list[int] = field(default_factory=list)
    flow_prompt: FlowPrompt | None = None
