"""Voices for CosyVoice2 without recording anything: v1's built-in speakers, spoken once.

CosyVoice2 has no built-in speakers; it speaks in the voice of a prompt recording. The v1 SFT
model has seven. :func:`make_builtin_voices` has a v1 engine say one fixed sentence in each
speaker's language, writes ``NAME.wav`` + ``NAME.txt`` into a folder and extracts (and caches)
their v2 prompts there, so they become ordinary custom voices of a v2 engine under the names
users already know. It runs once, ahead of time: the folder (a few hundred kB of audio a voice,
plus the caches) can then be shipped or kept, and a v2 engine reads it like any voices folder.

Files already in the folder are never overwritten: a speaker whose name has a recording or a
transcript there is loaded as it is (its cache is made if missing).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import wave
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from engine.core.types import AudioChunk, SynthesisOptions
from engine.cosyvoice2.prompt import COSYVOICE2
from engine.family_facts import family_named
from engine.prompt.errors import VoiceError
from engine.prompt.onnx_models import PromptModels
from engine.prompt.recipe import PromptRecipe
from engine.prompt.voices import CustomVoice, load_voice, voice_names

_LOGGER = logging.getLogger(__name__)

# The v1 SFT speakers and the language each was trained to speak.
SPEAKER_LANGUAGES: dict[str, str] = {
    "中文女": "zh",
    "中文男": "zh",
    "日语男": "ja",
    "粤语女": "yue",
    "英文女": "en",
    "英文男": "en",
    "韩语女": "ko",
}
# One sentence a language, 4-6 s when spoken: long enough for a prompt, short enough to keep
# the flow's prompt cheap.
SENTENCES: dict[str, str] = {
    "zh": "今天天气真不错，我们一起去公园散散步吧。",
    "en": "The weather is lovely today, so let's take a walk in the park together.",
    "ja": "今日はとても良い天気なので、一緒に公園を散歩しましょう。",
    "yue": "今日天氣好好，不如我哋一齊去公園行下啦。",
    "ko": "오늘은 날씨가 정말 좋으니까 같이 공원에 산책하러 가요.",
}
BASE_SEED = 1986
ATTEMPTS = 3  # seeds tried before a speaker is given up (a draw can come out too short)


class SpeakerEngine(Protocol):
    """What is needed of a v1 engine: its built-in speakers and its synthesis."""

    speakers: list[str]

    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]: ...


@dataclass
class BuiltinVoices:
    """The folder's voices made from built-in speakers: ready ones and failures with reasons."""

    voices: dict[str, CustomVoice] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # recorded now (the others were there)
    failed: dict[str, str] = field(default_factory=dict)


def _write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)  # a folder scan never sees half a file
    finally:
        tmp.unlink(missing_ok=True)


def write_pcm16(path: Path, samples: np.ndarray, rate: int) -> None:
    """Mono float audio in [-1, 1] as a 16-bit PCM WAV file."""
    pcm = AudioChunk(np.asarray(samples, dtype=np.float32), rate).pcm16

    def write(target: Path) -> None:
        with wave.open(str(target), "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(rate)
            out.writeframes(pcm)

    _write_atomic(path, write)


def _speak(engine: SpeakerEngine, text: str, options: SynthesisOptions) -> tuple[np.ndarray, int]:
    chunks = list(engine.synthesize(text, options))
    if not chunks:
        raise VoiceError("the v1 engine produced no audio")
    rate = chunks[0].sample_rate
    return np.concatenate([c.samples for c in chunks]), rate


def _record(
    engine: SpeakerEngine,
    speaker: str,
    sentence: str,
    voices_dir: Path,
    models: PromptModels,
    options: SynthesisOptions,
    recipe: PromptRecipe,
) -> CustomVoice:
    """Say ``sentence`` as ``speaker`` and keep it as a voice of ``recipe``'s family;
    VoiceError if no draw works."""
    wav, txt = voices_dir / f"{speaker}.wav", voices_dir / f"{speaker}.txt"
    reason = "no attempt"
    for attempt in range(ATTEMPTS):
        seed = BASE_SEED + attempt
        audio, rate = _speak(
            engine, sentence, dataclasses.replace(options, speaker=speaker, seed=seed)
        )
        _write_atomic(txt, lambda target: target.write_text(sentence + "\n", encoding="utf-8"))
        write_pcm16(wav, audio, rate)
        try:
            return load_voice(voices_dir, speaker, models, recipe)
        except VoiceError as err:
            reason = str(err)
            _LOGGER.info("Voice %r, seed %d: %s; trying again", speaker, seed, reason)
            for path in (wav, txt, voices_dir / f"{speaker}{recipe.cache_suffix}"):
                path.unlink(missing_ok=True)
    raise VoiceError(f"no usable recording after {ATTEMPTS} attempts ({reason})")


def make_builtin_voices(
    engine: SpeakerEngine,
    voices_dir: Path | str,
    models: PromptModels,
    *,
    speakers: Iterable[str] | None = None,
    languages: Mapping[str, str] | None = None,
    options: SynthesisOptions | None = None,
    recipe: PromptRecipe = COSYVOICE2,
) -> BuiltinVoices:
    """Turn the v1 engine's built-in speakers into voices of ``recipe``'s family (default
    CosyVoice2) in ``voices_dir``.

    ``models``: that family's prompt models (:func:`engine.cosyvoice2.prompt.prompt_models`);
    checked first (PromptModelError), so nothing is synthesised when they cannot run. ``speakers``
    (default: all of the engine's) need a language in ``languages`` (default
    :data:`SPEAKER_LANGUAGES`). ``options``: synthesis settings (speaker and seed are set
    here; streaming is off). Failures are logged and listed, not raised.
    """
    if models.kind != recipe.tokenizer:
        raise ValueError(
            f"{models.tokenizer_path.name} is not the {family_named(recipe.family).label} "
            "speech tokenizer"
        )
    models.check()
    voices_dir = Path(voices_dir)
    voices_dir.mkdir(parents=True, exist_ok=True)
    languages = SPEAKER_LANGUAGES if languages is None else languages
    options = dataclasses.replace(options or SynthesisOptions(), stream=False)
    result = BuiltinVoices()
    present = set(voice_names(voices_dir))  # any recording or transcript, whatever its case
    for speaker in engine.speakers if speakers is None else speakers:
        try:
            if speaker not in engine.speakers:
                raise VoiceError("the v1 model has no such speaker")
            if speaker in present:
                result.voices[speaker] = load_voice(voices_dir, speaker, models, recipe)
                continue
            language = languages.get(speaker)
            if language not in SENTENCES:
                raise VoiceError(f"no sentence for its language ({language or 'unknown'})")
            voice = _record(
                engine, speaker, SENTENCES[language], voices_dir, models, options, recipe
            )
            result.voices[speaker] = voice
            result.made.append(speaker)
            _LOGGER.info(
                "Voice %r recorded: %.1f s, %d prompt tokens",
                speaker,
                voice.duration_s,
                voice.prompt.speech_tokens.shape[1],
            )
        except VoiceError as err:
            result.failed[speaker] = str(err)
            _LOGGER.warning("Built-in voice %r not made: %s", speaker, err)
    return result
