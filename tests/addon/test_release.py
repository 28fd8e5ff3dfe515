"""Release engineering: one version, the image built from the checkout, the release workflow.

The image build and the workflow are checked on paper here (script/image-test builds and runs
the image where a Docker engine can be had): the version in every file follows pyproject.toml,
the Dockerfile installs the checkout (not a download) with torch's CPU build from where its
build arguments say, the build context admits what the Dockerfile copies, the workflow passes
GitHub's schema and shellcheck and publishes where the Supervisor pulls. The smoke test that
script/image-test runs inside each image (script/smoke-test) runs here against this install.
Last, what a newcomer reads first: the README's commands and the way into Home Assistant.
"""

from __future__ import annotations

import fnmatch
import importlib.machinery
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import pytest
import yaml
from conftest import ROOT
from lint_tools import tool

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ADDON = ROOT / "addon"
DOCKERFILE = ADDON / "Dockerfile"
DOCKERIGNORE = ADDON / "Dockerfile.dockerignore"
WORKFLOW = ROOT / ".github/workflows/release.yaml"
SMOKE_TEST = ROOT / "script/smoke-test"
IMAGE_TEST = ROOT / "script/image-test"
TINY_MODEL = ROOT / "tests/data/tiny_model"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def dockerfile_instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = DOCKERFILE.read_text()
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return [i.strip() for i in re.split(r"\n(?=\S)", "\n".join(lines).replace("\\\n", " ")) if i]


def dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE.read_text(), re.M)
    assert match, f"no ARG {name}=... in addon/Dockerfile"
    return match.group(1)


# --- one version -----------------------------------------------------------------------------


def newest_changelog_version() -> str:
    match = re.search(r"^## (\S+)", (ADDON / "CHANGELOG.md").read_text(), re.M)
    assert match, "addon/CHANGELOG.md has no '## <version>' entry"
    return match.group(1)


def test_every_copy_of_the_version_follows_pyproject() -> None:
    version = pyproject()["project"]["version"]
    copies = {
        "addon/config.yaml version": load_yaml(ADDON / "config.yaml")["version"],
        "addon/build.yaml args.WYOMING_COSYVOICE_VERSION": load_yaml(ADDON / "build.yaml")["args"][
            "WYOMING_COSYVOICE_VERSION"
        ],
        "addon/Dockerfile ARG WYOMING_COSYVOICE_VERSION": dockerfile_arg(
            "WYOMING_COSYVOICE_VERSION"
        ),
        "addon/CHANGELOG.md newest entry": newest_changelog_version(),
    }
    assert {where: v for where, v in copies.items() if v != version} == {}, (
        f"pyproject.toml says {version}"
    )


def test_torch_pin_is_the_same_everywhere() -> None:
    pin = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch=="))
    torch_version = pin.removeprefix("torch==")
    assert dockerfile_arg("TORCH_VERSION") == torch_version
    assert load_yaml(ADDON / "build.yaml")["args"]["TORCH_VERSION"] == torch_version


def test_version_is_a_plain_release_number() -> None:
    """The tag is v<version> and the image tag <version>: no local parts or spaces."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", pyproject()["project"]["version"])


def test_release_tags_start_the_workflow() -> None:
    version = pyproject()["project"]["version"]
    patterns = load_yaml(WORKFLOW)["on"]["push"]["tags"]
    assert any(fnmatch.fnmatchcase(f"v{version}", p) for p in patterns)


# --- the image -------------------------------------------------------------------------------


def test_image_is_published_where_the_supervisor_pulls() -> None:
    """`image:` names the repository owner's ghcr.io namespace: the only one the workflow's
    token can push to. {arch} is filled in by the Supervisor and by the workflow's matrix."""
    image = load_yaml(ADDON / "config.yaml")["image"]
    owner = load_yaml(ROOT / "repository.yaml")["url"].rstrip("/").split("/")[-2]
    assert re.fullmatch(rf"ghcr\.io/{re.escape(owner.lower())}/\{{arch\}}-[a-z0-9-]+", image)


