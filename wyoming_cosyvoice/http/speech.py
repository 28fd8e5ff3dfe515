"""Request bodies → a checked :class:`SpeechRequest`, with the server's voices and profiles.

Both routes end here, so ``/tts`` and ``/v1/audio/speech`` refuse the same things with the same
status codes: 400 bad input, 404 unknown voice, 413 text (or body) too long. The text is split,
the voice chosen and the profile's settings taken by the speech pipeline's own stages
(:mod:`wyoming_cosyvoice.pipeline.speech`), so one request speaks the same over either protocol.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from wyoming_cosyvoice.config import (
    VOLUME_RANGE,
    ProfileConfig,
    ProfileNotLoadedError,
    ServerConfig,
    UnknownProfileError,
)
from wyoming_cosyvoice.errors import LimitExceededError, VoiceNotFoundError
from wyoming_cosyvoice.http.delivery import delivery, speaker_preset
from wyoming_cosyvoice.http.errors import HttpError
from wyoming_cosyvoice.pipeline.sentences import (
    Sentence,
    SplitterFactory,
    has_speech,
    iter_sentences,
    opening_language,
)
from wyoming_cosyvoice.pipeline.speech import (
    SpeechSettings,
    VoiceChoice,
    instruction_text,
    split_instruction,
)
from wyoming_cosyvoice.voices.catalog import Voice, VoiceCatalog
from wyoming_cosyvoice.voices.presets import INSTRUCT_MODELS, with_presets

FORMATS = ("wav", "pcm")
_MAX_SEED = 2**32 - 1
# OpenAI's built-in voice names: clients that hard-code one get the default voice for the text's
# language instead of a 404, so they work unchanged.
OPENAI_VOICES = frozenset(
    "alloy ash ballad coral echo fable nova onyx sage shimmer verse marin cedar".split()
)
TTS_FIELDS = ("text", "voice", "speaker", "profile", "seed", "stream", "format", "volume",
              "speed", "style")  # fmt: skip
# OpenAI's fields, then this server's extensions (the same as /tts).
OPENAI_FIELDS = ("model", "input", "voice", "instructions", "response_format", "speed",
                 "stream_format", "profile", "seed", "volume", "style")  # fmt: skip


@dataclass(frozen=True)
class SpeechRequest:
    """A validated request: what to say, how, and in which form to return it."""

    text: str
    sentences: Iterable[Sentence]  # split as they are taken (a long text: as it is spoken)
    voice: Voice
    voices: VoiceChoice  # for the pipeline: the same voice, already chosen
    profile: ProfileConfig
    settings: SpeechSettings
    stream: bool
    audio_format: str  # "wav" or "pcm"
    sse: bool = False  # OpenAI stream_format "sse": base64 audio in server-sent events


def max_body_bytes(config: ServerConfig) -> int:
    # Room for max_text_chars characters even when every one is a JSON \uXXXX escape.
    return config.limits.max_text_bytes


def require_json(request: Request) -> None:
    """415 unless the body is declared JSON.

    A browser sends a cross-origin ``text/plain`` or form POST without asking the server
    first (a CORS "simple request"); a JSON one needs the server's consent (a preflight).
    """
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json":
        got = repr(media) if media else "none"
        raise HttpError(415, "the body must be JSON, sent with 'Content-Type: application/json'"
                        f" (got {got})", code="unsupported_media_type")  # fmt: skip


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The body as a JSON object; 413 past ``limit`` bytes without reading the rest."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise HttpError(413, f"request body of {declared} bytes is over the limit of {limit}",
                        code="body_too_large")  # fmt: skip
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > limit:
            raise HttpError(413, f"request body is over the limit of {limit} bytes",
                            code="body_too_large")  # fmt: skip
    if not body.strip():
        raise HttpError(400, "the request needs a JSON body", code="invalid_json")
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as err:
        raise HttpError(400, _json_problem(err), code="invalid_json") from err
    if not isinstance(data, dict):
        raise HttpError(400, f"the body must be a JSON object, not {type(data).__name__}",
                        code="invalid_json")  # fmt: skip
    return data


def _json_problem(err: ValueError | RecursionError) -> str:
    """What is wrong with a body ``json.loads`` refused, in the client's terms."""
    if isinstance(err, RecursionError):
        return "the body's JSON is nested too deeply"
    if isinstance(err, UnicodeDecodeError):
        return f"the body is not UTF-8: {err.reason} at byte {err.start}"
    if isinstance(err, json.JSONDecodeError):
        return f"the body is not valid JSON: {err}"
    # Python refuses integers past its digit limit (4300 by default: a guard on CPU time).
    return "the body has an integer with more digits than the server reads"


