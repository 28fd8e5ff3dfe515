"""Custom voices from a folder: ``NAME.wav`` + ``NAME.txt`` (+ ``NAME.instruct.txt``).

The prompt is extracted once (both ONNX models + the mel) and cached next to the files as
``NAME`` + the model family's cache suffix (``NAME.prompt.pt`` for v1, a plain dict, loadable
with ``torch.load(weights_only=True)``). The cache records the family, size, mtime and sha256 of
the WAV and the transcript plus the ONNX models' identity; it is used only by the family that
wrote it and when the sizes and hashes still match (mtime alone is not trusted: copies and
restores keep or reset it arbitrarily). Voices that fail validation are skipped with a log
message and listed with the reason; the caller keeps running.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from engine.core.voice import Voice
from engine.prompt.audio import load_prompt
from engine.prompt.errors import PromptModelError, VoiceError
from engine.prompt.extract import PROMPT_RATE, PromptFeatures, extract_features
from engine.prompt.onnx_models import PromptModels
from engine.prompt.recipe import CACHE_ENDING, COSYVOICE1, PromptRecipe
from engine.prompt.validate import (
    MAX_SECONDS,
    check_audio,
    check_transcript_length,
    read_transcript,
)
from engine.text.normalize import detect_language

if TYPE_CHECKING:
    from engine.text.frontend import TextFrontend

_LOGGER = logging.getLogger(__name__)

CACHE_SUFFIX = COSYVOICE1.cache_suffix
INSTRUCT_SUFFIX = ".instruct.txt"
# Bump when extraction changes, so old caches are re-extracted.
CACHE_FORMAT = 1
# Caches written before the family was recorded are v1's (v1 was the only family).
_UNMARKED_FAMILY = COSYVOICE1.family
_OTHER_AUDIO = (".mp3", ".flac", ".ogg", ".oga", ".opus", ".m4a", ".aac", ".wma", ".aiff")
# Languages that share a script and whose transcript still helps the LM (zero-shot, not
# cross-lingual): Cantonese transcripts are detected as 'yue' only by a few characters.
_SAME_FAMILY = {"yue": "zh"}


@dataclass(frozen=True)
class CustomVoice:
    """A validated custom voice with its prompt features."""

    name: str
    transcript: str
    language: str  # detected from the transcript
    prompt: PromptFeatures
    duration_s: float
    instruct: str | None = None
    source: str = "extracted"  # or "cache"
    load_seconds: float = 0.0
    family: str = COSYVOICE1.family  # the model family the prompt features are for


@dataclass
class ScanResult:
    """Usable voices by name, and the rejected ones with the reason."""

    voices: dict[str, CustomVoice] = field(default_factory=dict)
    rejected: dict[str, str] = field(default_factory=dict)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_record(path: Path) -> dict[str, object]:
    st = path.stat()
    return {
        "name": path.name,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "sha256": _sha256(path),
    }


def _same_file(old: object, new: object) -> bool:
    return (
        isinstance(old, dict)
        and isinstance(new, dict)
        and old.get("size") == new["size"]
        and old.get("sha256") == new["sha256"]
    )


def _key(
    wav: Path, txt: Path, models: PromptModels | None, recipe: PromptRecipe
) -> dict[str, object]:
    # Models that are not there (deleted after extraction to save space) cannot have changed:
    # any cache that matches the files is then good.
    present = models is not None and models.files_present()
    return {
        "format": CACHE_FORMAT,
        "family": recipe.family,
        "wav": file_record(wav),
        "txt": file_record(txt),
        "models": models.identity() if present and models is not None else None,
    }


def _cache_matches(state: dict[str, object], key: dict[str, object]) -> bool:
    if state.get("format") != CACHE_FORMAT:
        return False
    if state.get("family", _UNMARKED_FAMILY) != key["family"]:
        return False  # another family's features: never fed to this model
    if not (_same_file(state.get("wav"), key["wav"]) and _same_file(state.get("txt"), key["txt"])):
        return False
    # Without the models at hand (no onnxruntime / files) any matching cache is good.
    return key["models"] is None or state.get("models") == key["models"]


def _write_cache(path: Path, state: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a reader never sees half a cache
    except OSError as err:
        tmp.unlink(missing_ok=True)
        _LOGGER.warning(
            "Cannot write the prompt cache %s (%s); the voice works but its "
            "prompt will be extracted again next time",
            path,
            err,
        )


def _read_cache(path: Path) -> dict[str, object] | None:
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated or foreign file: just extract again
        _LOGGER.warning("Ignoring unreadable prompt cache %s: %s", path.name, err)
        return None
    return state if isinstance(state, dict) else None


def load_voice(
    voices_dir: Path,
    name: str,
    models: PromptModels | None,
    recipe: PromptRecipe = COSYVOICE1,
) -> CustomVoice:
    """Validate and prepare ``NAME`` from ``voices_dir``; VoiceError with the reason if unusable.

    Uses the family's cache (``NAME.prompt.pt`` for v1) when it matches the current files, else
    extracts and rewrites it.
    """
    start = time.perf_counter()
    files = _voice_files(voices_dir).get(name, {})
    wav, txt = files.get("wav"), files.get("txt", voices_dir / f"{name}.txt")
    if wav is None:
        if "other" in files:
            raise VoiceError(
                f"{files['other'].name} is not a WAV file; convert it to "
                f"{name}.wav (e.g. ffmpeg -i {files['other'].name} {name}.wav)"
            )
        raise VoiceError(f"recording {name}.wav is missing")
    transcript = read_transcript(txt)
    instruct = None
    if "instruct" in files:
        try:
            instruct = read_transcript(files["instruct"], what="instruction")
        except VoiceError as err:  # optional file: the voice still works without it
            _LOGGER.warning("Custom voice %r: ignoring its instruction: %s", name, err)
    cache = voices_dir / f"{name}{recipe.cache_suffix}"
    key = _key(wav, txt, models, recipe)
    state = _read_cache(cache)
    if state is not None and _cache_matches(state, key):
        try:
            prompt = PromptFeatures.from_state(state)
            duration = float(state["duration_s"])  # type: ignore[arg-type]
        except (KeyError, TypeError, ValueError) as err:
            _LOGGER.warning("Ignoring malformed prompt cache %s: %s", cache.name, err)
        else:
            return CustomVoice(
                name,
                transcript,
                detect_language(transcript),
                prompt,
                duration,
                instruct,
                "cache",
                time.perf_counter() - start,
                recipe.family,
            )
    if models is None:
        raise VoiceError(
            "its prompt is not extracted yet and the prompt models "
            f"(campplus.onnx, {recipe.tokenizer.file}) are not available"
        )
    recording = load_prompt(wav, max_seconds=MAX_SECONDS)
    wave_16k = recording.at(PROMPT_RATE)
    duration = check_audio(wave_16k, name)
    check_transcript_length(transcript, duration, name)
    try:
        prompt = extract_features(wave_16k, models, recipe, recording=recording)
    except PromptModelError as err:
        raise VoiceError(str(err)) from err
    _write_cache(
        cache,
        {
            **key,
            "duration_s": duration,
            "transcript": transcript,
            "source_rate": recording.info.sample_rate,
            **prompt.to_state(),
        },
    )
    seconds = time.perf_counter() - start
    _LOGGER.info(
        "Custom voice %r: prompt extracted in %.2f s (%.1f s of audio, %d tokens)",
        name,
        seconds,
        duration,
        prompt.speech_tokens.shape[1],
    )
    return CustomVoice(
        name,
        transcript,
        detect_language(transcript),
        prompt,
        duration,
        instruct,
        "extracted",
        seconds,
        recipe.family,
    )


def _split(fname: str) -> tuple[str, str] | None:
    """(NAME, kind) for a voice file name, kind in wav/txt/instruct/other; None otherwise."""
    low = fname.lower()
    if fname.startswith(".") or low.endswith(CACHE_ENDING):  # every family's cache
        return None
    for suffix, kind in ((INSTRUCT_SUFFIX, "instruct"), (".wav", "wav"), (".txt", "txt")):
        if low.endswith(suffix):
            return fname[: -len(suffix)], kind
    if low.endswith(_OTHER_AUDIO):
        return fname.rsplit(".", 1)[0], "other"
    return None


def _voice_files(voices_dir: Path) -> dict[str, dict[str, Path]]:
    """NAME -> {kind: path}; extensions match case-insensitively (Windows-made ``.WAV``)."""
    found: dict[str, dict[str, Path]] = {}
    for path in sorted(voices_dir.iterdir()):
        parts = _split(path.name)
        if parts is not None and path.is_file():
            found.setdefault(parts[0], {}).setdefault(parts[1], path)
    return found


def voice_names(voices_dir: Path) -> list[str]:
    """Every NAME the folder mentions (recordings and transcripts), sorted."""
    return sorted(_voice_files(voices_dir))


def scan_voices(
    voices_dir: Path | str,
    models: PromptModels | None,
    *,
    reserved: Collection[str] = (),
    recipe: PromptRecipe = COSYVOICE1,
) -> ScanResult:
    """Load every voice of ``voices_dir``; bad ones are logged and listed, never raised."""
    voices_dir = Path(voices_dir)
    result = ScanResult()
    if not voices_dir.is_dir():
        _LOGGER.info("No custom voices: %s is not a directory", voices_dir)
        return result
    for name in voice_names(voices_dir):
        try:
            if name in reserved:
                raise VoiceError("the name is already used by a built-in speaker; rename it")
            result.voices[name] = load_voice(voices_dir, name, models, recipe)
        except (VoiceError, PromptModelError) as err:
            result.rejected[name] = str(err)
            _LOGGER.warning("Custom voice %r skipped: %s", name, err)
        except Exception as err:  # a bad file must never take the server down
            result.rejected[name] = f"unexpected error: {err}"
            _LOGGER.exception("Custom voice %r skipped after an unexpected error", name)
    _LOGGER.info(
        "Custom voices in %s: %s%s",
        voices_dir,
        ", ".join(result.voices) or "none",
        f" ({len(result.rejected)} rejected)" if result.rejected else "",
    )
    return result


class VoiceLibrary:
    """Thread-safe registry of custom voices, re-scanned on demand."""

    def __init__(
        self,
        voices_dir: Path | str,
        models: PromptModels | None,
        *,
        reserved: Collection[str] = (),
        release_models: bool = True,
        recipe: PromptRecipe = COSYVOICE1,
    ) -> None:
        self.voices_dir = Path(voices_dir)
        self.models = models
        self.reserved = frozenset(reserved)
        self.recipe = recipe
        # Drop the ONNX sessions after a scan: the real tokenizer holds ~0.5 GB.
        self.release_models = release_models
        self._lock = threading.Lock()
        self._result = ScanResult()

    def scan(self) -> ScanResult:
        """Re-read the folder (cheap for unchanged voices: their caches are reused)."""
        result = scan_voices(
            self.voices_dir, self.models, reserved=self.reserved, recipe=self.recipe
        )
        if self.release_models and self.models is not None:
            self.models.close()
        with self._lock:
            self._result = result
        return result

    def get(self, name: str) -> CustomVoice | None:
        with self._lock:
            return self._result.voices.get(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._result.voices)

    @property
    def rejected(self) -> dict[str, str]:
        with self._lock:
            return dict(self._result.rejected)


# --- custom voice -> engine Voice ------------------------------------------------------------


class VoiceInput(NamedTuple):
    """The engine conditioning, the official mode it follows, and the LM's text ids."""

    voice: Voice
    mode: str  # "zero_shot", "cross_lingual" or "instruct"
    text_ids: list[int] | None = None  # the segment's ids, language-tagged if cross-lingual


