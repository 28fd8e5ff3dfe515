"""Security: safe loading, no path traversal, bind address, no stray writes.

Already covered: a malicious ``llm.pt`` is refused (test_weights.py), YAML tags stay data
(test_weights.py), model names never become paths (test_download.py, ``model_spec``).

Added: malicious ``spk2info.pt`` (the loader and the server's torch-free speaker peek) and a
malicious custom-voice cache ``NAME.prompt.pt`` never run their payload; voice names with
``../``, absolute paths and the like are unknown voices on the wire and in the voices folder;
``--model ../../etc`` ends the real CLI before anything is read; the real process listens only
where ``--uri`` says; a whole serve-synthesize-stop cycle with a temp HOME, TMPDIR and CWD
writes no file anywhere in that tree — not even in the model directory.
"""

from __future__ import annotations

import asyncio
import os
import pickle
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from conftest import ROOT, terminate
from wyoming.event import Event

from wyoming_cosyvoice.home_assistant.tts_cache_guard import STATE_FILE
from wyoming_cosyvoice.voices.loudness import LEVELS_DIR

ZERO_SHOT_WAV = ROOT / "tests" / "data" / "zero_shot" / "prompt16k_pcm16.wav"


class _Payload:
    """Unpickling this would create the marker file: code execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _malicious(path: Path, obj: Any) -> None:
    import torch

    torch.save(obj, path, pickle_module=pickle)


@pytest.fixture()
def model_copy(tmp_path: Path, wy: SimpleNamespace) -> Path:
    target = tmp_path / "model"
    shutil.copytree(wy.TINY_MODEL, target)
    for path in target.iterdir():
        path.chmod(0o644)
    return target


def test_malicious_speaker_file_is_refused_everywhere(model_copy: Path, tmp_path: Path) -> None:
    from engine.core.types import ModelLoadError
    from engine.cosyvoice1.model_dir import load_model_dir, load_speakers
    from wyoming_cosyvoice.models.model import peek_speakers

    marker = tmp_path / "pwned"
    _malicious(model_copy / "spk2info.pt", {"中文女": {"embedding": _Payload(marker)}})
    with pytest.raises(ModelLoadError, match="refused to load"):
        load_speakers(model_copy / "spk2info.pt")
    with pytest.raises(ModelLoadError, match="refused to load"):
        load_model_dir(model_copy)
    # The server reads speaker names before torch loads, with its own restricted unpickler.
    assert peek_speakers(model_copy) is None
    assert not marker.exists()


def test_malicious_voice_cache_is_ignored_not_executed(tmp_path: Path) -> None:
    from engine.prompt.errors import VoiceError
    from engine.prompt.voices import load_voice

    voices = tmp_path / "voices"
    voices.mkdir()
    shutil.copy(ZERO_SHOT_WAV, voices / "alice.wav")
    (voices / "alice.txt").write_text("Hello there, this is how my voice sounds.")
    marker = tmp_path / "pwned"
    _malicious(voices / "alice.prompt.pt", {"format": 1, "x": _Payload(marker)})
    # Without the prompt models the voice cannot be re-extracted: refused, payload never run.
    with pytest.raises(VoiceError, match="not extracted"):
        load_voice(voices, "alice", None)
    assert not marker.exists()


@pytest.mark.parametrize(
    "name", ["../outside", "../../etc/passwd", "/etc/passwd", "..", "sub/../../outside"]
)
def test_voice_names_never_leave_the_voices_folder(tmp_path: Path, name: str) -> None:
    from engine.prompt.errors import VoiceError
    from engine.prompt.voices import load_voice, voice_names

    voices = tmp_path / "voices"
    (voices / "sub").mkdir(parents=True)
    # A complete, valid-looking voice right outside the folder must stay unreachable.
    shutil.copy(ZERO_SHOT_WAV, tmp_path / "outside.wav")
    (tmp_path / "outside.txt").write_text("Hello there, this is how my voice sounds.")
    with pytest.raises(VoiceError, match="missing"):
        load_voice(voices, name, None)
    assert voice_names(voices) == []
    assert not list(tmp_path.glob("*.prompt.pt"))


TRAVERSAL = ["../../etc/passwd", "/etc/passwd", "..\\..\\boot.ini", "zh-female/../../x", "~root"]


def test_voice_names_with_paths_are_unknown_voices_on_the_wire(wy: SimpleNamespace) -> None:
    async def main() -> list[Any]:
        replies = []
        async with wy.fake_server() as srv:
            for name in TRAVERSAL:
                replies.append(await wy.synthesize(srv.port, "Hi.", {"name": name}))
                replies.append(await wy.synthesize(srv.port, "Hi.", {"speaker": name}))
                replies.append(await wy.stream(srv.port, "Hi. ", voice={"name": name}))
        return replies

    for reply in asyncio.run(main()):
        assert reply.error() is not None and reply.error().code == "VoiceNotFoundError"
        assert reply.samples == 0


@pytest.mark.parametrize("model", ["../../etc", "/etc", "CosyVoice-300M-SFT/../../x"])
def test_cli_model_names_never_become_paths(tmp_path: Path, model: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "wyoming_cosyvoice",
            "--model",
            model,
            "--data-dir",
            str(tmp_path / "data"),
            "--uri",
            "tcp://127.0.0.1:1",
        ],  # fmt: skip
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert "unknown model" in result.stderr
    assert list(tmp_path.iterdir()) == []  # not even the data dir was created


def test_in_process_server_binds_exactly_the_uri(wy: SimpleNamespace) -> None:
    async def main() -> list[Any]:
        async with wy.fake_server() as srv:
            return [s.getsockname() for s in srv.running.server.sockets]

    names = asyncio.run(main())
    assert len(names) == 1 and names[0][0] == "127.0.0.1"


# --- the real process ---------------------------------------------------------------------


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """TCP sockets in LISTEN state owned by ``pid``, from /proc (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A = LISTEN
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            if table == "tcp":
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # /proc prints IPv6 as four little-endian 32-bit words
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, words)
            found.add((addr, int(hex_port, 16)))
    return found


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file() or p.is_dir()
    }


