"""One HTTP synthesis: the speech pipeline's audio → the response body.

A :class:`SpeechJob` reads one :class:`~wyoming_cosyvoice.pipeline.speech.Speech` (which speaks its
sentences through the shared scheduler: HTTP and Wyoming requests take one fair queue) and
hands its PCM to the response in order, telling the speech what was taken: the pipeline's
backpressure and stalled-client drop then hold for HTTP as for Wyoming. A client that
disconnects cancels its synthesis within one chunk. A whole file (not streamed) is gathered
in a :class:`WholeAudio`, on disk past a few megabytes: a long announcement asked for as one
WAV is not held, nor copied, in memory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import struct
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextvars import ContextVar
from typing import Any
from urllib.parse import quote

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.core.types import SynthesisCancelled
from wyoming_cosyvoice.http.errors import error_body
from wyoming_cosyvoice.http.speech import SpeechRequest
from wyoming_cosyvoice.pipeline.speech import WIDTH, Audio, Speech

_LOGGER = logging.getLogger(__name__)
# What a client still reading is told of a cut answer: the server is stopping (a client that
# left or stopped reading is not told anything).
CUT_MESSAGE = ("the server stopped this synthesis before the end of the text (it is shutting "
               "down); the answer is incomplete")  # fmt: skip
# Set in the task of a response whose body this module ends early on purpose: Uvicorn then
# reports an incomplete response, which is the point here, not a fault (serve.py).
BODY_CUT: ContextVar[bool] = ContextVar("http_body_cut", default=False)
CHANNELS = 1
_UNKNOWN = 0xFFFFFFFF  # RIFF/data size of a stream whose length is not known yet
SPOOL_MEMORY_BYTES = 8 << 20  # a whole file's audio past this waits on disk (3 min at 22 kHz)
_READ_BYTES = 1 << 16  # a whole file is sent in pieces of this size


def wav_header(data_bytes: int | None, sample_rate: int) -> bytes:
    """A 44-byte PCM WAV header; ``None`` = unknown length (the streaming convention)."""
    riff = _UNKNOWN if data_bytes is None else 36 + data_bytes
    data = _UNKNOWN if data_bytes is None else data_bytes
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, CHANNELS, sample_rate,
        sample_rate * CHANNELS * WIDTH, CHANNELS * WIDTH, WIDTH * 8, b"data", data,
    )  # fmt: skip


def header_text(value: str) -> str:
    """``value`` as a header can carry it: UTF-8, percent-encoded (RFC 3986). A voice may be
    named in any script, and header values are Latin-1 bytes; letters, digits and ``-_.~``
    stay as they are, so an ASCII name reads unchanged. Decode with ``decodeURIComponent``
    (JavaScript) or ``urllib.parse.unquote`` (Python)."""
    return quote(value, safe="")


def audio_headers(request: SpeechRequest, sample_rate: int) -> dict[str, str]:
    return {
        "X-Sample-Rate": str(sample_rate),
        "X-Sample-Width": str(WIDTH),
        "X-Channels": str(CHANNELS),
        "X-Voice": header_text(request.voice.name),
        "X-Profile": header_text(request.profile.name),
        "Cache-Control": "no-store",
    }


def media_type(request: SpeechRequest, sample_rate: int) -> str:
    if request.sse:
        return "text/event-stream"
    if request.audio_format == "pcm":
        return f"audio/pcm;rate={sample_rate};channels={CHANNELS};bits={WIDTH * 8}"
    return "audio/wav"


class SpeechJob:
    """The PCM of one request's speech, in order, for the response.

    ``cut``: the speech ended before the end of its text (cancelled: a shutdown, the client
    leaving); the answer must then say it is incomplete, never end as if it were whole.
    """

    def __init__(self, speech: Speech, request: SpeechRequest) -> None:
        self.speech, self.request, self.limits = speech, request, speech.limits
        self._watcher: asyncio.Task[None] | None = None
        self.cut = False

    @property
    def cancel(self) -> Any:
        """The speech's cancel event (set once the synthesis was stopped)."""
        return self.speech.cancel_event

    @property
    def stalled(self) -> bool:
        return self.speech.stalled

    def start(self, receive: Receive | None = None) -> None:
        """Start synthesizing; with ``receive``, a client disconnect cancels the job."""
        self.speech.start()
        if receive is not None:
            self._watcher = asyncio.create_task(self._watch(receive), name="http disconnect")

    def stop(self) -> None:
        """Cancel (idempotent): the engine stops within one chunk, a queued job never starts."""
        self.speech.cancel()
        if self._watcher is not None and not self._watcher.done():
            self._watcher.cancel()

    async def next(self) -> bytes | None:
        """The next piece of PCM, ``None`` at the end; re-raises the synthesis error."""
        while True:
            try:
                event = await self.speech.next()
            except SynthesisCancelled:
                self.cut = True
                return None
            if event is None:
                # A cancelled engine may stop without raising: the event tells.
                self.cut = self.cut or self.cancel.is_set()
                return None
            if isinstance(event, Audio):
                self.speech.delivered(event.samples)  # taken by the response
                return event.pcm

    async def read_whole(self, first: bytes | None) -> WholeAudio:
        """All the PCM, starting with ``first`` (the piece the route already awaited)."""
        audio = WholeAudio()
        try:
            piece = first
            while piece is not None:
                audio.write(piece)
                piece = await self.next()
        except BaseException:
            audio.close()
            raise
        return audio

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self.speech.finished:
            _LOGGER.info("HTTP client left; cancelling its synthesis")
        self.stop()


