"""Our CosyVoice3 flow and HiFT built from the verbatim official full-size yaml hold exactly the
keys and shapes of the official modules (tests/data/cosyvoice3/manifest_full.json, made by
building the official classes from that yaml), and load a state dict of those shapes strictly."""

from __future__ import annotations

import json
from typing import Any

import torch
from conftest import TESTS
from torch import Tensor

from engine.cosyvoice3.dit import rotary_frequencies
from engine.cosyvoice3.flow import ROTARY_KEY, build_flow, load_flow
from engine.cosyvoice3.flow_args import load_flow_args
from engine.cosyvoice3.hift import build_causal_hift, load_causal_hift, load_causal_hift_args

DATA = TESTS / "data" / "cosyvoice3"
FULL_YAML = DATA / "cosyvoice3_0.5b.yaml"
MANIFEST: dict[str, Any] = json.loads((DATA / "manifest_full.json").read_text(encoding="utf-8"))


def _official(module: str) -> dict[str, tuple[int, ...]]:
    return {e["key"]: tuple(e["shape"]) for e in MANIFEST["modules"][module]["state_dict"]}


def test_full_size_flow_has_the_official_keys_and_shapes() -> None:
    flow = build_flow(load_flow_args(FULL_YAML))  # on meta: no 1.3 GB allocation
    ours = {k: tuple(v.shape) for k, v in flow.state_dict().items()}
    # The rotary frequencies are a buffer the official state dict holds; ours computes them.
    expected = _official("flow")
    assert expected.pop(ROTARY_KEY) == (flow.args.estimator.dim_head // 2,)
    assert ours == expected
    params = sum(v.numel() for v in flow.state_dict().values())
    assert params == MANIFEST["modules"]["flow"]["parameters"]


def test_full_size_flow_loads_an_official_state_dict_strictly() -> None:
    args = load_flow_args(FULL_YAML)
    state: dict[str, Tensor] = {
        key: torch.empty(shape, device="meta") for key, shape in _official("flow").items()
    }
    state[ROTARY_KEY] = rotary_frequencies(args.estimator.dim_head)
    flow = load_flow(state, args)
    assert {k for k, _ in flow.named_parameters()} == set(state) - {ROTARY_KEY}


def test_full_size_hift_loads_the_official_keys_and_shapes_strictly() -> None:
    """Every official key (weight norm in the layout current torch writes) is read, none is
    missing; folded, the weights have our module's shapes."""
    args = load_causal_hift_args(FULL_YAML)
    official = _official("hift")
    state = {key: torch.ones(shape) for key, shape in official.items()}
    hift = load_causal_hift(state, args)
    ours = {k: tuple(v.shape) for k, v in build_causal_hift(args).state_dict().items()}
    assert {k: tuple(v.shape) for k, v in hift.state_dict().items()} == ours
    folded = {k.replace(".parametrizations.weight.original1", ".weight") for k in official}
    assert set(ours) == {k for k in folded if not k.endswith(".original0")}
    assert (
        sum(v.numel() for v in hift.state_dict().values())
        < (MANIFEST["modules"]["hift"]["parameters"])
    )