def _too_long(err: LimitExceededError, field: str) -> HttpError:
    """An instruction over the limit, as a text over the limit is: 413."""
    return HttpError(413, str(err), code="instruction_too_long", param=field)


def _refuse_unknown(data: dict[str, Any], known: tuple[str, ...]) -> None:
    """A typo or an unsupported option is a 400 naming it, never silently dropped."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise HttpError(400, f"unknown field(s) {', '.join(unknown)}; known: "
                        f"{', '.join(known)}", param=unknown[0])  # fmt: skip


def _optional(data: dict[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise HttpError(400, f"'{key}' must be {what}, not {value!r}", param=key)
    if not isinstance(value, kind):
        raise HttpError(400, f"'{key}' must be {what}, not {value!r}", param=key)
    return value


def _volume(data: dict[str, Any]) -> float | None:
    """The request's ``volume`` (a factor on the server's loudness), if it gives one."""
    volume = _optional(data, "volume", (int, float), "a number")
    low, high = VOLUME_RANGE
    if volume is not None and not low <= volume <= high:
        raise HttpError(400, f"'volume' must be from {low:g} to {high:g} (1 = the server's "
                        f"loudness), not {volume!r}", param="volume")  # fmt: skip
    return None if volume is None else float(volume)


class SpeechParser:
    """Checks request bodies against one server's config, voices and text splitter."""

    def __init__(
        self,
        config: ServerConfig,
        catalog: Callable[[], VoiceCatalog],
        splitter_factory: SplitterFactory,
        instruction_form: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.config = config
        self._catalog = catalog  # a callable: the catalog is replaced once the model loads
        self._splitter_factory = splitter_factory
        # How the model reads an instruction (engine.api; None: it takes none).
        self._instruction_form = instruction_form

    def tts(self, data: dict[str, Any]) -> SpeechRequest:
        """``POST /tts``: {text, voice?, speaker?, profile?, seed?, stream?, format?, volume?}."""
        _refuse_unknown(data, TTS_FIELDS)
        text = self._text(data, "text")
        stream = _optional(data, "stream", bool, "true or false") or False
        audio_format = self._format(data.get("format"), "format")
        sentences = iter_sentences(text, self._splitter_factory())
        speaker, preset = speaker_preset(_optional(data, "speaker", str, "a speaker name"),
                                         self._catalog(), self.form())  # fmt: skip
        speaker, spoken = self._speaker_instruction(speaker)
        voice = self._voice(_optional(data, "voice", str, "a voice name"), speaker, text)
        speed, instruct = delivery(data, form=self.form(), default_speed=self.config.speed,
                                   preset=preset, instructions=spoken,
                                   instructions_field="speaker")  # fmt: skip
        return self._request(data, text, sentences, voice, stream=stream,
                             audio_format=audio_format, instruct=instruct,
                             speed=speed)  # fmt: skip

    def openai(self, data: dict[str, Any]) -> SpeechRequest:
        """``POST /v1/audio/speech``: {model, input, voice, response_format?, stream_format?}.

        Without ``stream_format`` the answer is one whole file (a WAV with its real sizes); with
        it, the audio is streamed as it is made. ``model`` is accepted as given.
        """
        _refuse_unknown(data, OPENAI_FIELDS)
        _optional(data, "model", str, "a string")
        text = self._text(data, "input")
        audio_format = self._format(data.get("response_format"), "response_format")
        stream_format = _optional(data, "stream_format", str, "'audio' or 'sse'")
        if stream_format not in (None, "audio", "sse"):
            raise HttpError(400, f"stream_format {stream_format!r} is not supported; use "
                            "'audio' or 'sse'", param="stream_format")  # fmt: skip
        name = _optional(data, "voice", str, "a voice name")
        if isinstance(data.get("voice"), dict):  # newer OpenAI clients: {"id": "..."}
            name = _optional(data["voice"], "id", str, "a voice id")
        if name and name.casefold() in OPENAI_VOICES and self._catalog().find(name) is None:
            name = None
        sentences = iter_sentences(text, self._splitter_factory())
        voice = self._voice(name, None, text)
        speed, instruct = delivery(data, form=self.form(), default_speed=self.config.speed,
                                   instructions=self._instructions(data), openai=True)  # fmt: skip
        return self._request(data, text, sentences, voice, stream=stream_format is not None,
                             audio_format=audio_format, sse=stream_format == "sse",
                             instruct=instruct, speed=speed)  # fmt: skip

    def _instructions(self, data: dict[str, Any]) -> str | None:
        """The instruction for a model that takes one (CosyVoice2, -Instruct); refused by any
        other (it would be ignored)."""
        instruct = _optional(data, "instructions", str, "a string")
        if instruct is None or not instruct.strip():
            return None  # clients that always send the field send it empty
        if self.form() is None:
            raise HttpError(400, f"'instructions' needs the {INSTRUCT_MODELS} model; the model "
                            "this server runs has no instruct mode",
                            code="instructions_unsupported", param="instructions")  # fmt: skip
        try:
            return instruction_text(instruct, "'instructions'")
        except LimitExceededError as err:
            raise _too_long(err, "instructions") from err

    def _speaker_instruction(self, speaker: str | None) -> tuple[str | None, str | None]:
        """(speaker left to name a voice, instruction): with a model that takes instructions,
        a speaker that names no voice is a free-text instruction, as over Wyoming."""
        if not speaker:
            return None, None
        try:
            wanted, instruction = split_instruction({"speaker": speaker}, self._catalog(),
                                                    self.form(), "'speaker'")  # fmt: skip
        except LimitExceededError as err:
            raise _too_long(err, "speaker") from err
        return wanted.get("speaker"), instruction

    # --- the shared checks ----------------------------------------------------------------

    def form(self) -> str | None:
        """How the model reads an instruction (engine.api; None: it takes none)."""
        return self._instruction_form()

    def _text(self, data: dict[str, Any], key: str) -> str:
        text = data.get(key)
        if text is None:
            raise HttpError(400, f"'{key}' is required", param=key)
        if not isinstance(text, str):
            raise HttpError(400, f"'{key}' must be a string", param=key)
        if not text.strip():
            raise HttpError(400, f"'{key}' is empty", code="empty_text", param=key)
        most = self.config.limits.max_text_chars
        if len(text) > most:
            raise HttpError(413, f"'{key}' has {len(text)} characters, over the limit of {most}",
                            code="text_too_long", param=key)  # fmt: skip
        return text

    def _profile(self, name: str | None) -> ProfileConfig:
        """The named profile (None: the server's); 400 unless its weight formats are loaded."""
        try:
            return self.config.request_profile(name)
        except UnknownProfileError as err:
            raise HttpError(400, str(err), param="profile") from err
        except ProfileNotLoadedError as err:
            raise HttpError(400, str(err), code="profile_not_loaded", param="profile") from err

    @staticmethod
    def _format(value: Any, key: str) -> str:
        if value is None:
            return "wav"
        if value not in FORMATS:
            raise HttpError(400, f"{key} {value!r} is not supported; use 'wav' or 'pcm'",
                            param=key)  # fmt: skip
        return str(value)

    def _voice(self, name: str | None, speaker: str | None, text: str) -> Voice:
        """The request's one voice: asked for, else the default, else the text's language's."""
        wanted = {k: v for k, v in (("name", name), ("speaker", speaker)) if v}
        language = opening_language(text)
        catalog = self._catalog()
        try:
            return catalog.resolve(wanted, default=self.config.voice, text_language=language)
        except VoiceNotFoundError as err:
            told = with_presets(err, wanted, catalog, self.form())
            raise HttpError(404, str(told), code="voice_not_found",
                            param="speaker" if speaker else "voice") from err  # fmt: skip

    def _request(self, data: dict[str, Any], text: str, sentences: Iterable[Sentence], voice: Voice,
                 *, stream: bool, audio_format: str, sse: bool = False,
                 instruct: str | None = None, speed: float = 1.0) -> SpeechRequest:  # fmt: skip
        profile = self._profile(_optional(data, "profile", str, "a profile name"))
        seed = _optional(data, "seed", int, "an integer")
        if seed is None:
            seed = self.config.seed
        elif not 0 <= seed <= _MAX_SEED:
            raise HttpError(400, f"'seed' must be between 0 and {_MAX_SEED}", param="seed")
        if not has_speech(text):
            raise HttpError(400, f"text {text[:40]!r} has nothing to speak", code="empty_text")
        return SpeechRequest(
            text=text,
            sentences=sentences,
            voice=voice,
            voices=VoiceChoice.chosen(voice, instruct),
            profile=profile,
            settings=SpeechSettings(
                profile, seed, self.config.force_tokens, volume=_volume(data), speed=speed
            ),
            stream=stream,
            audio_format=audio_format,
            sse=sse,
        )
