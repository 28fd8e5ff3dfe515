"""Finding a model directory in the data dirs, or downloading it from the Hugging Face hub.

A download goes into ``<download-dir>/<name>.partial/`` and is renamed to ``<name>/`` only when
every file is complete and verified, so a directory named like a model is always complete.
Each file is fetched with HTTP ``Range`` into ``<file>.incomplete``, which survives restarts:
an interrupted download continues where it stopped (``hf_hub_download`` deletes partial files,
hence our own loop). The hub client still provides the URL scheme, the endpoint setting
(``HF_ENDPOINT`` or ``server.hub_endpoint``), metadata (size, ETag = SHA-256 for LFS files,
git blob SHA-1 for small files) and the HTTP session; both hashes are checked.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from engine.family import FAMILIES, Family
from wyoming_cosyvoice.home_assistant import addon

_LOGGER = logging.getLogger(__name__)

_STATE_FILE = ".download.json"
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelSpec:
    """An official model: its repository and what its family needs of it (engine.family)."""

    repo_id: str
    family: Family
    revision: str = "main"

    @property
    def files(self) -> tuple[str, ...]:
        """What a directory of the model needs."""
        return self.family.model_files

    @property
    def voice_files(self) -> tuple[str, ...]:
        """The prompt models voices are extracted with (custom_voices.py)."""
        return self.family.prompt_model_files


MODELS = {
    name: ModelSpec(repo, family) for family in FAMILIES for name, repo in family.models.items()
}


class ModelNotFoundError(Exception):
    """No usable model directory and no way to download one; the message says what to do."""


class DownloadError(Exception):
    """A download failed or a downloaded file did not verify."""


def model_spec(name: str) -> ModelSpec:
    """Only known names: a model name never becomes an arbitrary path or repository."""
    if name not in MODELS:
        raise ModelNotFoundError(
            f"unknown model {name!r}; known models: {', '.join(MODELS)} "
            "(use --model-dir for any other directory)"
        )
    return MODELS[name]


def missing_files(model_dir: Path, files: tuple[str, ...]) -> list[str]:
    """Files absent or empty in ``model_dir``."""
    return [
        f for f in files if not (model_dir / f).is_file() or (model_dir / f).stat().st_size == 0
    ]


def candidate_dirs(name: str, data_dirs: tuple[Path, ...]) -> list[Path]:
    """Where a model may live: ``<data-dir>/<name>`` or upstream's ``pretrained_models/<name>``."""
    return [p for d in data_dirs for p in (d / name, d / "pretrained_models" / name)]


def find_model(name: str, data_dirs: tuple[Path, ...], files: tuple[str, ...]) -> Path | None:
    for path in candidate_dirs(name, data_dirs):
        if path.is_dir() and not missing_files(path, files):
            return path
    return None


def _how_to_place(name: str, spec: ModelSpec, target: Path, searched: list[Path]) -> str:
    if addon.in_addon():  # the add-on's user sees neither /data nor the command line
        return addon.missing_model_help(name, spec.repo_id, spec.files)
    places = "\n".join(f"  {p.absolute()}" for p in searched)
    files = " ".join(spec.files)
    return (
        f"Model {name} was not found. Looked in:\n{places}\n"
        f"To install it by hand, download these files from https://huggingface.co/{spec.repo_id} "
        f"(or ModelScope iic/{name}):\n  {files}\n"
        f"and put them in {target.absolute()}/ (then start again), or pass --model-dir DIR."
    )


def ensure_model(
    name: str,
    data_dirs: tuple[Path, ...],
    download_dir: Path,
    *,
    offline: bool = False,
    endpoint: str | None = None,
    attempts: int = 5,
) -> Path:
    """A complete model directory for ``name``: found in the data dirs or downloaded."""
    spec = model_spec(name)
    found = find_model(name, data_dirs, spec.files)
    if found is not None:
        _LOGGER.info("Using model %s in %s", name, found)
        return found
    target = download_dir / name
    searched = candidate_dirs(name, data_dirs)
    from huggingface_hub import constants as hub_constants

    if offline or hub_constants.is_offline_mode():
        raise ModelNotFoundError(
            _how_to_place(name, spec, target, searched)
            + "\n(Offline mode: nothing was downloaded.)"
        )
    if target.exists():
        absent = ", ".join(missing_files(target, spec.files))
        raise ModelNotFoundError(
            f"{target} exists but is incomplete (missing or empty: {absent}). Complete it by hand "
            "or delete it so it can be downloaded again."
        )
    try:
        return download_model(name, download_dir, endpoint=endpoint, attempts=attempts)
    except DownloadError as err:
        partial = download_dir / f"{name}.partial"
        if partial.is_dir() and not any(partial.iterdir()):
            partial.rmdir()  # nothing to resume: leave no trace
        raise ModelNotFoundError(
            f"{err}\n\n" + _how_to_place(name, spec, target, searched)
        ) from err


