"""CI's entry point and the lint script: what they run, in which order, and that a failure fails.

The real tools are replaced by stubs that record their call, so these tests run in milliseconds;
the checks themselves run in CI through script/lint.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

CI_RUN = ROOT / ".ci/run"
LINT = ROOT / "script/lint"


def readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"Run the tests:\s*```sh\n(.+?)\n```", readme)
    assert match, "README.md has no 'Run the tests:' block"
    return match.group(1).strip()


def stub(path: Path, name: str, exit_code: int = 0, fails_on: str | None = None) -> None:
    """An executable that appends its name and arguments to calls.log and exits with exit_code
    (given ``fails_on``: only when called with exactly those arguments, else 0)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ends = f"exit {exit_code}\n"
    if fails_on is not None:
        ends = f'[[ "$*" == "{fails_on}" ]] && exit {exit_code}\nexit 0\n'
    path.write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "$CALLS"\n{ends}', encoding="utf-8")
    path.chmod(0o755)


def run_script(
    tree: Path, script: str, stubs: dict[str, tuple[str, int] | tuple[str, int, str]]
) -> tuple[int, list[str], str]:
    """Copy ``script`` into ``tree``, stub the programs it calls (name, exit code and, if given,
    the arguments it fails on), run it as CI does (no stdin, CI=true); returns (exit code, the
    stubs called in order, stderr)."""
    target = tree / script
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(ROOT / script, target)
    for rel, (name, code, *fails_on) in stubs.items():
        stub(tree / rel, name, code, *fails_on)
    calls = tree / "calls.log"
    calls.touch()
    env = {**os.environ, "CI": "true", "CALLS": str(calls)}
    result = subprocess.run(
        [str(target)], stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=60
    )
    return result.returncode, calls.read_text().splitlines(), result.stderr


CI_STUBS: dict[str, tuple[str, int] | tuple[str, int, str]] = {
    "script/setup": ("setup", 0),
    "script/lint": ("lint", 0),
    "script/image-test": ("image-test", 0),
    ".venv/bin/python": ("py", 0),
}
LONG_TESTS = ".venv/bin/python -m pytest -m long"


