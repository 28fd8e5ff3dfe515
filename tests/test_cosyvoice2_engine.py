"""The CosyVoice2 engine: the tiny v2 model through its prepared files, the family picker, and
synthesis (streamed and whole) against the official orchestration's audio."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch

from engine.__main__ import main
from engine.cosyvoice2.model_dir import PARTS, CosyVoice2Models, load_model_dir
from engine.family import model_family
from engine.prepared import PREPARED_DIR, PreparedLoad, WeightFormats, prepare_model
from engine.quantize import Int8Linear
from engine.types import ModelLoadError

DATA = Path(__file__).parent / "data" / "cosyvoice2"
TINY = DATA / "tiny"
V1_TINY = Path(__file__).parent / "data" / "tiny_model"


@pytest.fixture(autouse=True)
def _one_thread(single_torch_thread: None) -> None:
    """Bit-stable sums, and no oversubscription of the shared cores."""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A writable copy of the tiny v2 model (its prepared files go beside it)."""
    target = tmp_path / "CosyVoice2-0.5B"
    shutil.copytree(TINY, target, ignore=shutil.ignore_patterns(PREPARED_DIR))
    return target


@pytest.fixture(scope="module")
def reference() -> CosyVoice2Models:
    return load_model_dir(TINY)


def _loaded(model_dir: Path, formats: WeightFormats) -> CosyVoice2Models:
    loading = PreparedLoad(model_dir, formats, model_dir.parent / "cache", PARTS)
    modules = loading.modules()
    loading.finish()
    return CosyVoice2Models.of(model_dir, loading.args, modules)


def _lm_logits(models: CosyVoice2Models, steps: list[int]) -> torch.Tensor:
    llm = models.llm
    with torch.inference_mode():
        cache = llm.new_cache(64)
        outs = [llm.prefill(llm.build_input([5, 9, 300, 7], [11, 12], [40, 41, 42]), cache)]
        outs += [llm.decode_step(token, cache) for token in steps]
    return torch.cat([out.logits for out in outs])


# --- prepared files ----------------------------------------------------------------------------


def test_prepared_models_equal_the_checkpoints(model: Path, reference: CosyVoice2Models) -> None:
    models = _loaded(model, WeightFormats())
    assert sorted(p.name for p in (model / PREPARED_DIR).iterdir()) == [
        "flow.fp32.safetensors",
        "hift.fp32.safetensors",
        "llm.fp32.safetensors",
    ]
    for part in ("llm", "flow", "hift"):
        got, want = getattr(models, part).state_dict(), getattr(reference, part).state_dict()
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key
    # The unused text head is not stored: it is the embedding again.
    head = models.llm.llm.model
    assert head.lm_head.weight is head.model.embed_tokens.weight


def test_prepared_int8_lm_equals_quantising_the_float_lm(
    model: Path, reference: CosyVoice2Models
) -> None:
    models = _loaded(model, WeightFormats(llm="int8"))
    block = models.llm.backbone.layers[0]
    assert isinstance(block.self_attn.qkv_proj, Int8Linear)
    assert isinstance(block.mlp.gate_up_proj, Int8Linear)
    assert not hasattr(block.self_attn, "q_proj") and not hasattr(block.mlp, "up_proj")
    quantised = copy.deepcopy(reference)
    quantised.llm.quantize_int8()
    steps = [3, 17, 6000, 3]
    torch.testing.assert_close(
        _lm_logits(models, steps), _lm_logits(quantised, steps), atol=0, rtol=0
    )


def test_prepare_command_prepares_a_cosyvoice2_directory(model: Path) -> None:
    assert main(["prepare", "--model-dir", str(model), "--lm", "int8", "--hift", "bf16"]) == 0
    assert sorted(p.name for p in (model / PREPARED_DIR).iterdir()) == [
        "flow.fp32.safetensors",
        "hift.bf16.safetensors",
        "llm.int8.safetensors",
    ]
    again = prepare_model(model, {"llm": ["int8"]}, parts=PARTS)
    assert [prepared_now for _, _, prepared_now in again] == [False]


def test_an_incomplete_directory_names_what_is_missing(model: Path) -> None:
    (model / "flow.pt").unlink()
    (model / "CosyVoice-BlankEN" / "merges.txt").unlink()
    with pytest.raises(ModelLoadError, match=r"missing flow\.pt, CosyVoice-BlankEN/merges\.txt"):
        PreparedLoad(model, WeightFormats(), None, PARTS)


def test_a_checkpoint_that_does_not_fit_names_its_keys(model: Path) -> None:
    state = torch.load(model / "flow.pt", weights_only=True)
    del state["encoder_proj.weight"]
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, model / "flow.pt")
    with pytest.raises(ModelLoadError, match=r"missing keys: encoder_proj\.weight.*extra\.weight"):
        PreparedLoad(model, WeightFormats(), None, PARTS)


# --- the family picker -------------------------------------------------------------------------


def test_the_family_is_picked_by_the_config_file(tmp_path: Path) -> None:
    assert model_family(TINY).name == "cosyvoice2"
    assert model_family(V1_TINY).name == "cosyvoice"
    (tmp_path / "cosyvoice3.yaml").write_text("{}")
    with pytest.raises(ModelLoadError, match="CosyVoice3 models .* not supported"):
        model_family(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        model_family(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="no cosyvoice.yaml or cosyvoice2.yaml"):
        model_family(DATA)