def package_copies() -> dict[str, str]:
    """COPY source → destination for every COPY in the Dockerfile."""
    copies = {}
    for instruction in dockerfile_instructions():
        if instruction.startswith("COPY "):
            *sources, dest = instruction.split()[1:]
            copies.update({source: dest for source in sources})
    return copies


def test_dockerfile_installs_the_checkout() -> None:
    text = DOCKERFILE.read_text()
    assert "archive/refs" not in text and "git+" not in text  # no download of a tag
    copies = package_copies()
    packages = [
        p.rstrip("*") for p in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]
    ]
    needed = ["pyproject.toml", "setup.py", pyproject()["project"]["readme"], *packages]
    missing = [source for source in needed if source not in copies]
    assert missing == [], "the package build needs these in the image"
    package_dir = copies["pyproject.toml"].rstrip("/")
    for package in packages:
        assert copies[package].rstrip("/") == f"{package_dir}/{package}"
    install = next(i for i in dockerfile_instructions() if f'"{package_dir}[' in i)
    # Built against the torch installed before it (setup.py compiles the int8 kernel on x86-64).
    assert "pip install --no-build-isolation" in install
    assert copies["addon/rootfs"] == "/"


def test_torch_comes_from_the_cpu_index_before_the_package() -> None:
    instructions = dockerfile_instructions()
    torch_install = next(
        i for i, text in enumerate(instructions) if '"torch==${TORCH_VERSION}"' in text
    )
    assert '--index-url "${TORCH_INDEX}"' in instructions[torch_install]
    assert dockerfile_arg("TORCH_INDEX") == CPU_INDEX
    first_copy = next(i for i, text in enumerate(instructions) if text.startswith("COPY "))
    assert torch_install < first_copy, "torch must be installed before the package resolves"


def test_where_torch_comes_from_is_a_build_argument() -> None:
    """The index, and wheels mounted only while torch installs (never in a layer): the stage
    `torch-wheels`, empty unless TORCH_WHEELS_FROM or `--build-context torch-wheels=DIR`."""
    instructions = dockerfile_instructions()
    assert dockerfile_arg("TORCH_WHEELS_FROM") == "scratch"
    assert "FROM ${TORCH_WHEELS_FROM} AS torch-wheels" in instructions
    torch_install = next(i for i in instructions if '"torch==${TORCH_VERSION}"' in i)
    mount = re.search(r"--mount=type=bind,from=torch-wheels,target=(\S+)", torch_install)
    assert mount and f"--find-links {mount.group(1)}" in torch_install
    package_install = next(i for i in instructions if "/usr/src/wyoming-cosyvoice[" in i)
    assert '--extra-index-url "${TORCH_INDEX}"' in package_install
    # The index is written once, as the argument's default.
    assert DOCKERFILE.read_text().count(CPU_INDEX) == 1


def test_the_legacy_builder_stops_before_any_work() -> None:
    """Only BuildKit reads Dockerfile.dockerignore (without it the context is the whole
    checkout); the legacy builder refuses `RUN --mount` ("requires BuildKit"), so the first RUN
    has one and no step runs before it."""
    runs = [i for i in dockerfile_instructions() if i.startswith("RUN ")]
    assert runs[0].startswith("RUN --mount=")
    assert DOCKERIGNORE.is_file()
    assert "BuildKit" in DOCKERFILE.read_text().split("\nFROM")[0]  # said at the top


def test_image_keeps_openmps_default_wait_policy() -> None:
    """The benchmark's figures are OpenMP's default: PASSIVE doubled an LM step."""
    env = " ".join(i for i in dockerfile_instructions() if i.startswith("ENV "))
    assert "OMP_WAIT_POLICY" not in env