def test_ci_runs_setup_lint_the_image_test_the_long_tests_then_exactly_the_readme_command(
) -> None:  # fmt: skip
    lines = [
        line
        for line in CI_RUN.read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert lines == [
        "./script/setup --test",
        "./script/lint",
        "./script/image-test",
        LONG_TESTS,
        readme_test_command(),
    ]


def pyproject() -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    return dict(tomllib.loads((ROOT / "pyproject.toml").read_text()))


def test_between_them_ci_runs_every_test_but_the_slow_and_soak_ones() -> None:
    """The default run deselects the long tests and CI runs them in a run of their own: a test
    marked long keeps running in CI, it only leaves the default run."""
    options = pyproject()["tool"]["pytest"]["ini_options"]
    default = re.search(r"-m '([^']*)'", options["addopts"])
    assert default and default.group(1) == "not slow and not soak and not long"
    assert any(marker.startswith("long: ") for marker in options["markers"])
    assert LONG_TESTS in CI_RUN.read_text().splitlines()


def test_ci_passes_when_lint_and_tests_pass(tmp_path: Path) -> None:
    code, calls, _ = run_script(tmp_path, ".ci/run", CI_STUBS)
    assert code == 0
    assert calls == [
        "setup --test",
        "lint ",
        "image-test ",
        "py -m pytest -m long",
        "setup --test",
        "py -m pytest",
    ]


def test_an_image_test_failure_fails_ci_before_the_tests(tmp_path: Path) -> None:
    stubs = {**CI_STUBS, "script/image-test": ("image-test", 1)}
    code, calls, _ = run_script(tmp_path, ".ci/run", stubs)
    assert code != 0
    assert not [call for call in calls if call.startswith("py ")]


def test_a_lint_failure_fails_ci_before_the_tests(tmp_path: Path) -> None:
    code, calls, _ = run_script(tmp_path, ".ci/run", {**CI_STUBS, "script/lint": ("lint", 1)})
    assert code != 0
    assert not [call for call in calls if call.startswith("py ")]


@pytest.mark.parametrize("pytest_exit", [1, 5])  # 5: no test collected
@pytest.mark.parametrize("run", ["-m pytest -m long", "-m pytest"], ids=["long", "default"])
def test_a_failure_or_empty_run_of_either_test_run_fails_ci(
    tmp_path: Path, pytest_exit: int, run: str
) -> None:
    stubs = {**CI_STUBS, ".venv/bin/python": ("py", pytest_exit, run)}
    code, calls, _ = run_script(tmp_path, ".ci/run", stubs)
    assert code == pytest_exit
    assert calls[-1] == f"py {run}"


LINT_STUBS = {
    ".venv/bin/ruff": ("ruff", 0),
    ".venv/bin/mypy": ("mypy", 0),
    ".venv/bin/lint-imports": ("lint-imports", 0),
}


def test_lint_runs_ruff_check_ruff_format_mypy_and_the_import_contracts(tmp_path: Path) -> None:
    code, calls, _ = run_script(tmp_path, "script/lint", LINT_STUBS)
    assert code == 0
    assert calls == [
        "ruff check .",
        "ruff format --check .",
        "mypy ",
        "lint-imports --no-cache --no-logo",
    ]


def test_lint_runs_every_check_and_fails_naming_the_failed_one(tmp_path: Path) -> None:
    code, calls, stderr = run_script(
        tmp_path, "script/lint", {**LINT_STUBS, ".venv/bin/ruff": ("ruff", 1)}
    )
    assert code == 1
    assert calls[-1] == "lint-imports --no-cache --no-logo"  # still ran after ruff failed
    assert "ruff check ." in stderr and "ruff format --check ." in stderr and "mypy" not in stderr


def test_lint_without_the_test_tools_says_how_to_install_them(tmp_path: Path) -> None:
    code, _, stderr = run_script(tmp_path, "script/lint", {".venv/bin/ruff": ("ruff", 0)})
    assert code != 0
    assert "script/setup --test" in stderr


def test_mypy_checks_both_packages_and_the_fake_engines() -> None:
    config = pyproject()["tool"]["mypy"]
    assert config["files"][:2] == ["engine", "wyoming_cosyvoice"]
    # the tests' fake engines, held to the engine surface as the engines are
    assert {"tests/fake_surface.py", "tests/conftest.py"} <= set(config["files"])


def test_ci_scripts_are_shellcheck_clean() -> None:
    shellcheck = Path(sys.executable).parent / "shellcheck"
    if not shellcheck.exists():
        pytest.fail("shellcheck not installed; run script/setup --test")
    scripts = [CI_RUN, LINT, ROOT / "script/setup"]
    result = subprocess.run(
        [str(shellcheck), "--severity=style", *map(str, scripts)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the test run's own packages --------------------------------------------------------------


def _test_requirements() -> list[Requirement]:
    """The ``test`` extra's requirements, with the project's own extras it names expanded."""
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    found: list[Requirement] = []
    pending = [Requirement(text) for text in extras["test"]]
    while pending:
        requirement = pending.pop(0)
        if canonicalize_name(requirement.name) == canonicalize_name(project["name"]):
            pending += [Requirement(text) for name in requirement.extras for text in extras[name]]
        else:
            found.append(requirement)
    return found


def test_every_package_of_the_test_extra_is_installed() -> None:
    """The tests import these packages instead of skipping without them: a broken install
    fails here by name (and where they are imported), never turns into skipped tests."""
    problems = []
    for requirement in _test_requirements():
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            problems.append(f"{requirement.name} {installed} is installed; {requirement} asked")
    assert not problems, "; ".join(problems) + " (run ./script/setup --test)"


def test_no_test_skips_on_a_package_the_test_extra_installs() -> None:
    wanted = {canonicalize_name(r.name) for r in _test_requirements()}
    skips = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for module in re.findall(r"importorskip\(\s*[\"']([\w.]+)", path.read_text()):
            top = module.split(".")[0]
            names = metadata.packages_distributions().get(top, [top])
            if wanted & {canonicalize_name(name) for name in names}:
                skips.append(f"{path.relative_to(ROOT)}: {module}")
    assert not skips, skips
