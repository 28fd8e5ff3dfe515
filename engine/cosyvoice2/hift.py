"""CosyVoice2's HiFT: v1's vocoder (:class:`engine.core.hift.HiFTGenerator`) built from v2's config.

24 kHz, 480 samples a mel frame (upsampling 8·5·3, iSTFT hop 4); the 24 kHz config selects the
frame-rate sine source. ``hift.pt`` stores its convolutions weight-normed; the pairs are folded
into plain weights before the strict check
(:func:`engine.core.weight_norm.normalize_hift_state_dict`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import torch
from torch import Tensor

from engine.core.hift import HiFTGenerator
from engine.core.hparams import HiFTArgs
from engine.core.types import ModelLoadError
from engine.core.weight_norm import normalize_hift_state_dict
from engine.cosyvoice2.flow import assign_weights

H = TypeVar("H", bound=HiFTGenerator)


def build_hift(args: HiFTArgs, device: torch.device | str = "meta") -> HiFTGenerator:
    """The vocoder with uninitialised (``meta``: absent) weights, to be assigned."""
    with torch.device(device):
        return HiFTGenerator(args)


def load_hift(
    state: Mapping[str, Tensor], args: HiFTArgs, source: str = "hift.pt"
) -> HiFTGenerator:
    """Fold weight norm, build on ``meta``, check strictly and assign ``state``."""
    return assign_hift(build_hift(args), state, source)


def assign_hift(hift: H, state: Mapping[str, Tensor], source: str = "hift.pt") -> H:
    """Fold weight norm, check strictly and assign ``state`` to a ``meta``-built vocoder."""
    try:
        folded = normalize_hift_state_dict(dict(state))
    except ValueError as err:
        raise ModelLoadError(f"{source}: {err}") from err
    assign_weights(hift, folded, source)
    for module in hift.modules():  # the STFT window; channels-last convolution weights
        materialize = getattr(module, "materialize_derived", None)
        if callable(materialize):
            materialize()
    return hift


def int8_layer_names(hift: HiFTGenerator) -> list[str]:
    """HiFT keeps every layer in floating point (its cost is convolutions, not Linear layers)."""
    del hift
    return []
