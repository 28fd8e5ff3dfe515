"""Where the test extra's command-line linters are, for tests that run them."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest


def tool(name: str) -> str:
    """The venv's ``name`` (else the one on PATH); fails the test when it is not installed."""
    path = Path(sys.executable).parent / name
    found = str(path) if path.exists() else shutil.which(name)
    if not found:
        pytest.fail(f"{name} not installed; run script/setup --test")
    return found
