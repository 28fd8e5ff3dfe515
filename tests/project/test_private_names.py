"""No module of the product uses a private (``_name``) name of another of its modules: what one
module borrows from another is that module's public surface (the import contracts in
pyproject's [tool.importlinter] say which packages may import which)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import ROOT

PACKAGES = ("engine", "wyoming_cosyvoice")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_module(dotted: str) -> bool:
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _absolute(module: str | None, level: int, importer: str) -> str:
    """The dotted module a ``from`` import names, relative imports resolved."""
    if level == 0:
        return module or ""
    base = importer.split(".")[:-level]
    return ".".join([*base, module] if module else base)


def private_uses(source: str, importer: str) -> list[str]:
    """``module:name`` for each private name of another product module that ``source`` (the
    module ``importer``) imports or reads as an attribute of an imported module."""
    found = []
    modules: dict[str, str] = {}  # local name -> product module it is bound to
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = _absolute(node.module, node.level, importer)
            if module.split(".")[0] not in PACKAGES or module == importer:
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append(f"{module}:{alias.name}")
                elif _is_module(f"{module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES and alias.asname:
                    modules[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
            and _is_private(node.attr)
        ):
            found.append(f"{modules[node.value.id]}:{node.attr}")
    return found


def _product_modules() -> list[tuple[str, Path]]:
    modules = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules.append((dotted.removesuffix(".__init__"), path))
    return modules


def test_no_product_module_uses_a_private_name_of_another() -> None:
    offences = [
        f"{module} uses {use}"
        for module, path in _product_modules()
        for use in private_uses(path.read_text(encoding="utf-8"), module)
    ]
    assert not offences, "\n".join(offences)


@pytest.mark.parametrize(
    "source",
    [
        "from engine.core.transformer import _skew",
        "from .transformer import _skew",
        "from engine.core import transformer\ntransformer._skew(1, 2, 3)",
        "import engine.core.transformer as tf\ntf._skew(1, 2, 3)",
    ],
)
def test_the_check_sees_each_way_of_reaching_a_private_name(source: str) -> None:
    assert private_uses(source, "engine.core.other") == ["engine.core.transformer:_skew"]


def test_the_check_lets_public_names_and_own_privates_pass() -> None:
    source = "from engine.core.transformer import skew\nfrom engine.core.other import _own"
    assert private_uses(source, "engine.core.other") == []