def _family(language: str) -> str:
    return _SAME_FAMILY.get(language, language)


def is_cross_lingual(voice: CustomVoice, text: str, language: str | None = None) -> bool:
    """True when ``text`` (in ``language``, else detected) is in another language than the
    voice's transcript."""
    return _family(language or detect_language(text)) != _family(voice.language)


@functools.lru_cache(maxsize=64)
def _prompt_ids(frontend: TextFrontend, transcript: str) -> tuple[int, ...]:
    return tuple(frontend.prompt_text_ids(transcript))


def _tagged(
    frontend: TextFrontend, text: str, text_ids: list[int] | None, language: str | None
) -> list[int] | None:
    # Official v1 cross-lingual use puts the target language tag (<|en|>, <|zh|> ...) in front
    # of the text: without a transcript it is the LM's only hint of the language to speak.
    if text_ids is None or text.lstrip().startswith("<|"):
        return text_ids
    return [frontend.tokenizer.language_id(language or detect_language(text)), *text_ids]


def to_engine_voice(
    voice: CustomVoice,
    frontend: TextFrontend,
    text: str,
    *,
    kind: str = "base",
    instruct: str | None = None,
    text_ids: list[int] | None = None,
    language: str | None = None,
) -> VoiceInput:
    """The engine ``Voice`` for speaking ``text`` (one segment) with a custom voice.

    ``language``: the text's language as the caller detected it (None: detected here).

    * zero-shot (text in the transcript's language): LM gets transcript ids + CAM++ embedding +
      prompt speech tokens; the flow gets prompt tokens + mel + embedding;
    * cross-lingual (other language): as zero-shot, minus the transcript and the LM's prompt
      tokens (the LM keeps the embedding, as the v1 LM does); ``text_ids``, when given, come
      back with the segment's language tag in front;
    * instruct (-Instruct model and an instruction, per request or ``NAME.instruct.txt``): LM
      gets the instruction and no speaker; the flow gets only the CAM++ embedding, exactly as
      official instruct mode treats a built-in speaker.
    """
    from engine.core.streaming import FlowPrompt

    if voice.family != COSYVOICE1.family:
        raise ValueError(f"voice {voice.name!r} was prepared for {voice.family}, not cosyvoice1")
    emb = voice.prompt.embedding
    instruction = instruct or voice.instruct
    if instruction and kind == "instruct":
        return VoiceInput(
            Voice(
                voice.name,
                torch.zeros(0, emb.shape[1]),
                emb,
                prompt_text_ids=frontend.instruct_ids(instruction),
            ),
            "instruct",
            text_ids,
        )
    if instruction:
        _LOGGER.debug(
            "Voice %r: instruction ignored (the %s model has no instruct mode)", voice.name, kind
        )
    flow_prompt = FlowPrompt(emb, voice.prompt.speech_tokens, voice.prompt.speech_feat)
    if is_cross_lingual(voice, text, language):
        return VoiceInput(
            Voice(voice.name, emb, emb, flow_prompt=flow_prompt),
            "cross_lingual",
            _tagged(frontend, text, text_ids, language),
        )
    return VoiceInput(
        Voice(
            voice.name,
            emb,
            emb,
            prompt_text_ids=list(_prompt_ids(frontend, voice.transcript)),
            llm_prompt_tokens=voice.prompt.speech_tokens.reshape(-1).tolist(),
            flow_prompt=flow_prompt,
        ),
        "zero_shot",
        text_ids,
    )
