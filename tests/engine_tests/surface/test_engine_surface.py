"""The server uses the engine through its typed surface (engine.api) and the family facts of
engine.family: no ``getattr``/``hasattr`` probe of an engine, no check of a family's or a model
kind's name. The checks read the server's source (its syntax trees, so comments and docstrings
never count); each is shown to catch what it looks for."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest
from conftest import ROOT

from engine.api import Engine, PrimesVoices, SpeaksGrowingText, StreamGeometry, TakesVoices
from engine.cosyvoice1.engine import STREAM_GEOMETRY, CosyVoiceEngine
from engine.cosyvoice2.engine import ChunkedStreamGeometry, CosyVoice2Engine
from engine.cosyvoice3.engine import CosyVoice3Engine
from engine.family import FAMILIES, family_named, model_family

SERVER = ROOT / "wyoming_cosyvoice"
DATA = ROOT / "tests" / "data"

# What an engine object answers to: a probe for any of these names is a probe of the engine.
ENGINE_NAMES = {
    name
    for cls in (
        Engine,
        SpeaksGrowingText,
        PrimesVoices,
        TakesVoices,
        CosyVoiceEngine,
        CosyVoice2Engine,
    )  # fmt: skip
    for name in [*vars(cls), *getattr(cls, "__annotations__", {})]
    if not name.startswith("__")
}
# The names a family or a model kind goes by.
FAMILY_WORDS = {family.name for family in FAMILIES} | {
    kind
    for family in FAMILIES
    for kind in (*family.instruct_kinds, family.kind, "sft", "base")
    if kind is not None
}


def engine_probes(source: str) -> list[str]:
    """``getattr``/``hasattr`` calls on an engine: the object's expression names an engine, or
    the attribute asked for is one an engine has."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if node.func.id not in ("getattr", "hasattr") or len(node.args) < 2:
            continue
        target, name = node.args[0], node.args[1]
        asked = name.value if isinstance(name, ast.Constant) else None
        if "engine" in ast.unparse(target).lower() or asked in ENGINE_NAMES:
            found.append(ast.unparse(node))
    return found


def family_checks(source: str) -> list[str]:
    """Comparisons with, membership tests of, lookups by and table keys of a family's or a
    model kind's name."""
    found = []

    def named(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value in FAMILY_WORDS

    def holds_one(node: ast.AST) -> bool:
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(map(named, node.elts))

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(named(side) or holds_one(side) for side in sides):
                found.append(ast.unparse(node))
        elif isinstance(node, ast.Subscript) and named(node.slice):
            found.append(ast.unparse(node))
        elif isinstance(node, ast.Dict) and any(named(key) for key in node.keys):
            found.append(ast.unparse(node)[:80])
    return found


def _server_sources() -> list[Path]:
    return sorted(SERVER.rglob("*.py"))


def test_the_checks_find_what_they_look_for() -> None:
    probes = """
getattr(engine, "kind", None)
hasattr(scheduler.engine, "enable_custom_voices")
callable(getattr(thing, "synthesize_growing", None))
getattr(args, "threads")
"""
    assert engine_probes(probes) == [
        "getattr(engine, 'kind', None)",
        "hasattr(scheduler.engine, 'enable_custom_voices')",
        "getattr(thing, 'synthesize_growing', None)",
    ]
    checks = """
if family == "cosyvoice2": pass
if kind in ("instruct", "cosyvoice2"): pass
rate = SAMPLE_RATES["cosyvoice"]
RATES = {"cosyvoice": 22050}
PROGRAM_NAME = "cosyvoice"
"""
    assert len(family_checks(checks)) == 4


@pytest.mark.parametrize("path", _server_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_never_probes_the_engine(path: Path) -> None:
    assert engine_probes(path.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("path", _server_sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_checks_no_family_name(path: Path) -> None:
    assert family_checks(path.read_text(encoding="utf-8")) == []


def test_each_engine_declares_its_capabilities() -> None:
    assert not issubclass(CosyVoiceEngine, (SpeaksGrowingText, PrimesVoices, TakesVoices))
    assert issubclass(CosyVoice2Engine, SpeaksGrowingText)
    assert issubclass(CosyVoice2Engine, PrimesVoices)
    assert issubclass(CosyVoice2Engine, TakesVoices)
    assert issubclass(CosyVoice3Engine, (SpeaksGrowingText, PrimesVoices, TakesVoices))


def test_each_family_names_its_engine_and_the_engine_its_family() -> None:
    for family in FAMILIES:
        assert family.engine_class().family is family


@pytest.mark.parametrize(
    ("tiny", "name", "geometry_type"),
    [
        ("tiny_model", "CosyVoice-300M-Instruct", type(STREAM_GEOMETRY)),
        ("cosyvoice2/tiny", "CosyVoice2-0.5B", ChunkedStreamGeometry),
        ("cosyvoice3/tiny", "Fun-CosyVoice3-0.5B", ChunkedStreamGeometry),
    ],
)
def test_a_loaded_engine_says_what_its_family_said_before_the_load(
    tmp_path: Path, tiny: str, name: str, geometry_type: type[StreamGeometry]
) -> None:
    """The rate, kind and instruction form the server uses before the load (engine.family)
    are the loaded engine's."""
    from engine.family import load_engine

    model_dir = tmp_path / name  # the directory's name tells v1's kind
    shutil.copytree(DATA / tiny, model_dir, ignore=shutil.ignore_patterns("prepared"))
    family = model_family(model_dir)
    engine: Engine = load_engine(model_dir, threads=1)
    assert engine.sample_rate == family.sample_rate
    assert engine.kind == family.kind_of(model_dir)
    assert engine.instruction_form == family.instruction_form_of(engine.kind) is not None
    assert isinstance(engine.stream_geometry, geometry_type)
    assert engine.stream_geometry.token_rate == family.token_rate


def test_the_instruct_models_are_the_ones_that_read_instructions() -> None:
    v1, v2 = family_named("cosyvoice"), family_named("cosyvoice2")
    assert v1.instruction_form_of(v1.kind_of(Path("CosyVoice-300M-SFT"))) is None
    assert v1.instruction_form_of(v1.kind_of(Path("CosyVoice-300M-Instruct"))) is not None
    assert v2.instruction_form_of(v2.kind_of(Path("anything"))) is not None