@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="needs Linux /proc")
@pytest.mark.long
def test_real_server_binds_only_the_uri_and_writes_only_its_prepared_weights_and_state(
    wy: SimpleNamespace, tmp_path: Path
) -> None:
    home, tmp, cwd, data = (tmp_path / n for n in ("home", "tmp", "cwd", "data"))
    for d in (home, tmp, cwd, data):
        d.mkdir()
    model = data / "CosyVoice-300M-SFT"
    shutil.copytree(wy.TINY_MODEL, model, ignore=shutil.ignore_patterns("prepared"))
    before = snapshot(tmp_path)
    port = wy.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # bytecode caches belong to the code, not the data
    process = subprocess.Popen(
        [sys.executable, "-m", "wyoming_cosyvoice.bench.server", "--uri", f"tcp://127.0.0.1:{port}",
         "--data-dir", str(data), "--threads", "1", "--force-tokens", "5", "--seed", "0"],
        cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert process.poll() is None, process.communicate()[1][-2000:]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        addresses = listening_addresses(process.pid)
        reply = asyncio.run(wy.synthesize(port, "Nothing is written anywhere."))
        streamed = asyncio.run(wy.stream(port, "Streamed text. Two sentences."))
        info_types = asyncio.run(_describe(wy, port))
    finally:
        log = terminate(process)
    assert process.returncode == 0, log[-2000:]
    assert addresses == {("127.0.0.1", port)}, addresses
    assert reply.types[-1] == "audio-stop" and reply.samples > 0
    assert streamed.types[-1] == "synthesize-stopped"
    assert info_types == ["info"]
    after = snapshot(tmp_path)
    # The deliberate writes: the weights the engine runs from, prepared beside the model files
    # on first use (engine.core.prepared), one file per model and weight format the server loads
    # (the default auto profile: the LM, flow and HiFT in two each). Nothing else, not even in the
    # model directory (whose mtime changes with the new folder).
    prepared = Path("data", "CosyVoice-300M-SFT", "prepared")
    written = [k for k in set(after) - set(before) if Path(k).parent == prepared]
    assert {Path(k).name.split(".")[0] for k in written} == {"flow", "hift", "llm"}, written
    assert all(k.endswith(".safetensors") for k in written), written
    # And the server's own state beside the models: each voice's learnt loudness
    # (wyoming_cosyvoice.voices.loudness) and what Home Assistant's TTS cache last heard
    # (wyoming_cosyvoice.home_assistant.tts_cache_guard).
    levels = Path("data", LEVELS_DIR)
    state = {str(Path("data", STATE_FILE)), str(levels), str(levels / "CosyVoice-300M-SFT.json")}
    assert state <= set(after) - set(before), sorted(set(after) - set(before))
    added = sorted(set(after) - set(before) - {*written, str(prepared), *state})
    # Directory mtimes count too: a file made and removed again is still a write.
    changed = sorted(
        k
        for k in set(after) & set(before)
        if after[k] != before[k] and k not in ("data", str(prepared.parent))
    )
    assert added == [] and changed == [], (added, changed)


async def _describe(wy: SimpleNamespace, port: int) -> list[str]:
    async with wy.connect(port) as client:
        await client.write_event(Event("describe"))
        return (await wy.read_until(client, ("info",))).types