class SpeechResponse(StreamingResponse):
    """Chunked audio: WAV header (unknown length) or nothing for PCM, then PCM as produced;
    or server-sent events.

    ``first`` is the job's first PCM piece, already awaited by the route so that errors found
    before any audio (unknown speaker, text the frontend refuses) still get a JSON status code.
    An answer cut after that (a synthesis failure, a shutdown) never ends as a whole one does:
    audio ends without the chunked stream's terminating chunk, which every HTTP client reports
    as an incomplete response; events end with an ``error`` event instead of
    ``speech.audio.done``.
    """

    def __init__(self, job: SpeechJob, first: bytes | None) -> None:
        self.job = job
        self._first = first
        request, rate = job.request, job.speech.sample_rate
        super().__init__(self._body(), media_type=media_type(request, rate),
                         headers=audio_headers(request, rate))  # fmt: skip

    async def _body(self) -> AsyncIterator[bytes]:
        request, job = self.job.request, self.job
        if request.sse:
            async for event in self._events():
                yield event
            return
        if request.audio_format == "wav":
            yield wav_header(None, job.speech.sample_rate)
        async for piece in self._pieces():
            yield piece
        if job.cut:
            raise ConnectionAbortedError("synthesis cancelled")  # no terminating chunk

    async def _events(self) -> AsyncIterator[bytes]:
        """Server-sent events: the audio, then ``speech.audio.done`` only if it is whole."""
        request = self.job.request
        try:
            async for piece in self._pieces():
                yield _sse({"type": "speech.audio.delta",
                            "audio": base64.b64encode(piece).decode("ascii")})  # fmt: skip
        except Exception as err:  # the status line is gone: the error becomes an event
            self._failed(err)
            yield _sse_error(500, f"synthesis failed: {err or type(err).__name__}",
                             "synthesis_failed")  # fmt: skip
            return
        if self.job.cut:
            _LOGGER.info("HTTP event stream ended early: synthesis cancelled")
            yield _sse_error(503, CUT_MESSAGE, "synthesis_cancelled")
            return
        yield _sse({"type": "speech.audio.done",
                    "usage": {"input_tokens": len(request.text), "output_tokens": 0,
                              "total_tokens": len(request.text)}})  # fmt: skip

    def _failed(self, err: BaseException) -> None:
        _LOGGER.error("Synthesis failed mid-stream: %s: %s", type(err).__name__, err)
        self.job.speech.scheduler.metrics.error_sent("http", "synthesis_failed")

    async def _pieces(self) -> AsyncIterator[bytes]:
        piece: bytes | None = self._first
        while piece is not None:
            yield piece
            piece = await self.job.next()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The job's own watcher already listens for the disconnect: Starlette's must not also
        # consume receive(). The job is stopped however the response ends. Returning without
        # the final body message makes Uvicorn close the connection with the body incomplete.
        task = asyncio.current_task()
        self.job.speech.on_stall = task.cancel if task is not None else None
        try:
            await self.stream_response(send)
        except OSError as err:
            BODY_CUT.set(True)
            _LOGGER.info("HTTP stream ended early: %s", err)
        except asyncio.CancelledError:
            if not self.job.stalled or task is None:
                raise
            if sys.version_info >= (3, 11):  # before 3.11 a caught cancellation leaves no count
                task.uncancel()
            BODY_CUT.set(True)
            _LOGGER.warning("HTTP client stopped reading for %.0f s; dropping it",
                            self.job.limits.stall_timeout_s)  # fmt: skip
        except Exception as err:  # the status line is gone: log, cut the body
            BODY_CUT.set(True)
            self._failed(err)
        finally:
            self.job.stop()


class WholeAudio:
    """A whole answer's PCM as it is made: in memory up to :data:`SPOOL_MEMORY_BYTES`, in a
    temporary file past that."""

    def __init__(self) -> None:
        self._file = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY_BYTES)
        self.size = 0

    def write(self, pcm: bytes) -> None:
        self._file.write(pcm)
        self.size += len(pcm)

    def pieces(self) -> Iterator[bytes]:
        self._file.seek(0)
        while piece := self._file.read(_READ_BYTES):
            yield piece

    @property
    def on_disk(self) -> bool:
        return bool(getattr(self._file, "_rolled", False))

    def close(self) -> None:
        self._file.close()


class WholeAudioResponse(StreamingResponse):
    """A whole file with its real sizes (WAV header and Content-Length), sent from a
    :class:`WholeAudio` in pieces; the audio's file is closed however the response ends."""

    def __init__(self, audio: WholeAudio, request: SpeechRequest, sample_rate: int) -> None:
        header = wav_header(audio.size, sample_rate) if request.audio_format == "wav" else b""
        headers = audio_headers(request, sample_rate)
        headers["Content-Length"] = str(len(header) + audio.size)
        super().__init__(self._body(header, audio), media_type=media_type(request, sample_rate),
                         headers=headers)  # fmt: skip

    @staticmethod
    async def _body(header: bytes, audio: WholeAudio) -> AsyncIterator[bytes]:
        try:
            if header:
                yield header
            for piece in audio.pieces():
                yield piece
        finally:
            audio.close()


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _sse_error(status: int, message: str, code: str) -> bytes:
    """An ``error`` event: the error object of a refusal with that status (errors.py)."""
    return _sse({"type": "error", "error": error_body(status, message, code)})


async def first_piece(job: SpeechJob) -> bytes | None:
    """Await the first PCM piece; on any error the job is stopped and the error re-raised."""
    try:
        return await job.next()
    except BaseException:
        with contextlib.suppress(Exception):
            job.stop()
        raise
