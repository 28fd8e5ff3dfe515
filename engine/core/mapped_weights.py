"""A loaded model's tensors that stay mapped from its prepared file, and mapping some afresh.

A mapped tensor's pages become resident as the model reads them, and stay resident while the
mapping they were read through lives. Pointing tensors at a new mapping of the same file lets
the old mapping go, with its pages, once nothing refers to it any more; the new one makes
resident only what is read from then on. The values are the file's bytes either way, so a model
computes the same after as before, bit for bit.

The loader makes these (engine.core.prepared); a family uses them for weights it reads rarely
(CosyVoice3's time modulations: engine.cosyvoice3.dit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


def point_at(module: nn.Module, tensors: Mapping[str, Tensor]) -> None:
    """Make each of ``module``'s tensors named in ``tensors`` (state-dict names) that tensor; a
    parameter stays a parameter (not load_state_dict: int8 layers in place would want their
    own keys)."""
    for name, tensor in tensors.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        if isinstance(getattr(owner, attr), nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=False)
        setattr(owner, attr, tensor)


@dataclass(frozen=True)
class MappedWeights:
    """``module``'s tensors that a finished load left mapped from its prepared file."""

    module: nn.Module
    names: frozenset[str]  # state-dict names of the mapped tensors
    read: Callable[[list[str]], dict[str, Tensor]]  # these tensors through a new mapping

    def under(self, modules: Iterable[str]) -> list[str]:
        """The mapped tensors held by these sub-modules (dotted names from ``module``)."""
        owners = set(modules)
        return sorted(name for name in self.names if name.rpartition(".")[0] in owners)

    def map_afresh(self, names: Sequence[str]) -> None:
        """Point these mapped tensors at a new mapping of the file: the pages their old one
        made resident go once nothing reads through it (a call running now keeps it until it
        ends), and come back only as far as they are read again."""
        if not names:
            return
        # Ordinary tensors even inside an inference-mode call: a later call outside one may
        # read them.
        with torch.inference_mode(False):
            point_at(self.module, self.read(list(names)))
