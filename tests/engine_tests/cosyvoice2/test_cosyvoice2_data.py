"""The CosyVoice2 reference data is self-consistent: the tiny model has the released model's
structure, every case file loads without pickled code, and the tiny tokenizer files are complete."""

import json
import re

import pytest
import torch
from conftest import TESTS

DATA = TESTS / "data" / "cosyvoice2"
MANIFEST = json.loads((DATA / "manifest_full.json").read_text())


def key_patterns(keys):
    """State-dict keys with layer indices replaced, so a 2-layer and a 24-layer model compare."""
    return {re.sub(r"\.\d+(?=\.)", ".N", key) for key in keys}


def released_keys(module):
    entry = MANIFEST["modules"][module]
    if module == "hift":
        return entry["state_dict_keys_in_legacy_weight_norm_layout"]
    return [item["key"] for item in entry["state_dict"]]


@pytest.mark.parametrize("module", ["llm", "flow", "hift"])
def test_tiny_model_has_the_released_key_structure(module):
    tiny = torch.load(DATA / "tiny" / f"{module}.pt", weights_only=True)
    assert key_patterns(tiny) == key_patterns(released_keys(module))


@pytest.mark.parametrize("name", ["llm_cases", "flow_cases", "hift_cases", "stream_cases"])
def test_case_files_load_without_code_and_match_their_index(name):
    cases = torch.load(DATA / f"{name}.pt", weights_only=True)
    index = json.loads((DATA / f"{name}.json").read_text())["tensors"]
    assert set(index) == {key for key, value in cases.items() if isinstance(value, torch.Tensor)}
    for key, entry in index.items():
        assert list(cases[key].shape) == entry["shape"], key


def test_tiny_tokenizer_ids_fit_the_tiny_embedding():
    blank = DATA / "tiny" / "CosyVoice-BlankEN"
    config = json.loads((blank / "config.json").read_text())
    frontend = json.loads((DATA / "frontend_cases.json").read_text())
    assert max(frontend["special_token_ids"].values()) < config["vocab_size"]
    assert all(
        (blank / name).is_file() for name in ("vocab.json", "merges.txt", "tokenizer_config.json")
    )