def ensure_extra_files(
    model_dir: Path,
    name: str,
    files: tuple[str, ...] | None = None,
    *,
    offline: bool = False,
    endpoint: str | None = None,
    attempts: int = 5,
) -> None:
    """Add optional files (the ONNX models custom voices need) to a complete model dir.

    Each file is fetched into ``<model_dir>/.partial/`` (resumable) and moved in only once
    verified, so the model directory never holds a partial file under a real name.
    ``files``: default, the model's prompt models.
    """
    spec = model_spec(name)
    absent = missing_files(model_dir, spec.voice_files if files is None else files)
    if not absent:
        return
    from huggingface_hub import constants as hub_constants

    if offline or hub_constants.is_offline_mode():
        raise ModelNotFoundError(
            f"{model_dir} lacks {', '.join(absent)}; download them from "
            f"https://huggingface.co/{spec.repo_id} into {model_dir.absolute()}/ (offline mode)"
        )
    staging = model_dir / ".partial"
    staging.mkdir(exist_ok=True)
    state_path = staging / _STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    for filename in absent:
        state[filename] = _download_file(
            spec, filename, staging, state, endpoint=endpoint, attempts=attempts
        )
        state_path.write_text(json.dumps(state, indent=1))
        (model_dir / filename).parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging / filename, model_dir / filename)
    state_path.unlink()
    staging.rmdir()


def download_model(
    name: str, download_dir: Path, *, endpoint: str | None = None, attempts: int = 5
) -> Path:
    """Download ``name`` into ``download_dir/name`` (resumable, verified, atomic)."""
    spec = model_spec(name)
    target = download_dir / name
    partial = download_dir / f"{name}.partial"
    partial.mkdir(parents=True, exist_ok=True)
    state_path = partial / _STATE_FILE
    state = json.loads(state_path.read_text()) if state_path.is_file() else {}
    _LOGGER.info(
        "Downloading %s from %s into %s", name, endpoint or "the Hugging Face hub", partial
    )
    for filename in spec.files:
        etag = _download_file(spec, filename, partial, state, endpoint=endpoint, attempts=attempts)
        state[filename] = etag
        state_path.write_text(json.dumps(state, indent=1))
    absent = missing_files(partial, spec.files)
    if absent:
        raise DownloadError(f"download of {name} is missing {', '.join(absent)}")
    state_path.unlink()
    os.replace(partial, target)  # atomic: the model dir appears complete or not at all
    _LOGGER.info("Model %s is complete in %s", name, target)
    return target