def test_image_is_labelled_an_addon() -> None:
    labels = " ".join(i for i in dockerfile_instructions() if i.startswith("LABEL "))
    assert 'io.hass.type="addon"' in labels


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for a .dockerignore: the last pattern matching the path (or a folder above
    it; with **/, any part of it) decides, and '!' takes the path back in."""
    verdict = False
    parts = path.split("/")
    folders = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    for pattern in patterns:
        bare = pattern.lstrip("!").rstrip("/")
        candidates = folders + parts if bare.startswith("**/") else folders
        if any(fnmatch.fnmatchcase(c, bare.removeprefix("**/")) for c in candidates):
            verdict = not pattern.startswith("!")
    return verdict


def tracked_files(source: str) -> list[str]:
    """What a clean checkout has under a path (what the workflow's build context holds)."""
    listed = subprocess.run(
        ["git", "ls-files", "--", source], capture_output=True, text=True, cwd=ROOT, check=True
    )
    return listed.stdout.split()


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_build_context_admits_what_the_dockerfile_copies() -> None:
    """A COPY of a path the ignore file leaves out fails the build ("not found")."""
    patterns = dockerignore_patterns()
    copied = [path for source in package_copies() for path in tracked_files(source)]
    assert len(copied) > 10
    assert [path for path in copied if ignored(path, patterns)] == []
    left_out = [
        ".venv/bin/python",
        "data/CosyVoice-300M-SFT/llm.pt",
        ".git/HEAD",
        "engine/__pycache__/engine.cpython-311.pyc",
        "tests/data/tiny_model/llm.pt",
    ]
    assert [path for path in left_out if not ignored(path, patterns)] == []


LOCAL_ADDON = ROOT / "script/local-addon"


def test_a_local_addon_folder_holds_what_the_supervisor_needs_to_build_it(tmp_path: Path) -> None:
    """Before the first release, or for a version of one's own: the Supervisor builds a local
    add-on (no `image:`) with its folder as the context, so the folder must hold what the
    Dockerfile copies, admitted by the ignore file beside it."""
    from test_addon import schema_errors

    dest = tmp_path / "addons/cosyvoice"
    made = subprocess.run([sys.executable, str(LOCAL_ADDON), str(dest)],
                          capture_output=True, text=True)  # fmt: skip
    assert made.returncode == 0, made.stderr
    manifest = load_yaml(dest / "config.yaml")
    assert "image" not in manifest
    assert manifest == {k: v for k, v in load_yaml(ADDON / "config.yaml").items() if k != "image"}
    assert schema_errors("config.schema.json", manifest) == []
    assert (dest / "build.yaml").read_text() == (ADDON / "build.yaml").read_text()
    assert (dest / "Dockerfile").read_text() == DOCKERFILE.read_text()
    # The add-on's README is the store's description and the package's readme.
    assert (dest / "README.md").read_text() == (ADDON / "README.md").read_text()
    patterns = [line.strip() for line in (dest / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]  # fmt: skip
    copied = [path for source in package_copies() for path in tracked_files(source)]
    assert "addon/rootfs/usr/local/bin/cosyvoice-healthcheck" in copied
    missing = [path for path in copied if not (dest / path).is_file()]
    assert missing == [] and [path for path in copied if ignored(path, patterns)] == []
    assert not list(dest.rglob("__pycache__"))
    again = subprocess.run([sys.executable, str(LOCAL_ADDON), str(dest)],
                           capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 2 and "not empty" in again.stderr


# --- the workflow ----------------------------------------------------------------------------


def check_workflow_schema(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(path)],
        capture_output=True,
        text=True,
    )


def test_workflow_matches_githubs_schema(tmp_path: Path) -> None:
    result = check_workflow_schema(WORKFLOW)
    assert result.returncode == 0, result.stdout + result.stderr
    broken = tmp_path / "broken.yaml"  # the check is not one that accepts anything
    broken.write_text(WORKFLOW.read_text().replace("runs-on:", "run-on:", 1))
    assert check_workflow_schema(broken).returncode != 0


def workflow_steps() -> list[dict[str, Any]]:
    return [step for job in load_yaml(WORKFLOW)["jobs"].values() for step in job.get("steps", [])]


def test_workflow_run_scripts_pass_shellcheck(tmp_path: Path) -> None:
    scripts = []
    for number, step in enumerate(s for s in workflow_steps() if "run" in s):
        # GitHub substitutes ${{ … }} before bash runs; a plain word stands in for it here.
        body = re.sub(r"\$\{\{.*?\}\}", "EXPRESSION", step["run"])
        script = tmp_path / f"step{number}.sh"
        script.write_text("#!/usr/bin/env bash\nset -eo pipefail\n" + body)
        scripts.append(str(script))
    assert scripts
    result = subprocess.run(
        [tool("shellcheck"), "--severity=style", *scripts], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_workflow_actions_are_pinned_to_commits() -> None:
    """A tag can be moved to other code; a commit cannot."""
    uses = [step["uses"] for step in workflow_steps() if "uses" in step]
    assert uses
    assert [u for u in uses if not re.fullmatch(r"[\w.-]+/[\w./-]+@[0-9a-f]{40}", u)] == []


def test_workflow_runs_the_image_through_its_entry_point() -> None:
    """The build job tests each image with script/image-test (no --entrypoint override)."""
    runs = [step["run"] for step in workflow_steps() if "run" in step]
    assert 'python3 script/image-test --image "$CANDIDATE"' in runs
    assert not [run for run in runs if "--entrypoint" in run]
    paths = load_yaml(WORKFLOW)["on"]["pull_request"]["paths"]
    image_test = script_module(IMAGE_TEST, "image_test")
    for used in (IMAGE_TEST, image_test.SMOKE_TEST, image_test.STAND_IN, image_test.TINY_MODEL):
        assert used.exists(), used
        relative = used.relative_to(ROOT).as_posix()
        assert any(fnmatch.fnmatchcase(relative, p) or relative + "/**" == p for p in paths), (
            f"a change to {relative} does not start the workflow"
        )


def test_workflow_yaml_passes_yamllint() -> None:
    # 130: a pinned action (owner/repo/path@<40-hex commit>  # <version>) does not fit in 100.
    rules = "{extends: default, rules: {line-length: {max: 130}}}"
    result = subprocess.run(
        [tool("yamllint"), "--strict", "-d", rules, str(ROOT / ".github")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the smoke test the workflow runs inside each image ----------------------------------------


def script_module(path: Path = SMOKE_TEST, name: str = "smoke_test") -> ModuleType:
    """A script of script/ (no .py suffix) loaded as a module."""
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


def test_smoke_test_refuses_a_cuda_build_of_torch() -> None:
    smoke = script_module()
    assert smoke.cuda_build_problems(None, ["torch", "numpy", "onnxruntime"]) == []
    problems = smoke.cuda_build_problems("13.0", ["torch", "nvidia-cublas-cu13", "triton"])
    assert problems == [
        "torch is built for CUDA 13.0",
        "CUDA-only packages installed: nvidia-cublas-cu13, triton",
    ]
    assert smoke.cuda_build_problems(None, ["NVIDIA-NCCL-cu13"]) != []


def run_smoke_test(model_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SMOKE_TEST), "--model-dir", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )


@pytest.mark.long
def test_smoke_test_passes_on_this_install() -> None:
    result = run_smoke_test(TINY_MODEL)
    assert result.returncode == 0, result.stdout + result.stderr
    for step in ("CPU build", "describe:", "synthesize:", "healthcheck: healthy"):
        assert step in result.stdout, step


@pytest.mark.long
def test_smoke_test_fails_on_a_model_that_cannot_load(tmp_path: Path) -> None:
    broken = tmp_path / "model"
    shutil.copytree(TINY_MODEL, broken)
    (broken / "llm.pt").write_bytes(b"not a checkpoint")
    result = run_smoke_test(broken)
    assert result.returncode == 1
    assert "smoke test FAILED" in result.stderr and "server log" in result.stderr


# --- what a newcomer reads: the README's commands, the Home Assistant navigation ---------------

REPOSITORY_URL = load_yaml(ROOT / "repository.yaml")["url"]
NAVIGATION_DOCS = ["README.md", "addon/DOCS.md", "addon/README.md", "docs/addon-repository.md"]


def readme_command_blocks() -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```", (ROOT / "README.md").read_text(), re.M | re.S)


def test_readme_has_one_server_block_and_the_test_command_ci_runs() -> None:
    ci_command = (ROOT / ".ci/run").read_text().strip().splitlines()[-1]
    blocks = readme_command_blocks()
    assert len(blocks) == 2
    assert blocks[1].strip() == ci_command


def test_readme_says_how_to_try_the_tiny_model_on_this_machine_only() -> None:
    """The row's command parses with the server's own parser, names the tiny model and binds
    127.0.0.1 only, for Wyoming and HTTP."""
    from wyoming_cosyvoice.__main__ import build_parser

    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if "tests/data/tiny_model" in line)
    command = re.search(r"`\.venv/bin/wyoming-cosyvoice ([^`]+)`", row)
    assert command, row
    args = build_parser().parse_args(command.group(1).split())
    assert (ROOT / str(args.model_dir)).resolve() == TINY_MODEL
    assert args.uri.startswith("tcp://127.0.0.1:") and args.http_host == "127.0.0.1"
    assert f"127.0.0.1:{args.http_port}/tts" in row and "noise" in row
    assert "0.0.0.0" in readme and "tcp://127.0.0.1:10200" in readme.split("## Home")[0]


def test_readme_says_setup_installs_chromium_as_root() -> None:
    readme = (ROOT / "README.md").read_text()
    setup = (ROOT / "script/setup").read_text()
    assert "apt-get install" in setup and "chromium" in setup  # what the README describes
    assert re.search(r"root.*Chromium|Chromium.*root", readme.replace("\n", " "))


@pytest.mark.parametrize("doc", NAVIGATION_DOCS)
def test_docs_give_both_navigations_and_the_add_repository_link(doc: str) -> None:
    text = (ROOT / doc).read_text().replace("\n", " ")
    link = (
        "https://my.home-assistant.io/redirect/supervisor_add_addon_repository/"
        f"?repository_url={quote(REPOSITORY_URL, safe='')}"
    )
    assert link in text
    assert "Settings → Apps → Install app" in text
    assert "Settings → Add-ons → Add-on store" in text


def test_the_docs_say_how_to_install_before_the_first_release() -> None:
    """`image:` names an image that exists only once a release is published: where a user looks
    first (the README's Home Assistant section, DOCS' Installation) says so and gives the
    local add-on, and the maintainer's steps are in docs/dev/release.md."""
    readme = (ROOT / "README.md").read_text().split("## Home Assistant")[1].split("\n## ")[0]
    docs = (ADDON / "DOCS.md").read_text().split("## Installation")[1].split("\n## ")[0]
    release = (ROOT / "docs/dev/release.md").read_text()
    for text in (readme, docs):
        flat = text.replace("\n", " ")
        assert "first release" in flat and "script/local-addon" in flat and "Local add-ons" in flat
    assert "docs/dev/release.md" in readme
    assert "## Before the first release" in release and "script/local-addon" in release


def test_the_image_test_catches_a_log_that_claims_a_refused_discovery() -> None:
    """script/image-test's discovery check, on recorded requests and logs: it fails when the
    log says "sent" after a refusal (the s6 script's fault), a wrong token, or no request."""
    image_test = script_module(IMAGE_TEST, "image_test")
    body = json.dumps({"service": "wyoming", "config": {"uri": "tcp://h:10200"}})
    token = {"authorization": f"Bearer {image_test.TOKEN}"}

    class Recorded:
        addon = "addon"

        def __init__(self, requests: list[dict[str, Any]], log: str) -> None:
            self.requests, self.docker = requests, type("Logs", (), {"logs": lambda _, c: log})()

        def discovery_requests(self) -> list[dict[str, Any]]:
            return self.requests

    def check(status: int, headers: dict[str, str], log: str, accepted: bool) -> str:
        request = {"path": "/discovery", "body": body, "headers": headers, "status": status}
        return image_test.check_discovery(Recorded([request], log), "h", accepted)

    assert "200" in check(200, token, image_test.SENT, accepted=True)
    assert "500" in check(500, token, image_test.NOT_TOLD, accepted=False)
    for status, headers, log, accepted in [
        (500, token, f"ERROR … {image_test.SENT}", False),  # claims success after a refusal
        (200, {}, image_test.SENT, True),  # no token
        (200, token, image_test.NOT_TOLD, True),
    ]:
        with pytest.raises(image_test.ImageTestFailed):
            check(status, headers, log, accepted)
    with pytest.raises(image_test.ImageTestFailed, match="got 0 requests"):
        image_test.check_discovery(Recorded([], image_test.SENT), "h", True)
