"""Model directory loading: config reading, full-size key manifest, clear errors on bad files."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import DATA

from engine.core.hparams import ModelConfigError, read_model_yaml
from engine.core.types import ModelLoadError
from engine.core.weights import read_state_dict
from engine.cosyvoice1.hparams import load_model_args
from engine.cosyvoice1.model_dir import load_model_dir, load_speakers

TINY = DATA / "tiny_model"


@pytest.fixture()
def model_copy(tmp_path: Path) -> Path:
    target = tmp_path / "CosyVoice-300M-SFT"
    shutil.copytree(TINY, target)
    for path in target.iterdir():
        path.chmod(0o644)
    return target


def test_yaml_tags_are_data_not_code() -> None:
    doc = read_model_yaml(TINY / "cosyvoice.yaml")
    assert doc["llm"].target == "cosyvoice.llm.llm.TransformerLM"
    assert doc["llm"].args["llm_input_size"] == 64  # !ref resolved
    # !apply:torch.manual_seed was read, not executed: the node is inert data.
    assert doc["__set_seed3"].kind == "apply"


def test_yaml_refuses_python_object_tags(tmp_path: Path) -> None:
    bad = tmp_path / "cosyvoice.yaml"
    bad.write_text("llm: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ModelConfigError, match="not valid YAML"):
        read_model_yaml(bad)


def test_full_size_config_numbers() -> None:
    args = load_model_args(DATA / "cosyvoice_300m.yaml")
    assert args.llm.llm.num_blocks == 14 and args.llm.llm.output_size == 1024
    assert args.llm.llm.activation == "relu" and args.llm.text_encoder.activation == "silu"
    assert args.llm.text_encoder.causal and args.llm.llm.causal and not args.flow.encoder.causal
    assert args.flow.estimator.channels == (256, 256) and args.flow.estimator.num_mid_blocks == 12
    assert args.flow.inference_cfg_rate == pytest.approx(0.7)
    assert args.hift.base_channels == 512 and args.hift.f0_cond_channels == 512


def _folded_manifest_keys(entries: list[dict]) -> dict[str, tuple[int, ...]]:
    """The manifest lists HiFT weight norm as original0/1; we fold them into '.weight'."""
    keys: dict[str, tuple[int, ...]] = {}
    for entry in entries:
        key = entry["key"]
        if key.endswith(".parametrizations.weight.original0"):
            continue
        key = key.replace(".parametrizations.weight.original1", ".weight")
        keys[key] = tuple(entry["shape"])
    return keys


def test_full_size_modules_match_manifest() -> None:
    from engine.core.hift import HiFTGenerator
    from engine.cosyvoice1.flow import FlowModel
    from engine.cosyvoice1.llm import TransformerLM

    manifest = json.loads((DATA / "manifest_300m.json").read_text())
    args = load_model_args(DATA / "cosyvoice_300m.yaml")
    with torch.device("meta"):  # no 1.7 GB allocation
        modules = {
            "llm": TransformerLM(args.llm),
            "flow": FlowModel(args.flow),
            "hift": HiFTGenerator(args.hift),
        }
    for name, module in modules.items():
        ours = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        expected = _folded_manifest_keys(manifest[name]["state_dict"])
        assert ours == expected, name


def test_tiny_model_loads_without_copies() -> None:
    models = load_model_dir(TINY)
    assert set(models.speakers) == {"中文女", "英文男"}
    assert models.speakers["中文女"].shape == (192,)
    assert not any(p.is_meta for p in models.llm.parameters())


def test_missing_file_is_named(model_copy: Path) -> None:
    (model_copy / "flow.pt").unlink()
    with pytest.raises(ModelLoadError, match=r"missing flow\.pt"):
        load_model_dir(model_copy)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_dir(tmp_path / "nope")


def test_truncated_checkpoint_is_named(model_copy: Path) -> None:
    path = model_copy / "llm.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"llm\.pt: truncated or corrupt"):
        load_model_dir(model_copy)


def test_wrong_shape_names_the_key(model_copy: Path) -> None:
    state = torch.load(model_copy / "flow.pt", weights_only=True)
    state["encoder_proj.weight"] = torch.zeros(3, 3)
    del state["encoder_proj.bias"]
    torch.save(state, model_copy / "flow.pt")
    with pytest.raises(ModelLoadError) as info:
        load_model_dir(model_copy)
    message = str(info.value)
    assert "flow.pt" in message and "encoder_proj.weight" in message
    assert "missing keys: encoder_proj.bias" in message


class _Payload:
    """Unpickling this would run code; weights_only loading must refuse it."""

    def __reduce__(self):
        return (os.system, ("touch /tmp/cosyvoice-pwned",))


def test_malicious_pickle_is_refused(model_copy: Path) -> None:
    marker = Path("/tmp/cosyvoice-pwned")
    marker.unlink(missing_ok=True)
    torch.save({"llm_decoder.weight": _Payload()}, model_copy / "llm.pt", pickle_module=pickle)
    with pytest.raises(ModelLoadError, match="refused to load"):
        load_model_dir(model_copy)
    assert not marker.exists()


def test_speaker_file_not_tensors(model_copy: Path) -> None:
    torch.save({"x": {"embedding": [1.0, 2.0]}}, model_copy / "spk2info.pt")
    with pytest.raises(ModelLoadError, match="spk2info.pt"):
        load_speakers(model_copy / "spk2info.pt")


def test_state_dict_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "x.pt"
    torch.save([torch.zeros(1)], path)
    with pytest.raises(ModelLoadError, match="expected a state dict"):
        read_state_dict(path)


def _hift_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    # Clone: the loaded tensors are memory-mapped views of the file we overwrite next.
    return {k: v.clone() for k, v in load_model_dir(model_dir).hift.state_dict().items()}


def test_both_weight_norm_layouts_give_identical_models(model_copy: Path) -> None:
    legacy = _hift_weights(model_copy)
    (model_copy / "hift.pt").unlink()
    shutil.copy(DATA / "hift_parametrized_keys.pt", model_copy / "hift.pt")
    modern = _hift_weights(model_copy)
    prefixed = {
        f"generator.{k}": v
        for k, v in torch.load(DATA / "hift_parametrized_keys.pt", weights_only=True).items()
    }
    (model_copy / "hift.pt").unlink()
    torch.save(prefixed, model_copy / "hift.pt")
    with_prefix = _hift_weights(model_copy)
    assert legacy.keys() == modern.keys() == with_prefix.keys()
    for key in legacy:
        assert torch.equal(legacy[key], modern[key]), key
        assert torch.equal(legacy[key], with_prefix[key]), key
