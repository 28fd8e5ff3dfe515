"""One LM in two weight formats without holding its common layers twice.

An engine that lets requests choose the LM's format (the int8 LM for the exact profiles, the
int4 one for the fast ones) loads the second format from its own prepared file. The two differ
only in their quantised layers: the int4 format's 4-bit feed-forward layers; its other int8
layers, its embeddings, norms and heads are the int8 format's, made by the same recipe from the
same checkpoint. Pointing the second LM at the first one's copies keeps one of each.
"""

from __future__ import annotations

from torch import nn


def _own_tensors(module: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """The names, shapes and dtypes of a module's own parameters and buffers."""
    tensors = [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors if t is not None]


def share_unchanged_layers(primary: nn.Module, other: nn.Module) -> list[str]:
    """Replace each leaf layer of ``other`` by ``primary``'s at the same name where both are the
    same kind of layer with tensors of the same shapes and dtypes: the layers both formats
    store alike. Returns the names replaced. Layers of another kind (a 4-bit layer where
    ``primary`` has an int8 one, an int8 one where it has a float one) stay ``other``'s own.
    """
    theirs = dict(primary.named_modules())
    shared = []
    for name, layer in list(other.named_modules()):
        if not name or next(layer.children(), None) is not None:
            continue  # the LM itself, or a container: its leaves decide
        mine = theirs.get(name)
        if mine is None or mine is layer or type(mine) is not type(layer):
            continue
        if _own_tensors(mine) != _own_tensors(layer):
            continue
        other.set_submodule(name, mine)
        shared.append(name)
    return shared
