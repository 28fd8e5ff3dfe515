"""Fold weight-norm parameter pairs of a HiFT state dict into plain conv weights.

A ``hift.pt`` stores each weight-normed conv as a (g, v) pair under the names of the torch API
that wrapped it: ``X.weight_g`` / ``X.weight_v`` (``torch.nn.utils.weight_norm``, which the code
of the CosyVoice-300M release called) or ``X.parametrizations.weight.original0`` / ``original1``
(``torch.nn.utils.parametrizations.weight_norm``: the CosyVoice2 and Fun-CosyVoice3 releases).
Both mean W = g · v / ‖v‖ with the norm over every dim except dim 0 (ConvTranspose1d: dim 0 is
the *input*-channel axis, g is (in, 1, 1)).
Folding once at load time lets the vocoder run with plain convolutions and no per-call
reparametrisation. HiFiGAN training checkpoints prefix every key with ``generator.``; it is dropped.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

_PREFIX = "generator."
# {"g": suffix, "v": suffix} of a weight-normed ``X.weight`` in each layout, by layout name.
LEGACY_SUFFIXES = {"g": ".weight_g", "v": ".weight_v"}
PARAMETRIZATIONS_SUFFIXES = {
    "g": ".parametrizations.weight.original0",
    "v": ".parametrizations.weight.original1",
}
LAYOUTS = {"legacy": LEGACY_SUFFIXES, "parametrizations": PARAMETRIZATIONS_SUFFIXES}


def fold_weight_norm(g: Tensor, v: Tensor) -> Tensor:
    """Return g · v / ‖v‖ (norm over all dims but 0), computed like torch's own weight-norm."""
    if g.dim() != v.dim() or g.shape[0] != v.shape[0] or g[0].numel() != 1:
        raise ValueError(f"weight-norm g {tuple(g.shape)} does not fit v {tuple(v.shape)}")
    g = g.detach()
    v = v.detach()
    fn = getattr(torch, "_weight_norm", None)
    if fn is not None:
        # The same kernel torch's weight_norm hooks call, so folded weights equal the official
        # module's effective weights bit for bit.
        return fn(v, g, 0).contiguous()
    norm = v.flatten(1).norm(dim=1).view(g.shape)
    return (v * (g / norm)).contiguous()


def split_weight_norm_key(key: str) -> tuple[str, str, str] | None:
    """(module path, layout, 'g'|'v') for a weight-norm key, else None."""
    for layout, suffixes in LAYOUTS.items():
        for part, suffix in suffixes.items():
            if key.endswith(suffix):
                return key[: -len(suffix)], layout, part
    return None


def normalize_hift_state_dict(sd: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return a new state dict with any ``generator.`` prefix removed and weight norm folded.

    Accepts the legacy (``weight_g``/``weight_v``) and the parametrizations
    (``original0``/``original1``) layouts, also mixed. Raises ValueError naming the offending keys
    when a pair is incomplete, a module has both layouts, or a folded weight collides with a
    plain ``X.weight`` already in the dict. The input dict is not modified.
    """
    stripped: dict[str, Tensor] = {}
    for key, value in sd.items():
        new = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        if new in stripped:
            raise ValueError(f"state dict has '{new}' both with and without the '{_PREFIX}' prefix")
        stripped[new] = value

    pairs: dict[str, dict[str, tuple[str, str]]] = {}  # module -> part -> (key, layout)
    out: dict[str, Tensor] = {}
    for key, value in stripped.items():
        split = split_weight_norm_key(key)
        if split is None:
            out[key] = value
            continue
        module, layout, part = split
        slot = pairs.setdefault(module, {})
        if part in slot:
            raise ValueError(
                f"weight norm of '{module}' given twice: '{slot[part][0]}' and '{key}'"
            )
        slot[part] = (key, layout)

    problems: list[str] = []
    for module, slot in pairs.items():
        keys = [k for k, _ in slot.values()]
        if set(slot) != {"g", "v"}:
            missing = "v" if "g" in slot else "g"
            problems.append(f"{keys[0]} has no matching {missing} tensor")
            continue
        if slot["g"][1] != slot["v"][1]:
            problems.append(f"mixed weight-norm layouts for '{module}': {keys}")
            continue
        if f"{module}.weight" in out:
            problems.append(f"'{module}.weight' present together with {keys}")
            continue
        try:
            out[f"{module}.weight"] = fold_weight_norm(
                stripped[slot["g"][0]], stripped[slot["v"][0]]
            )
        except ValueError as err:
            problems.append(f"{keys}: {err}")
    if problems:
        raise ValueError("malformed HiFT weight-norm entries: " + "; ".join(sorted(problems)))
    logger.debug("folded weight norm of %d HiFT layers", len(pairs))
    return out
