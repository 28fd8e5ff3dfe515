"""One HTTP synthesis: the shared engine's chunks → a queue → the response body.

A :class:`SpeechJob` speaks its sentences through :meth:`ModelHost.synthesize`, which takes the
host's FIFO lock once per sentence: HTTP and Wyoming requests share one engine and one fair
queue. Chunks are queued without waiting while a sentence is synthesized (the engine is never
held by a slow reader); between sentences the job waits while more than
``max_buffered_audio_s`` of audio is unread, and gives up after ``stall_timeout_s``, as the
Wyoming handler does. A client that disconnects cancels its synthesis within one chunk.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import struct
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.constants import SAMPLE_RATE
from engine.types import AudioChunk, SynthesisCancelled
from wyoming_cosyvoice.config import Limits
from wyoming_cosyvoice.http.speech import SpeechRequest
from wyoming_cosyvoice.server import ModelHost

_LOGGER = logging.getLogger(__name__)
WIDTH, CHANNELS = 2, 1
_UNKNOWN = 0xFFFFFFFF  # RIFF/data size of a stream whose length is not known yet


def wav_header(data_bytes: int | None, sample_rate: int = SAMPLE_RATE) -> bytes:
    """A 44-byte PCM WAV header; ``None`` = unknown length (the streaming convention)."""
    riff = _UNKNOWN if data_bytes is None else 36 + data_bytes
    data = _UNKNOWN if data_bytes is None else data_bytes
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF", riff, b"WAVE", b"fmt ", 16, 1, CHANNELS, sample_rate,
        sample_rate * CHANNELS * WIDTH, CHANNELS * WIDTH, WIDTH * 8, b"data", data,
    )  # fmt: skip


def audio_headers(request: SpeechRequest) -> dict[str, str]:
    return {
        "X-Sample-Rate": str(SAMPLE_RATE),
        "X-Sample-Width": str(WIDTH),
        "X-Channels": str(CHANNELS),
        "X-Voice": request.voice.name,
        "X-Profile": request.profile.name,
        "Cache-Control": "no-store",
    }


def media_type(request: SpeechRequest) -> str:
    if request.sse:
        return "text/event-stream"
    if request.audio_format == "pcm":
        return f"audio/pcm;rate={SAMPLE_RATE};channels={CHANNELS};bits={WIDTH * 8}"
    return "audio/wav"


class ClientStalledError(Exception):
    """The client read nothing for ``stall_timeout_s`` while audio waited for it."""


class SpeechJob:
    """Synthesizes one request in a background task; :meth:`next` hands out PCM in order."""

    def __init__(self, host: ModelHost, request: SpeechRequest, limits: Limits) -> None:
        self.host, self.request, self.limits = host, request, limits
        self.cancel = threading.Event()  # seen by the engine thread
        self.samples = 0
        self.started = time.monotonic()
        self.first_audio_s: float | None = None
        self._queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()
        self._unread = 0  # bytes queued but not yet taken by the response
        self._max_unread = int(limits.max_buffered_audio_s * SAMPLE_RATE) * WIDTH
        self._space = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.stalled = False
        self.on_stall: Callable[[], Any] | None = None  # the response drops the connection

    def start(self, receive: Receive | None = None) -> None:
        """Start synthesizing; with ``receive``, a client disconnect cancels the job."""
        self._task = asyncio.create_task(self._run(), name="http synthesis")
        if receive is not None:
            self._watcher = asyncio.create_task(self._watch(receive), name="http disconnect")

    def stop(self) -> None:
        """Cancel (idempotent): the engine stops within one chunk, a queued job never starts."""
        self.cancel.set()
        for task in (self._task, self._watcher):
            if task is not None and not task.done():
                task.cancel()
        self._queue.put_nowait(None)  # wakes a reader waiting in next()

    async def next(self) -> bytes | None:
        """The next piece of PCM, ``None`` at the end; re-raises the synthesis error."""
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        if item is not None:
            self._unread -= len(item)
            self._space.set()
        return item

    async def read_all(self) -> bytes:
        parts = []
        while (part := await self.next()) is not None:
            parts.append(part)
        return b"".join(parts)

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if not self._task or not self._task.done():
            _LOGGER.info("HTTP client left; cancelling its synthesis")
        self.stop()

    async def _run(self) -> None:
        request = self.request
        try:
            for sentence in request.sentences:
                await self._wait_for_space()
                await self.host.synthesize(
                    sentence,
                    request.options,
                    self.cancel,
                    self._on_chunk,
                    load_timeout=self.limits.load_wait_s,
                )
            self._queue.put_nowait(None)
            _LOGGER.info(
                "Spoke %.2f s of audio (%s, %s) over HTTP: first audio after %.2f s, done in "
                "%.2f s", self.samples / SAMPLE_RATE, request.voice.name, request.profile.name,
                self.first_audio_s or 0.0, time.monotonic() - self.started,
            )  # fmt: skip
        except asyncio.CancelledError:
            self._queue.put_nowait(None)
            raise
        except SynthesisCancelled:
            self._queue.put_nowait(None)
        except ClientStalledError as err:
            self.stalled = True
            self.cancel.set()
            self._queue.put_nowait(err)
            if self.on_stall is not None:
                self.on_stall()  # the response is stuck in send(): only cancelling frees it
        except Exception as err:  # handed to the response, which reports it
            self._queue.put_nowait(err)

    async def _on_chunk(self, chunk: AudioChunk) -> None:
        if self.first_audio_s is None:
            self.first_audio_s = time.monotonic() - self.started
        if chunk.sample_rate != SAMPLE_RATE:
            raise RuntimeError(f"engine produced {chunk.sample_rate} Hz, expected {SAMPLE_RATE}")
        pcm = chunk.pcm16
        self.samples += len(pcm) // WIDTH
        self._unread += len(pcm)
        self._queue.put_nowait(pcm)

    async def _wait_for_space(self) -> None:
        while self._unread >= self._max_unread:
            self._space.clear()
            try:
                await asyncio.wait_for(self._space.wait(), self.limits.stall_timeout_s)
            except asyncio.TimeoutError as err:
                raise ClientStalledError("the client stopped reading") from err


class SpeechResponse(StreamingResponse):
    """Chunked audio: WAV header (unknown length) or nothing for PCM, then PCM as produced.

    ``first`` is the job's first PCM piece, already awaited by the route so that errors found
    before any audio (unknown speaker, text the frontend refuses) still get a JSON status code.
    A failure after that can only end the body early: the chunked stream is closed without its
    terminating chunk, which every HTTP client reports as an incomplete response.
    """

    def __init__(self, job: SpeechJob, first: bytes | None) -> None:
        self.job = job
        self._first = first
        request = job.request
        super().__init__(self._body(), media_type=media_type(request),
                         headers=audio_headers(request))  # fmt: skip

    async def _body(self) -> AsyncIterator[bytes]:
        request, job = self.job.request, self.job
        if request.sse:
            async for piece in self._pieces():
                yield _sse({"type": "speech.audio.delta",
                            "audio": base64.b64encode(piece).decode("ascii")})  # fmt: skip
            yield _sse({"type": "speech.audio.done",
                        "usage": {"input_tokens": len(request.text), "output_tokens": 0,
                                  "total_tokens": len(request.text)}})  # fmt: skip
            return
        if request.audio_format == "wav":
            yield wav_header(None)
        async for piece in self._pieces():
            yield piece
        if job.cancel.is_set():
            raise ConnectionAbortedError("synthesis cancelled")  # no terminating chunk

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
        self.job.on_stall = task.cancel if task is not None else None
        try:
            await self.stream_response(send)
        except OSError as err:
            _LOGGER.info("HTTP stream ended early: %s", err)
        except asyncio.CancelledError:
            if not self.job.stalled or task is None:
                raise
            if sys.version_info >= (3, 11):  # before 3.11 a caught cancellation leaves no count
                task.uncancel()
            _LOGGER.warning("HTTP client stopped reading for %.0f s; dropping it",
                            self.job.limits.stall_timeout_s)  # fmt: skip
        except Exception as err:  # the status line is gone: log, cut the body
            _LOGGER.error("Synthesis failed mid-stream: %s: %s", type(err).__name__, err)
        finally:
            self.job.stop()


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


async def first_piece(job: SpeechJob) -> bytes | None:
    """Await the first PCM piece; on any error the job is stopped and the error re-raised."""
    try:
        return await job.next()
    except BaseException:
        with contextlib.suppress(Exception):
            job.stop()
        raise
