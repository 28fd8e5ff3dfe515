"""The speaker x-vector as the flow of every family reads it: L2-normalised, then projected by
the flow's ``spk_embed_affine_layer``."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


def project_speaker(affine: nn.Linear, embedding: Tensor) -> Tensor:
    """Raw x-vector (1, 192) → normalised and projected ``spks`` (1, out_features)."""
    weight = affine.weight
    return affine(F.normalize(embedding.reshape(1, -1).to(weight), dim=1))
