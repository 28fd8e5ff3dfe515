"""The Starlette app: routes over the server's
:class:`~wyoming_cosyvoice.pipeline.scheduler.Scheduler`.

``POST /tts`` and ``POST /v1/audio/speech`` validate the body (:mod:`.speech`), then wait for
the first audio before answering: an error found before any audio is sent (unknown speaker,
text the frontend refuses) still gets its JSON status code, and a streamed answer then starts
with the WAV header and that first chunk. Nothing here runs inference on the event loop; the
scheduler runs every engine call on its engine thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from engine.core.types import EngineError
from engine.core.types import UnknownSpeakerError as EngineUnknownSpeaker
from engine.text.errors import TextInputError
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.custom_voices.folder import CustomVoices
from wyoming_cosyvoice.errors import ClientError, ServerBusyError
from wyoming_cosyvoice.http.errors import (
    HttpError,
    http_error_handler,
    starlette_error_handler,
)
from wyoming_cosyvoice.http.metrics import counting_errors, metrics_routes
from wyoming_cosyvoice.http.origin import origin_middleware
from wyoming_cosyvoice.http.speech import (
    SpeechParser,
    SpeechRequest,
    max_body_bytes,
    read_json,
    require_json,
)
from wyoming_cosyvoice.http.stream import (
    CUT_MESSAGE,
    SpeechJob,
    SpeechResponse,
    WholeAudioResponse,
    first_piece,
)
from wyoming_cosyvoice.http.voice_maker import voice_maker_routes
from wyoming_cosyvoice.pipeline.scheduler import Scheduler
from wyoming_cosyvoice.pipeline.sentences import SplitterFactory, make_splitter
from wyoming_cosyvoice.pipeline.speech import Speech
from wyoming_cosyvoice.voices.presets import speaker_names

_LOGGER = logging.getLogger(__name__)
# The page's icon: a speech bubble, inline so an install without package data still has it.
FAVICON = (
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 32 32">'
    '<path fill="#1565c0" d="M4 4h24a2 2 0 0 1 2 2v15a2 2 0 0 1-2 2H13l-7 6v-6H4a2 2 0 0 1-2-2'
    'V6a2 2 0 0 1 2-2z"/><path stroke="#fff" stroke-width="2.5" stroke-linecap="round" '
    'd="M10 11v5M14 9v9M18 11v5M22 12v3"/></svg>'
)


def _page() -> str:
    try:
        return (resources.files("wyoming_cosyvoice") / "static" / "index.html").read_text("utf-8")
    except OSError:  # an install without package data still serves the API
        return "<!doctype html><title>CosyVoice</title><p>The web page is not installed."


def engine_error(err: BaseException) -> HttpError:
    """The status code for an error the synthesis raised before any audio was sent."""
    if isinstance(err, EngineUnknownSpeaker):
        return HttpError(404, str(err), code="voice_not_found", param="voice")
    if isinstance(err, TextInputError):
        return HttpError(400, f"the text cannot be spoken: {err}", code="text_error")
    if isinstance(err, ServerBusyError):
        return HttpError(503, str(err), code="not_ready", headers={"Retry-After": "5"})
    if isinstance(err, ClientError):
        return HttpError(400, str(err), code=err.code)
    if isinstance(err, EngineError):
        return HttpError(500, f"synthesis failed: {err or type(err).__name__}",
                         code="synthesis_failed")  # fmt: skip
    _LOGGER.error("Synthesis failed", exc_info=err)
    return HttpError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error")


def _cut_error() -> HttpError:
    return HttpError(503, CUT_MESSAGE, code="synthesis_cancelled", headers={"Retry-After": "5"})


class TtsRoutes:
    """Handlers bound to one config and one scheduler."""

    def __init__(self, config: ServerConfig, scheduler: Scheduler,
                 splitter_factory: SplitterFactory) -> None:  # fmt: skip
        self.config, self.scheduler = config, scheduler
        self.parser = SpeechParser(config, lambda: scheduler.catalog, splitter_factory,
                                   lambda: scheduler.instruction_form)  # fmt: skip
        self.page = _page()

    # --- state ----------------------------------------------------------------------------

    def status(self) -> tuple[str, str | None]:
        """("ready" | "loading" | "failed", the load error)."""
        ready = self.scheduler.ready
        if not ready.done():
            return "loading", None
        if ready.cancelled():
            return "failed", "loading was cancelled"
        err = ready.exception()
        return ("failed", f"{type(err).__name__}: {err}") if err else ("ready", None)

    def require_ready(self) -> None:
        state, error = self.status()
        if state == "loading":
            raise HttpError(503, "the model is still loading; try again in a few seconds",
                            code="not_ready", headers={"Retry-After": "5"})  # fmt: skip
        if state == "failed":
            raise HttpError(503, f"the model failed to load: {error}", code="load_failed")

    # --- routes ---------------------------------------------------------------------------

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.page)

    async def favicon(self, request: Request) -> Response:
        return Response(FAVICON, media_type="image/svg+xml",
                        headers={"Cache-Control": "max-age=86400"})  # fmt: skip

    async def health(self, request: Request) -> Response:
        state, error = self.status()
        body: dict[str, Any] = {
            "status": state,
            "model": self.config.model,
            "voices": len(self.scheduler.catalog.voices),
            "queued": self.scheduler.waiting,
        }
        if error:
            body["error"] = error
        # What the engine chose for this CPU: int8 kernels, native bfloat16, thread ceiling.
        engine = self.scheduler.ready.result() if state == "ready" else None
        choices = engine.cpu_choices if engine is not None else None
        if choices is not None:
            body["cpu"] = choices.as_dict()
        if state == "ready":
            # Threads per step follow the cores other processes leave free
            # (engine.core.thread_budget).
            from engine.core.thread_budget import thread_report

            body["threads"] = thread_report()
        if self.scheduler.auto is not None:  # the measured stage costs and the last choice
            body["auto"] = self.scheduler.auto.report()
        return JSONResponse(body, status_code=200 if state == "ready" else 503)

    async def voices(self, request: Request) -> Response:
        catalog = self.scheduler.catalog
        return JSONResponse({
            "voices": [
                {"name": v.name, "speaker": v.speaker, "languages": list(v.languages),
                 "description": v.description}
                for v in catalog.voices
            ],
            "default": self.config.voice,
            # speeds and styles, per request
            "speakers": speaker_names(self.scheduler.instruction_form),
            "speed": self.config.speed,
            "profiles": self.config.servable_profiles,
            "default_profile": self.config.profile.name,
            "sample_rate": self.scheduler.sample_rate,
            "ready": self.status()[0] == "ready",
        })  # fmt: skip

    async def pronunciations(self, request: Request) -> Response:
        """The settings' pronunciations and how each fares with the loaded model."""
        self.require_ready()
        return JSONResponse({
            "pronunciations": [
                {"line": c.line, "word": c.word, "said_as": c.spoken_as, "problem": c.problem}
                for c in self.scheduler.pronunciation_checks
            ],
        })  # fmt: skip

    async def tts(self, request: Request) -> Response:
        with counting_errors(self.scheduler.metrics):
            return await self._speak(request, self.parser.tts)

    async def openai_speech(self, request: Request) -> Response:
        with counting_errors(self.scheduler.metrics):
            return await self._speak(request, self.parser.openai)

    async def _speak(
        self, request: Request, parse: Callable[[dict[str, Any]], SpeechRequest]
    ) -> Response:
        require_json(request)
        data = await read_json(request, max_body_bytes(self.config))
        self.require_ready()
        speech = parse(data)
        job = SpeechJob(self._speech(speech, request), speech)
        job.start(request.receive)
        try:
            first = await first_piece(job)
        except Exception as err:  # each becomes a JSON error
            raise engine_error(err) from err
        if job.cut:  # before any audio: the status code can still say so
            job.stop()
            raise _cut_error()
        if speech.stream:
            return SpeechResponse(job, first)
        try:
            audio = await job.read_whole(first)
        except Exception as err:
            raise engine_error(err) from err
        finally:
            job.stop()
        if job.cut:  # a whole answer is whole, or it is no answer
            audio.close()
            raise _cut_error()
        return WholeAudioResponse(audio, speech, job.speech.sample_rate)

    def _speech(self, speech: SpeechRequest, request: Request) -> Speech:
        """The request's sentences, fed to the speech pipeline."""
        client = f"{request.client.host if request.client else 'a client'} over HTTP"
        spoken = Speech(self.scheduler, speech.settings, speech.voices, self.config.limits,
                        client=client, front_end="http")  # fmt: skip
        spoken.say_all(speech.sentences, speech.text)  # split as spoken
        spoken.end()
        return spoken


