"""A new voice written into the voices folder: its transcript and its two files (its name is
checked by :mod:`wyoming_cosyvoice.voices.names`).

The folder's format is the one users fill by hand (docs/custom-voices.md): ``NAME.wav`` and
``NAME.txt``. Each file is written to a dot-file first (scans ignore those) and then renamed into
place, the transcript first: a scan that runs between the two renames sees a transcript without
its recording, which it skips until the next check, and never half a recording.
"""

from __future__ import annotations

import os
from pathlib import Path

from engine.prompt.validate import MAX_TRANSCRIPT_CHARS
from wyoming_cosyvoice.voices.names import name_key


class BadTranscript(ValueError):
    """A transcript the engine would refuse."""


class VoiceExists(ValueError):
    """The folder already has files of a voice by that name."""


def check_transcript(text: str) -> str:
    """The transcript as the engine reads it (runs of spaces and line breaks as one space)."""
    text = " ".join(text.split())
    if not any(ch.isalnum() for ch in text):
        raise BadTranscript("the transcript is empty: write exactly what is said in the recording")
    if len(text) > MAX_TRANSCRIPT_CHARS:
        raise BadTranscript(f"the transcript is {len(text)} characters long; the limit is "
                            f"{MAX_TRANSCRIPT_CHARS}")  # fmt: skip
    return text


def file_of_voice(folder: Path, name: str) -> str | None:
    """A file of the folder that belongs to a voice called ``name`` (first), or to a name that
    looks the same (:func:`~wyoming_cosyvoice.voices.names.name_key`), or None."""
    wanted = name_key(name)
    try:
        names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    except FileNotFoundError:
        return None
    alike = [file for file in names if name_key(file.split(".")[0]) == wanted]
    exact = [file for file in alike if file.split(".")[0] == name]
    return next(iter(exact or alike), None)


def save_voice(folder: Path, name: str, transcript: str, wav: bytes) -> list[Path]:
    """Write ``NAME.txt`` and ``NAME.wav``; :class:`VoiceExists` if the name is taken.

    Blocking file I/O: callers on an event loop run it in a thread, one save at a time.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if (taken := file_of_voice(folder, name)) is not None:
        raise VoiceExists(f"the voices folder already has {taken}: choose another name, or "
                          "delete that voice's files first")  # fmt: skip
    written = []
    for suffix, data in ((".txt", (transcript + "\n").encode("utf-8")), (".wav", wav)):
        path = folder / f"{name}{suffix}"
        _write_atomically(path, data)
        written.append(path)
    return written


def _write_atomically(path: Path, data: bytes) -> None:
    staging = path.with_name(f".{path.name}.part")
    try:
        with staging.open("wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(staging, path)
    finally:
        staging.unlink(missing_ok=True)
