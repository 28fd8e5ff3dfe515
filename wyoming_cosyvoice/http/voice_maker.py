"""The web page's voice maker: check a recording, transcribe it, save it as a custom voice.

Routes (docs/http-api.md), each taking and giving JSON; audio travels as a base64 WAV:

* ``GET /voices/maker``: what this server offers (a voices folder, saving into it, speech-to-text,
  the reload of Home Assistant's Wyoming entry) and the recording limits;
* ``POST /voices/check``: the quality check
  (:mod:`wyoming_cosyvoice.custom_voices.voice_check`), 422 with the reason when the clip would
  make a poor voice;
* ``POST /voices/transcribe``: the clip's words from the Wyoming speech-to-text server
  (:mod:`wyoming_cosyvoice.custom_voices.stt`);
* ``POST /voices/custom``: save ``NAME.wav`` + ``NAME.txt`` into the voices folder
  (:mod:`wyoming_cosyvoice.custom_voices.new_voice`), ask for a scan at once and answer with the
  voice's state (201, or 202 while the scan is still running). Only with ``server.web_voice_maker``
  (``--web-voice-maker``; the add-on's page is behind Home Assistant's login): otherwise anyone
  who can reach the port could add files to the folder;
* ``GET /voices/custom/{name}``: a saved voice's state: offered, rejected (why) or waiting;
* ``POST /voices/home-assistant/reload``: reload Home Assistant's Wyoming entry, so that it lists
  the new voice (:mod:`wyoming_cosyvoice.home_assistant.supervisor`).

Decoding, measuring and writing run in threads; the scan runs on the engine thread in the queue's
turn, as every scan does. The page's script is ``static/voice-maker.js``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import re
from importlib import resources
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.custom_voices.folder import CustomVoices
from wyoming_cosyvoice.custom_voices.new_voice import (
    BadTranscript,
    VoiceExists,
    check_transcript,
    file_of_voice,
    save_voice,
)
from wyoming_cosyvoice.custom_voices.stt import SpeechToTextError, transcribe
from wyoming_cosyvoice.custom_voices.voice_check import (
    MAX_SECONDS,
    MIN_SECONDS,
    CheckedRecording,
    RecordingRejected,
    UnreadableAudio,
    check_recording,
)
from wyoming_cosyvoice.home_assistant.supervisor import HomeAssistantApi, HomeAssistantError
from wyoming_cosyvoice.http.errors import HttpError
from wyoming_cosyvoice.http.speech import read_json, require_json
from wyoming_cosyvoice.pipeline.scheduler import Scheduler
from wyoming_cosyvoice.voices.catalog import Voice
from wyoming_cosyvoice.voices.names import BadVoiceName, check_name

_LOGGER = logging.getLogger(__name__)

MAX_AUDIO_BYTES = 16 * 1024 * 1024  # 30 s of 48 kHz stereo 24-bit is 8.6 MB
MAX_BODY_BYTES = MAX_AUDIO_BYTES * 4 // 3 + 64 * 1024  # base64, the name and the transcript
SCAN_WAIT_S = 30.0  # a save answers 202 (waiting) when the scan takes longer
_LANGUAGE = re.compile(r"[a-z]{2,3}")
SCRIPTS = ("voice-maker.js",)  # the page's script for this section, served next to the page


def _fields(data: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()
            ) -> None:  # fmt: skip
    known = (*required, *optional)
    if unknown := sorted(set(data) - set(known)):
        raise HttpError(400, f"unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}",
                        param=unknown[0])  # fmt: skip
    for key in (*required, *(k for k in optional if k in data)):
        if not isinstance(data.get(key), str):
            raise HttpError(400, f"'{key}' must be a string", param=key)


def _audio(data: dict[str, Any]) -> bytes:
    """The WAV bytes of the ``audio`` field (base64, a data: URL prefix allowed)."""
    text = data["audio"]
    if text.startswith("data:"):
        text = text.partition(",")[2]
    try:
        wav = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as err:
        raise HttpError(400, "'audio' must be a WAV file in base64", code="invalid_audio",
                        param="audio") from err  # fmt: skip
    if not wav:
        raise HttpError(400, "'audio' is empty", code="invalid_audio", param="audio")
    if len(wav) > MAX_AUDIO_BYTES:
        raise HttpError(413, f"the recording is {len(wav)} bytes; the limit is "
                        f"{MAX_AUDIO_BYTES} bytes", code="audio_too_large",
                        param="audio")  # fmt: skip
    return wav


def _taken(name: str, voice: Voice) -> str:
    if name.casefold() in (voice.name.casefold(), voice.speaker.casefold()):
        return f"the name {name!r} is taken by the voice {voice.name!r}; choose another"
    return (f"the name {name!r} looks the same as the voice {voice.name!r} (names are compared "
            "without case, and letters that look alike count as one); choose another")  # fmt: skip


async def _checked(wav: bytes) -> CheckedRecording:
    try:
        return await asyncio.to_thread(check_recording, wav)
    except UnreadableAudio as err:
        raise HttpError(415, str(err), code="unsupported_audio", param="audio") from err
    except RecordingRejected as err:
        raise HttpError(422, str(err), code=err.reason, param="audio") from err


class VoiceMakerRoutes:
    """Handlers bound to one server's config, scheduler and voices folder."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler,
                 custom_voices: CustomVoices | None,
                 home_assistant: HomeAssistantApi | None) -> None:  # fmt: skip
        self.config, self.scheduler = config, scheduler
        self.custom_voices, self.home_assistant = custom_voices, home_assistant
        self._saving = asyncio.Lock()  # one save at a time: the name check and the write

    def routes(self) -> list[Route]:
        return [
            Route("/voices/maker", self.info, methods=["GET"]),
            Route("/voices/check", self.check, methods=["POST"]),
            Route("/voices/transcribe", self.transcribe, methods=["POST"]),
            Route("/voices/custom", self.save, methods=["POST"]),
            Route("/voices/custom/{name}", self.state, methods=["GET"]),
            Route("/voices/home-assistant/reload", self.reload_home_assistant, methods=["POST"]),
            *(Route(f"/{name}", self.script, methods=["GET"]) for name in SCRIPTS),
        ]

    async def _body(self, request: Request) -> dict[str, Any]:
        require_json(request)
        return await read_json(request, MAX_BODY_BYTES)

    def _folder_voices(self) -> CustomVoices:
        if self.custom_voices is None:
            raise HttpError(409, "this server has no voices folder: start it with --voices-dir "
                            "DIR (the add-on always has one)", code="no_voices_folder")  # fmt: skip
        return self.custom_voices

    def _saving_voices(self) -> CustomVoices:
        voices = self._folder_voices()
        ready = self.scheduler.ready
        if ready.done() and (ready.cancelled() or ready.exception() is not None):
            # no scan will ever offer the voice: say so instead of leaving it waiting
            raise HttpError(503, "the model failed to load, so no voice can be made; the "
                            "server's log says why", code="load_failed")  # fmt: skip
        if not self.config.web_voice_maker:
            raise HttpError(403, "saving voices from the web page is off on this server: start "
                            "it with --web-voice-maker to allow it", code="saving_off")  # fmt: skip
        return voices

    # --- routes ---------------------------------------------------------------------------

    async def info(self, request: Request) -> Response:
        return JSONResponse({
            "voices_folder": self.custom_voices is not None,
            "saving": self.custom_voices is not None and self.config.web_voice_maker,
            "speech_to_text": self.config.stt_uri is not None,
            "home_assistant": self.home_assistant is not None,
            "min_seconds": MIN_SECONDS,
            "max_seconds": MAX_SECONDS,
            "max_audio_bytes": MAX_AUDIO_BYTES,
        })  # fmt: skip

    async def check(self, request: Request) -> Response:
        data = await self._body(request)
        _fields(data, ("audio",))
        checked = await _checked(_audio(data))
        return JSONResponse(checked.report.as_dict())

    async def transcribe(self, request: Request) -> Response:
        data = await self._body(request)
        _fields(data, ("audio",), ("language",))
        uri = self.config.stt_uri
        if uri is None:
            raise HttpError(409, "no speech-to-text server is configured (server.stt_uri, the "
                            "add-on option stt_uri)", code="no_speech_to_text")  # fmt: skip
        language = data.get("language") or None
        if language is not None and not _LANGUAGE.fullmatch(language):
            raise HttpError(400, f"'language' must be a language code such as en or zh, not "
                            f"{language!r}", param="language")  # fmt: skip
        checked = await _checked(_audio(data))
        try:
            text = await transcribe(uri, checked.audio_16k, language)
        except SpeechToTextError as err:
            _LOGGER.warning("Transcribing a new voice failed: %s", err)
            raise HttpError(502, str(err), code="speech_to_text_failed") from err
        return JSONResponse({"transcript": text})

    async def save(self, request: Request) -> Response:
        data = await self._body(request)
        _fields(data, ("name", "transcript", "audio"))
        voices = self._saving_voices()
        try:
            name, transcript = check_name(data["name"]), check_transcript(data["transcript"])
        except BadVoiceName as err:
            raise HttpError(400, str(err), code="bad_name", param="name") from err
        except BadTranscript as err:
            raise HttpError(400, str(err), code="bad_transcript", param="transcript") from err
        wav = _audio(data)
        await _checked(wav)
        async with self._saving:
            if (voice := self.scheduler.catalog.find(name)) is not None:
                raise HttpError(409, _taken(name, voice), code="voice_exists",
                                param="name")  # fmt: skip
            try:
                await asyncio.to_thread(save_voice, voices.voices_dir, name, transcript, wav)
            except VoiceExists as err:
                raise HttpError(409, str(err), code="voice_exists", param="name") from err
            except OSError as err:
                raise HttpError(500, f"cannot write the voice into {voices.voices_dir}: "
                                f"{err.strerror or err}", code="cannot_write") from err  # fmt: skip
        _LOGGER.info("Custom voice %r saved from the web page (%d bytes of audio)", name, len(wav))
        try:
            await asyncio.wait_for(asyncio.shield(voices.rescan()), SCAN_WAIT_S)
        except asyncio.TimeoutError:
            pass  # still scanning (or downloading the prompt models): the page asks again
        return self._state_response(voices, name, created=True)

    async def state(self, request: Request) -> Response:
        voices = self._folder_voices()
        name = request.path_params["name"]
        found = await asyncio.to_thread(file_of_voice, voices.voices_dir, name)
        if found is None:
            raise HttpError(404, f"the voices folder has no voice {name!r}",
                            code="voice_not_found", param="name")  # fmt: skip
        return self._state_response(voices, found.split(".")[0])  # as the folder spells it

    def _state_response(self, voices: CustomVoices, name: str, created: bool = False
                        ) -> Response:  # fmt: skip
        state, reason = voices.state(name)
        status = (202 if state == "waiting" else 201) if created else 200
        return JSONResponse({"name": name, "state": state, "reason": reason}, status_code=status)

    async def reload_home_assistant(self, request: Request) -> Response:
        if self.home_assistant is None:
            raise HttpError(409, "this server cannot reach Home Assistant's API (only the add-on "
                            "can); reload the Wyoming integration in Home Assistant instead",
                            code="no_home_assistant")  # fmt: skip
        try:
            titles = await asyncio.to_thread(self.home_assistant.reload_wyoming_entries)
        except HomeAssistantError as err:
            raise HttpError(502, str(err), code="home_assistant_failed") from err
        if not titles:
            raise HttpError(404, "Home Assistant has no Wyoming entry named CosyVoice; reload "
                            "yours in Settings → Devices & services → Wyoming Protocol",
                            code="no_wyoming_entry")  # fmt: skip
        _LOGGER.info("Reloaded Home Assistant's Wyoming entry %s", ", ".join(titles))
        return JSONResponse({"reloaded": titles})

    async def script(self, request: Request) -> Response:
        name = request.url.path.rsplit("/", 1)[-1]
        try:
            text = (resources.files("wyoming_cosyvoice") / "static" / name).read_text("utf-8")
        except OSError as err:
            raise HttpError(404, f"{name} is not installed", code="not_found") from err
        return Response(text, media_type="text/javascript")


def voice_maker_routes(config: ServerConfig, scheduler: Scheduler,
                       custom_voices: CustomVoices | None) -> list[Route]:  # fmt: skip
    """The voice maker's routes; Home Assistant's API when running as an add-on allowed it."""
    routes = VoiceMakerRoutes(config, scheduler, custom_voices, HomeAssistantApi.from_environment())
    return routes.routes()