def create_app(
    config: ServerConfig,
    scheduler: Scheduler,
    *,
    splitter_factory: SplitterFactory = make_splitter,
    allow_origins: tuple[str, ...] = (),
    custom_voices: CustomVoices | None = None,
) -> Starlette:
    """The HTTP API over ``scheduler`` (which the caller starts loading and shuts down).

    ``allow_origins``: web-page origins besides the server's own that may call the API
    (normalised by :func:`.origin.parse_allowed_origins`; ``*`` = any). ``custom_voices``: the
    voices folder the page's voice maker saves into (None: no folder).
    """
    routes = TtsRoutes(config, scheduler, splitter_factory)
    app = Starlette(
        routes=[
            Route("/", routes.index, methods=["GET"]),
            Route("/favicon.ico", routes.favicon, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/voices", routes.voices, methods=["GET"]),
            Route("/pronunciations", routes.pronunciations, methods=["GET"]),
            Route("/tts", routes.tts, methods=["POST"]),
            Route("/v1/audio/speech", routes.openai_speech, methods=["POST"]),
            *metrics_routes(config, scheduler),
            *voice_maker_routes(config, scheduler, custom_voices),
        ],
        middleware=origin_middleware(allow_origins),
        exception_handlers={
            HttpError: http_error_handler,
            HTTPException: starlette_error_handler,
        },
    )
    app.state.routes = routes
    return app