def _download_file(
    spec: ModelSpec,
    filename: str,
    folder: Path,
    state: dict[str, str],
    *,
    endpoint: str | None,
    attempts: int,
) -> str:
    """Fetch one file (resuming a previous ``.incomplete``); returns its verified ETag."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    url = hf_hub_url(spec.repo_id, filename, revision=spec.revision, endpoint=endpoint)
    try:
        meta = get_hf_file_metadata(url, endpoint=endpoint)
    except HfHubHTTPError as err:
        raise DownloadError(f"cannot get {filename} from {url}: {err}") from err
    except Exception as err:  # network errors come in many types
        raise DownloadError(f"cannot reach {url} ({type(err).__name__}: {err})") from err
    etag = meta.etag or ""
    final = folder / filename
    final.parent.mkdir(parents=True, exist_ok=True)  # a file in a subfolder of the repository
    if final.is_file() and state.get(filename) == etag and etag:
        _LOGGER.info("%s: already downloaded", filename)
        return etag
    incomplete = folder / f"{filename}.incomplete"
    marker = folder / f"{filename}.incomplete.etag"
    if incomplete.exists() and (not marker.is_file() or marker.read_text() != etag):
        incomplete.unlink()  # the remote file changed: its bytes cannot be continued
    marker.write_text(etag)

    for attempt in range(1, attempts + 1):
        try:
            _fetch(url, incomplete, meta.size, filename)
            break
        except DownloadError:
            raise
        except Exception as err:  # retried; the partial file is kept
            status = getattr(getattr(err, "response", None), "status_code", None)
            if status is not None and 400 <= status < 500 and status not in (408, 429):
                raise DownloadError(f"cannot download {filename}: HTTP {status}") from err
            if attempt == attempts:
                raise DownloadError(
                    f"download of {filename} failed after {attempts} attempts ({err}); "
                    f"{incomplete.stat().st_size if incomplete.exists() else 0} bytes kept, "
                    "start again to resume"
                ) from err
            _LOGGER.warning(
                "%s: %s; resuming (attempt %d/%d)", filename, err, attempt + 1, attempts
            )
            time.sleep(min(2.0 ** (attempt - 1), 30.0) * 0.5)
    _verify(incomplete, filename, meta.size, etag)
    os.replace(incomplete, final)
    marker.unlink(missing_ok=True)
    return etag


def _fetch(url: str, incomplete: Path, size: int | None, filename: str) -> None:
    """Append the missing bytes of ``url`` to ``incomplete`` (HTTP Range)."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    have = incomplete.stat().st_size if incomplete.exists() else 0
    if size is not None and have == size:
        return
    if size is not None and have > size:
        incomplete.unlink()
        have = 0
    headers = build_hf_headers()
    if have:
        headers["Range"] = f"bytes={have}-"
    with get_session().stream(
        "GET", url, headers=headers, follow_redirects=True, timeout=30.0
    ) as r:
        hf_raise_for_status(r)
        mode = "ab" if have and r.status_code == 206 else "wb"  # 200: the server ignored Range
        done = have if mode == "ab" else 0
        total = size or (done + int(r.headers.get("Content-Length", 0)))
        if done:
            _LOGGER.info("%s: resuming at %s", filename, _mb(done))
        progress = _Progress(filename, total, done)
        with incomplete.open(mode) as f:
            for block in r.iter_bytes():  # as received: a dropped line loses nothing
                f.write(block)
                done += len(block)
                progress.update(done)
    if size is not None and done < size:
        raise ConnectionError(f"connection closed at {_mb(done)} of {_mb(size)}")


def _verify(path: Path, filename: str, size: int | None, etag: str) -> None:
    actual = path.stat().st_size
    if size is not None and actual != size:
        path.unlink()
        raise DownloadError(
            f"{filename}: got {actual} bytes, expected {size}; removed, start again"
        )
    if re.fullmatch(r"[0-9a-f]{64}", etag):  # LFS file: the ETag is its SHA-256
        digest = hashlib.sha256()
    elif re.fullmatch(r"[0-9a-f]{40}", etag):  # regular git file: the ETag is its blob SHA-1
        digest = hashlib.sha1(f"blob {actual}\0".encode())
    else:
        _LOGGER.warning(
            "%s: no checksum from the hub (ETag %r); checked the size only", filename, etag
        )
        return
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    if digest.hexdigest() != etag:
        path.unlink()
        raise DownloadError(
            f"{filename}: checksum mismatch (expected {etag}); removed, start again"
        )
    _LOGGER.info("%s: verified (%s)", filename, _mb(actual))


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class _Progress:
    """Log lines instead of a terminal bar: add-on logs are not terminals."""

    def __init__(self, filename: str, total: int, done: int) -> None:
        self.filename, self.total = filename, total
        self._next_pct = (done * 100 // total // 10 + 1) * 10 if total else 100
        self._last = time.monotonic()

    def update(self, done: int) -> None:
        pct = done * 100 // self.total if self.total else 0
        now = time.monotonic()
        if pct >= self._next_pct or now - self._last > 10:
            _LOGGER.info("%s: %d%% (%s of %s)", self.filename, pct, _mb(done), _mb(self.total))
            self._next_pct = (pct // 10 + 1) * 10
            self._last = now
