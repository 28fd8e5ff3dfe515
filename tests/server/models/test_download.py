"""Model lookup and download against a local stand-in for the Hugging Face hub.

The stand-in speaks the hub's URL scheme: ``HEAD/GET {endpoint}/{repo}/resolve/{rev}/{file}``
answered with ``X-Repo-Commit`` and an ``ETag`` (the git blob SHA-1 for small files); large
(LFS) files are redirected to a "CDN" on another host name with ``X-Linked-Etag`` (their
SHA-256) and ``X-Linked-Size``, as huggingface.co does. The CDN honours ``Range``. Knobs cut a
file's responses short or corrupt it, and every request is logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from engine.family import family_named
from wyoming_cosyvoice.models.download import (
    DownloadError,
    ModelNotFoundError,
    download_model,
    ensure_model,
    find_model,
)

V1, V2, V3 = family_named("cosyvoice"), family_named("cosyvoice2"), family_named("cosyvoice3")
MODEL_FILES, VOICE_FILES = V1.model_files, V1.prompt_model_files
MODEL_FILES_V2, VOICE_FILES_V2 = V2.model_files, V2.prompt_model_files

TINY = ROOT / "tests" / "data" / "tiny_model"
TINY_V2 = ROOT / "tests" / "data" / "cosyvoice2" / "tiny"
TINY_V3 = ROOT / "tests" / "data" / "cosyvoice3" / "tiny"
ONNX = ROOT / "tests" / "data" / "zero_shot" / "onnx"
REPO = "FunAudioLLM/CosyVoice-300M-SFT"
REPO_V2 = "FunAudioLLM/CosyVoice2-0.5B"
NAME_V2 = "CosyVoice2-0.5B"
NAME_V3 = "Fun-CosyVoice3-0.5B"
NAME = "CosyVoice-300M-SFT"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self, files: dict[str, bytes], repo: str = REPO) -> None:
        self.files = files
        self.repo = repo
        self.cut_after: dict[str, int] = {}  # file -> bytes sent per response before hanging up
        self.corrupt: set[str] = set()
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range)
        self.port = 0

    @staticmethod
    def is_lfs(name: str) -> bool:
        return name.endswith((".pt", ".onnx"))

    def etag(self, name: str) -> str:
        data = self.files[name]
        if self.is_lfs(name):
            return hashlib.sha256(data).hexdigest()
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def make_handler(hub: Hub) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self.answer(body=False)

        def do_GET(self) -> None:
            self.answer(body=True)

        def answer(self, body: bool) -> None:
            hub.requests.append((self.command, self.path, self.headers.get("Range")))
            prefix = f"/{hub.repo}/resolve/main/"
            if self.path.startswith(prefix):
                name = self.path[len(prefix) :]
                if name not in hub.files:
                    self.send_response(404)
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("X-Error-Code", "EntryNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if hub.is_lfs(name):  # LFS: metadata here, bytes on the CDN
                    self.send_response(302)
                    self.send_header("Location", f"http://localhost:{hub.port}/cdn/{name}")
                    self.send_header("X-Repo-Commit", COMMIT)
                    self.send_header("X-Linked-Etag", f'"{hub.etag(name)}"')
                    self.send_header("X-Linked-Size", str(len(hub.files[name])))
                    self.send_header("ETag", '"not-the-content-hash"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.content(name, body, {"X-Repo-Commit": COMMIT, "ETag": f'"{hub.etag(name)}"'})
            elif self.path.startswith("/cdn/"):
                self.content(self.path[5:], body, {})
            else:
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        def content(self, name: str, body: bool, headers: dict[str, str]) -> None:
            data = hub.files[name]
            if name in hub.corrupt:
                data = bytes(b ^ 0xFF for b in data)
            start, status = 0, 200
            if (rng := self.headers.get("Range")) and rng.startswith("bytes="):
                start, status = int(rng[6:].split("-")[0]), 206
            part = data[start:]
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(len(part)))
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            cut = hub.cut_after.get(name)
            if cut is not None and cut < len(part):
                self.wfile.write(part[:cut])
                self.wfile.flush()
                self.close_connection = True  # hang up mid-file, like a dropped connection
                return
            self.wfile.write(part)

    return Handler


@pytest.fixture
def hub() -> Iterator[Hub]:
    files = {name: (TINY / name).read_bytes() for name in MODEL_FILES}
    files["README.md"] = b"not needed"
    yield from serve(Hub(files))


def repository_files(tiny: Path, voice_files: tuple[str, ...]) -> dict[str, bytes]:
    """A tiny Qwen2-family model as its repository holds it: every file, needed or not, and
    stand-ins of its prompt models (the v2 speech tokenizer's for every family's)."""
    files = {
        path.relative_to(tiny).as_posix(): path.read_bytes()
        for path in tiny.rglob("*")
        if path.is_file() and "prepared" not in path.parts
    }
    files["campplus.onnx"] = (ONNX / "tiny_campplus.onnx").read_bytes()
    for name in voice_files:
        if name.startswith("speech_tokenizer"):
            files[name] = (ONNX / "tiny_speech_tokenizer_v2.onnx").read_bytes()
    files["README.md"] = b"not needed"
    return files


@pytest.fixture
def hub_v2() -> Iterator[Hub]:
    """The tiny CosyVoice2 model as its repository holds it."""
    yield from serve(Hub(repository_files(TINY_V2, VOICE_FILES_V2), REPO_V2))


# The tiny stand-in of CosyVoice3's RL-tuned LM: bytes of its own (the engine's tests load one).
RL_LM_BYTES = b"a tiny stand-in of llm.rl.pt"


@pytest.fixture
def hub_v3() -> Iterator[Hub]:
    """The tiny CosyVoice3 model as its repository holds it, with an RL-tuned LM."""
    files = repository_files(TINY_V3, V3.prompt_model_files)
    assert V3.rl_lm_file is not None
    files[V3.rl_lm_file] = RL_LM_BYTES
    yield from serve(Hub(files, V3.models[NAME_V3]))


def serve(hub: Hub) -> Iterator[Hub]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), make_handler(hub))
    hub.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield hub
    server.shutdown()
    server.server_close()


def endpoint(hub: Hub) -> str:
    return f"http://127.0.0.1:{hub.port}"


def assert_same_as_tiny(model_dir: Path) -> None:
    for name in MODEL_FILES:
        assert (model_dir / name).read_bytes() == (TINY / name).read_bytes(), name
    assert sorted(p.name for p in model_dir.iterdir()) == sorted(MODEL_FILES)


def test_download_fetches_only_the_needed_files(
    hub: Hub, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    path = ensure_model(NAME, (tmp_path,), tmp_path, endpoint=endpoint(hub))
    assert path == tmp_path / NAME
    assert_same_as_tiny(path)
    assert not (tmp_path / f"{NAME}.partial").exists()
    fetched = {p.rsplit("/", 1)[-1] for m, p, _ in hub.requests if m == "GET"}
    assert fetched == set(MODEL_FILES)  # README.md and the ONNX files are not needed
    assert "llm.pt: 100%" in caplog.text and "verified" in caplog.text  # progress in the log
    # found next time, without asking the hub
    hub.requests.clear()
    assert ensure_model(NAME, (tmp_path,), tmp_path, endpoint=endpoint(hub)) == path
    assert hub.requests == []


def test_interrupted_download_resumes_and_never_looks_complete(hub: Hub, tmp_path: Path) -> None:
    hub.cut_after["llm.pt"] = 1_000_000  # every response for llm.pt hangs up after 1 MB
    with pytest.raises(ModelNotFoundError, match="start again to resume"):
        ensure_model(NAME, (tmp_path,), tmp_path, endpoint=endpoint(hub), attempts=2)
    partial = tmp_path / f"{NAME}.partial"
    assert not (tmp_path / NAME).exists()
    assert find_model(NAME, (tmp_path,), MODEL_FILES) is None
    kept = (partial / "llm.pt.incomplete").stat().st_size
    assert kept == 2_000_000  # two attempts, the second resumed after the first
    assert (partial / "cosyvoice.yaml").is_file()  # finished files are kept too

    hub.cut_after.clear()
    hub.requests.clear()
    path = ensure_model(NAME, (tmp_path,), tmp_path, endpoint=endpoint(hub))
    assert_same_as_tiny(path)
    gets = [(p, r) for m, p, r in hub.requests if m == "GET"]
    assert ("/cdn/llm.pt", f"bytes={kept}-") in gets  # continued, not restarted
    assert not any(p.endswith("cosyvoice.yaml") for p, _ in gets)  # not fetched again
    assert not partial.exists()


def test_a_corrupt_file_is_rejected(hub: Hub, tmp_path: Path) -> None:
    hub.corrupt.add("flow.pt")
    with pytest.raises(DownloadError, match="checksum mismatch"):
        download_model(NAME, tmp_path, endpoint=endpoint(hub))
    partial = tmp_path / f"{NAME}.partial"
    assert not (partial / "flow.pt").exists() and not (partial / "flow.pt.incomplete").exists()
    assert not (tmp_path / NAME).exists()


def test_offline_without_a_model_says_where_it_looked(tmp_path: Path) -> None:
    dirs = (tmp_path / "a", tmp_path / "b")
    with pytest.raises(ModelNotFoundError) as err:
        ensure_model(NAME, dirs, tmp_path / "a", offline=True)
    text = str(err.value)
    for d in dirs:
        assert str(d / NAME) in text
    assert "llm.pt" in text and f"https://huggingface.co/{REPO}" in text
    assert str(tmp_path / "a" / NAME) in text  # where to put the files
    assert not (tmp_path / "a").exists()  # nothing created


@contextlib.contextmanager
def hanging_up_hub() -> Iterator[tuple[str, list[str]]]:
    """An endpoint that reads each request's first line and hangs up without an answer; (its
    URL, the request lines). Failing fast means asking it for a file once: no retries."""
    requests: list[str] = []
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with contextlib.suppress(OSError):  # the listener closed: the test is over
            while True:
                connection, _ = listener.accept()
                with connection, contextlib.suppress(OSError):
                    connection.settimeout(10)
                    requests.append(connection.makefile("rb").readline().decode().strip())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}", requests
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept() (close alone does not)
        listener.close()
        thread.join(10)


def file_requests(requests: list[str]) -> list[str]:
    """The requests for a model file (the hub client may ask other things of the endpoint)."""
    return [line for line in requests if "/resolve/" in line]


def test_unreachable_hub_fails_fast_with_the_same_advice(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="cannot reach") as err:
        ensure_model(NAME, (tmp_path,), tmp_path, endpoint="http://127.0.0.1:9")
    assert "put them in" in str(err.value)
    with hanging_up_hub() as (url, requests), pytest.raises(ModelNotFoundError, match="reach"):
        ensure_model(NAME, (tmp_path,), tmp_path, endpoint=url)
    assert len(file_requests(requests)) == 1, requests  # asked once: no retries, no waits
    assert not (tmp_path / f"{NAME}.partial").exists()  # nothing to resume: no trace


def test_found_in_any_data_dir_and_upstream_layout(tmp_path: Path) -> None:
    import shutil

    shutil.copytree(TINY, tmp_path / "b" / "pretrained_models" / NAME)
    found = ensure_model(NAME, (tmp_path / "a", tmp_path / "b"), tmp_path / "a", offline=True)
    assert found == tmp_path / "b" / "pretrained_models" / NAME


def test_an_incomplete_directory_is_not_used_or_overwritten(tmp_path: Path) -> None:
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "llm.pt").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="incomplete"):
        ensure_model(NAME, (tmp_path,), tmp_path, endpoint="http://127.0.0.1:9")


@pytest.mark.parametrize("name", ["../etc", "CosyVoice-300M-SFT/../../x", "/abs", "other/model"])
def test_model_names_never_become_paths(tmp_path: Path, name: str) -> None:
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        ensure_model(name, (tmp_path,), tmp_path)


def run_server(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wyoming_cosyvoice", *args],
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.long
def test_readme_command_without_model_or_network_fails_fast(tmp_path: Path) -> None:
    """`wyoming-cosyvoice --uri tcp://0.0.0.0:10200 --data-dir ./data` with no network."""
    with hanging_up_hub() as (url, requests):
        for env in ({"HF_ENDPOINT": url}, {"HF_HUB_OFFLINE": "1"}):
            result = run_server(
                ["--uri", "tcp://0.0.0.0:10200", "--data-dir", "./data"], env, tmp_path
            )
            assert result.returncode == 1, result.stderr
            assert str(tmp_path / "data" / NAME) in result.stderr
            assert "put them in" in result.stderr and "llm.pt" in result.stderr
    assert len(file_requests(requests)) == 1, requests  # asked once (and never offline)


def test_cli_downloads_through_hf_endpoint(hub: Hub, tmp_path: Path) -> None:
    """The hub client's own endpoint setting (HF_ENDPOINT) selects the stand-in hub."""
    process = subprocess.Popen(
        [sys.executable, "-m", "wyoming_cosyvoice", "--uri", "tcp://127.0.0.1:0",
         "--data-dir", str(tmp_path), "--no-warmup"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_ENDPOINT": endpoint(hub)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / NAME).exists() and process.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    assert_same_as_tiny(tmp_path / NAME)
    assert "Downloading CosyVoice-300M-SFT" in err


def test_voice_files_are_added_to_a_complete_model_dir(hub: Hub, tmp_path: Path) -> None:
    import shutil

    from wyoming_cosyvoice.models.download import ensure_extra_files

    for name in VOICE_FILES:
        hub.files[name] = os.urandom(300_000)
    model_dir = tmp_path / NAME
    shutil.copytree(TINY, model_dir)
    hub.cut_after["campplus.onnx"] = 100_000
    with pytest.raises(DownloadError):
        ensure_extra_files(model_dir, NAME, endpoint=endpoint(hub), attempts=1)
    assert not (model_dir / "campplus.onnx").exists()  # never a partial file under its name
    hub.cut_after.clear()
    ensure_extra_files(model_dir, NAME, endpoint=endpoint(hub))
    for name in VOICE_FILES:
        assert (model_dir / name).read_bytes() == hub.files[name]
    assert not (model_dir / ".partial").exists()
    with pytest.raises(ModelNotFoundError, match="offline"):
        ensure_extra_files(tmp_path / "empty", NAME, offline=True)


# --- CosyVoice2 ------------------------------------------------------------------------------


def _files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def test_cosyvoice2_downloads_only_what_the_engine_reads(hub_v2: Hub, tmp_path: Path) -> None:
    path = ensure_model(NAME_V2, (tmp_path,), tmp_path, endpoint=endpoint(hub_v2))
    assert path == tmp_path / NAME_V2
    assert _files_under(path) == set(MODEL_FILES_V2)
    for name in MODEL_FILES_V2:
        assert (path / name).read_bytes() == (TINY_V2 / name).read_bytes(), name
    fetched = {p.split("/resolve/main/")[-1] for m, p, _ in hub_v2.requests if m == "GET"}
    fetched = {p.removeprefix("/cdn/") for p in fetched}
    # Not the backbone's weights (they come from llm.pt), nor the prompt models yet.
    assert fetched == set(MODEL_FILES_V2)
    assert "CosyVoice-BlankEN/model.safetensors" not in fetched


def test_cosyvoice2_resumes_a_file_in_the_backbone_folder(hub_v2: Hub, tmp_path: Path) -> None:
    name = "CosyVoice-BlankEN/vocab.json"
    hub_v2.cut_after[name] = 5_000
    with pytest.raises(ModelNotFoundError, match="start again to resume"):
        ensure_model(NAME_V2, (tmp_path,), tmp_path, endpoint=endpoint(hub_v2), attempts=1)
    partial = tmp_path / f"{NAME_V2}.partial"
    assert (partial / f"{name}.incomplete").stat().st_size == 5_000
    assert find_model(NAME_V2, (tmp_path,), MODEL_FILES_V2) is None
    hub_v2.cut_after.clear()
    hub_v2.requests.clear()
    path = ensure_model(NAME_V2, (tmp_path,), tmp_path, endpoint=endpoint(hub_v2))
    assert (path / name).read_bytes() == (TINY_V2 / name).read_bytes()
    gets = [(p, r) for m, p, r in hub_v2.requests if m == "GET"]
    assert (f"/{REPO_V2}/resolve/main/{name}", "bytes=5000-") in gets  # continued
    assert not partial.exists()


def test_cosyvoice2_prompt_models_are_its_own(hub_v2: Hub, tmp_path: Path) -> None:
    import shutil

    from wyoming_cosyvoice.models.download import ensure_extra_files

    model_dir = tmp_path / NAME_V2
    shutil.copytree(TINY_V2, model_dir)
    ensure_extra_files(model_dir, NAME_V2, endpoint=endpoint(hub_v2))
    for name in VOICE_FILES_V2:
        assert (model_dir / name).read_bytes() == hub_v2.files[name]
    assert not (model_dir / "speech_tokenizer_v1.onnx").exists()


def test_a_cosyvoice2_model_dir_is_checked_for_its_own_files(tmp_path: Path) -> None:
    import shutil

    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.model import model_sample_rate, resolve_model_dir

    model_dir = tmp_path / "v2"
    shutil.copytree(TINY_V2, model_dir)
    config = load_config(overrides=[("server.model_dir", str(model_dir))])
    assert resolve_model_dir(config) == model_dir  # no spk2info.pt asked for
    assert model_sample_rate(model_dir) == 24000
    (model_dir / "CosyVoice-BlankEN" / "merges.txt").unlink()
    with pytest.raises(ModelNotFoundError, match="CosyVoice-BlankEN/merges.txt"):
        resolve_model_dir(config)


# --- Fun-CosyVoice3-0.5B ------------------------------------------------------------------------


def test_cosyvoice3_downloads_only_what_the_engine_reads(hub_v3: Hub, tmp_path: Path) -> None:
    from engine.cosyvoice3.model_dir import missing_model_files

    path = ensure_model(NAME_V3, (tmp_path,), tmp_path, endpoint=endpoint(hub_v3))
    assert path == tmp_path / NAME_V3 and _files_under(path) == set(V3.model_files)
    fetched = {p.split("/resolve/main/")[-1] for m, p, _ in hub_v3.requests if m == "GET"}
    # Not the backbone's weights, the prompt models (until a voice needs them) nor the RL LM.
    assert {p.removeprefix("/cdn/") for p in fetched} == set(V3.model_files)
    # What the engine checks a directory for is there, and the engine loads it.
    assert missing_model_files(path) == []
    from engine.family import load_engine

    assert load_engine(path, threads=1).kind == "cosyvoice3"


def _v3_config(data: Path, hub: Hub | None, **settings: object) -> object:
    from wyoming_cosyvoice.config import load_config

    overrides = [("server.model", NAME_V3), ("server.data_dirs", [str(data)])]
    overrides += [("server.hub_endpoint", endpoint(hub))] if hub else [("server.offline", True)]
    return load_config(None, overrides + [(f"server.{k}", v) for k, v in settings.items()])


def test_the_rl_tuned_lm_is_fetched_only_when_chosen(hub_v3: Hub, tmp_path: Path) -> None:
    from wyoming_cosyvoice.models.model import resolve_model_dir

    path = resolve_model_dir(_v3_config(tmp_path, hub_v3))
    assert not (path / "llm.rl.pt").exists()
    hub_v3.requests.clear()
    assert resolve_model_dir(_v3_config(tmp_path, hub_v3, rl_tuned_lm=True)) == path
    assert (path / "llm.rl.pt").read_bytes() == RL_LM_BYTES
    fetched = {p.split("/resolve/main/")[-1] for m, p, _ in hub_v3.requests if m == "GET"}
    # that file alone, next to the model's
    assert {p.removeprefix("/cdn/") for p in fetched} == {"llm.rl.pt"}
    assert _files_under(path) == {*V3.model_files, "llm.rl.pt"}


def test_offline_without_the_rl_tuned_lm_says_what_to_do(tmp_path: Path) -> None:
    import shutil

    from wyoming_cosyvoice.models.model import resolve_model_dir

    shutil.copytree(TINY_V3, tmp_path / NAME_V3, ignore=shutil.ignore_patterns("prepared"))
    assert resolve_model_dir(_v3_config(tmp_path, None)) == tmp_path / NAME_V3
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model_dir(_v3_config(tmp_path, None, rl_tuned_lm=True))
    text = str(err.value)
    assert "server.rl_tuned_lm is on" in text and "llm.rl.pt" in text and "offline" in text
    assert "turn server.rl_tuned_lm off" in text
    assert f"huggingface.co/{V3.models[NAME_V3]}" in text


def test_a_model_dir_without_the_rl_tuned_lm_is_refused_with_the_setting(tmp_path: Path) -> None:
    import shutil

    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.model import resolve_model_dir

    model_dir = tmp_path / "v3"
    shutil.copytree(TINY_V3, model_dir, ignore=shutil.ignore_patterns("prepared"))
    settings = [("server.model_dir", str(model_dir)), ("server.rl_tuned_lm", True)]
    with pytest.raises(ModelNotFoundError, match=r"--model-dir .*v3 has no llm\.rl\.pt"):
        resolve_model_dir(load_config(None, settings))


def test_the_setting_does_nothing_for_a_model_without_an_rl_tuned_lm(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import shutil

    from wyoming_cosyvoice.config import load_config
    from wyoming_cosyvoice.models.model import load_cosyvoice, resolve_model_dir

    model_dir = tmp_path / NAME_V2
    shutil.copytree(TINY_V2, model_dir, ignore=shutil.ignore_patterns("prepared"))
    settings = [("server.model_dir", str(model_dir)), ("server.rl_tuned_lm", True)]
    assert resolve_model_dir(load_config(None, settings)) == model_dir
    assert "CosyVoice2-0.5B has no RL-tuned LM; it runs its own" in caplog.text
    assert load_cosyvoice(model_dir, 1, rl_lm=True).kind == "cosyvoice2"


def test_the_server_downloads_and_speaks_with_the_rl_tuned_lm(
    hub_v3: Hub, tmp_path: Path, wy: Any
) -> None:
    """``rl_tuned_lm`` through the real server: the RL LM fetched from the hub on the start,
    loaded in place of llm.pt, and a Wyoming request spoken with it."""
    import torch
    from tiny_family_server import SAMPLES, V3, TinyServer, data_dir, server_log

    state = torch.load(TINY_V3 / "llm.pt", weights_only=True)
    (key,) = [k for k in state if k.endswith("layers.0.mlp.up_proj.weight")]
    state[key] = state[key] * 2  # which LM ran shows in this layer
    rl_path = tmp_path / "llm.rl.pt"
    torch.save(state, rl_path)
    hub_v3.files["llm.rl.pt"] = rl_path.read_bytes()
    data = data_dir(tmp_path, V3, with_v1=True)
    settings = {"server.offline": False, "server.hub_endpoint": endpoint(hub_v3),
                "server.rl_tuned_lm": True, "server.warmup": False,
                "server.lm_weights": "fp32"}  # fmt: skip
    with server_log() as log, TinyServer(data, V3, settings) as srv:
        engine = srv.running.scheduler.engine
        reply = srv.call(wy.synthesize(srv.running.port, "Hello there.", {"name": "en-male"}))
        weights = engine.models.llm.state_dict().items()
        weight = next(w for k, w in weights if k.endswith("layers.0.mlp.up_proj.weight"))
    assert (data / V3.model / "llm.rl.pt").read_bytes() == hub_v3.files["llm.rl.pt"]
    assert engine.lm_file == "llm.rl.pt" and "Loading the RL-tuned LM (llm.rl.pt)" in log.text()
    assert torch.equal(weight, state[key])
    assert reply.error() is None and reply.samples == SAMPLES
