"""One Wyoming connection: events in, audio out, within the configured limits.

Three tasks per connection, so no step ever waits for another one that it does not need:
- the reader parses events; ``describe`` is answered at once, text becomes jobs;
- the worker speaks the jobs in order through the shared :class:`ModelHost`;
- the sender writes outgoing events. Audio waiting for a slow client is bounded
  (``max_buffered_audio_s``); a client that reads nothing for ``stall_timeout_s`` is dropped.

Any refused request gets ``error{text, code}`` and then the connection is closed: older Home
Assistant ignores ``error`` and has no timeout, so only a close ends its wait. End of input from
the client means it has gone: its synthesis is cancelled within one chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from wyoming.audio import AudioChunk as WyomingAudioChunk
from wyoming.audio import AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Describe
from wyoming.tts import SynthesizeStopped

from engine.constants import SAMPLE_RATE
from engine.text.errors import TextInputError
from engine.types import AudioChunk, EngineError, SynthesisCancelled
from engine.types import UnknownSpeakerError as EngineUnknownSpeaker
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.custom_voices import split_instruction
from wyoming_cosyvoice.info import Voice, build_info
from wyoming_cosyvoice.protocol import (
    ClientError,
    LimitExceededError,
    ServerBusyError,
    StreamStateError,
    SynthesisError,
    TextError,
    VoiceNotFoundError,
    event_text,
    event_voice,
    read_event,
)
from wyoming_cosyvoice.sentences import Splitter, has_speech, split_all
from wyoming_cosyvoice.server import ModelHost

_LOGGER = logging.getLogger(__name__)

_WIDTH, _CHANNELS = 2, 1
_LINGER_S = 2.0
_MAX_UNSENT_INFO = 16  # describe answers a client may leave unread before we stop reading


@dataclass
class ConnectionContext:
    """What every connection shares."""

    config: ServerConfig
    host: ModelHost
    splitter_factory: Callable[[], Splitter]
    active: int = 0


@dataclass
class _Request:
    """One ``synthesize`` or one whole stream: its voice request and running totals."""

    voice: dict[str, str] | None
    voice_resolved: Voice | None = None
    instruct: str | None = None  # -Instruct model: the instruction voice.speaker carries
    chars: int = 0
    splitter: Splitter | None = None
    spoken: int = 0  # sentences queued so far (a stream with none still gets an audio block)


@dataclass
class _Speak:
    """Sentences spoken inside one audio-start … audio-stop (none: an empty block)."""

    request: _Request
    sentences: list[str]


class _Finish:
    """End of a stream: send ``synthesize-stopped``."""


class _ClientStalledError(Exception):
    """The client stopped reading; it is dropped without an error event."""


class EventHandler:
    """Serves one client connection."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ctx: ConnectionContext
    ) -> None:
        self._reader, self._writer, self._ctx = reader, writer, ctx
        self._config = ctx.config
        self._limits = ctx.config.limits
        self._peer = str(writer.get_extra_info("peername") or "local")
        self._cancel = threading.Event()  # seen by the engine thread
        self._out: asyncio.Queue[Event | None] = asyncio.Queue()
        self._jobs: asyncio.Queue[_Speak | _Finish] = asyncio.Queue()
        self._pending = 0  # jobs queued or running
        self._stream: _Request | None = None
        self._closing = False
        self._buffered = 0  # audio samples queued for the sender
        self._max_buffered = int(self._limits.max_buffered_audio_s * SAMPLE_RATE)
        self._space = asyncio.Event()
        self._last_activity = time.monotonic()
        self._worker_task: asyncio.Task[None] | None = None
        self._unsent_info = 0  # info answers queued but not yet written
        self._info_sent = asyncio.Event()

    # --- lifecycle ----------------------------------------------------------------------

    async def run(self) -> None:
        self._ctx.active += 1
        sender = asyncio.create_task(self._sender(), name=f"send {self._peer}")
        self._worker_task = asyncio.create_task(self._worker(), name=f"speak {self._peer}")
        watchdog = asyncio.create_task(self._watchdog(), name=f"idle {self._peer}")
        try:
            if self._ctx.active > self._limits.max_connections:
                self._fail(
                    ServerBusyError(f"too many connections ({self._limits.max_connections})")
                )
            await self._read_loop()
        except (ConnectionError, asyncio.IncompleteReadError, OSError):
            _LOGGER.debug("Client %s disconnected", self._peer)
        except Exception:  # one client never takes the server down
            _LOGGER.exception("Unexpected error on connection %s", self._peer)
        finally:
            self._cancel.set()
            watchdog.cancel()
            self._worker_task.cancel()
            self._out.put_nowait(None)
            try:  # already-queued events (an error, an info) still go out
                await asyncio.wait_for(asyncio.shield(sender), timeout=2.0)
            except (asyncio.TimeoutError, Exception):
                self._writer.transport.abort()
                sender.cancel()
            await asyncio.gather(sender, self._worker_task, watchdog, return_exceptions=True)
            if self._closing:
                await self._linger()
            self._writer.close()
            self._ctx.active -= 1

    async def _linger(self) -> None:
        """After an error: swallow what the client still sends, briefly, then close.

        Closing a socket with unread input makes the kernel send a reset, which can destroy
        the error event still in flight; reading to the client's end avoids that.
        """

        async def drain() -> None:
            while await self._reader.read(1 << 16):
                pass

        with contextlib.suppress(Exception):
            await asyncio.wait_for(drain(), _LINGER_S)

    async def _read_loop(self) -> None:
        events = 0
        while True:
            try:
                event = await read_event(
                    self._reader,
                    max_header_bytes=self._limits.max_header_bytes,
                    max_data_bytes=self._limits.max_data_bytes,
                    max_payload_bytes=self._limits.max_payload_bytes,
                )
            except ClientError as err:
                self._fail(err)
                break
            if event is None:
                break
            if self._closing:
                continue  # refused already: the error is on its way, the rest is ignored
            self._last_activity = time.monotonic()
            events += 1
            if self._unsent_info >= _MAX_UNSENT_INFO and not await self._info_drained():
                break
            if events > (most := self._limits.max_events_per_connection):
                self._fail(LimitExceededError(f"more than {most} events on one connection"))
                break
            try:
                self._handle(event)
            except ClientError as err:
                self._fail(err)
                break
        if not self._closing:
            # The client closed its side: whatever it asked for is no longer wanted.
            self._cancel.set()

    async def _info_drained(self) -> bool:
        """A client that floods ``describe`` without reading: stop reading until it catches up.

        Each ``info`` is kilobytes of Python objects; without this, one connection could queue
        ``max_events_per_connection`` of them. False (and the connection refused) if the client
        reads nothing for ``stall_timeout_s``.
        """
        while self._unsent_info >= _MAX_UNSENT_INFO:
            self._info_sent.clear()
            try:
                await asyncio.wait_for(self._info_sent.wait(), self._limits.stall_timeout_s)
            except asyncio.TimeoutError:
                self._fail(LimitExceededError("client sends describe but reads no answers"))
                return False
        return True

    def _fail(self, err: ClientError, level: int = logging.WARNING) -> None:
        """Send ``error`` after what is already queued, then close the connection.

        Logged at WARNING: Home Assistant ignores ``error`` while streaming, so for its user
        the log is the only place that says why the speaker stayed silent.
        """
        if self._closing:
            return
        self._closing = True
        _LOGGER.log(level, "Refused a request from %s: %s (%s)", self._peer, err, err.code)
        self._cancel.set()
        if self._worker_task is not None and self._worker_task is not asyncio.current_task():
            self._worker_task.cancel()
        self._out.put_nowait(Error(text=str(err), code=err.code).event())
        self._out.put_nowait(None)
        # A client that ignores both the error and our end of stream is cut off.
        asyncio.get_running_loop().call_later(_LINGER_S * 2, self._writer.transport.abort)

    async def _watchdog(self) -> None:
        """Close a connection that has been idle (nothing asked, nothing owed) too long."""
        timeout = self._limits.idle_timeout_s
        while not self._closing:
            await asyncio.sleep(min(timeout, 5.0))
            idle = self._pending == 0 and self._out.empty()
            if idle and time.monotonic() - self._last_activity > timeout:
                # Housekeeping, not a refused request.
                self._fail(
                    LimitExceededError(f"no request for {timeout:.0f} s; closing"), logging.INFO
                )

    # --- events in ----------------------------------------------------------------------

    def _handle(self, event: Event) -> None:
        kind, data = event.type, event.data
        if Describe.is_type(kind):
            self._unsent_info += 1
            self._out.put_nowait(self._info().event())
        elif kind == "synthesize":
            if self._stream is not None:
                return  # Home Assistant's compatibility copy of the streamed text
            text = event_text(data, "synthesize")
            request = _Request(event_voice(data), chars=len(text))
            self._check_length(request.chars)
            sentences = [s for s in split_all(text, self._ctx.splitter_factory()) if has_speech(s)]
            self._enqueue(_Speak(request, sentences))  # none (emoji, blank): an empty WAV
        elif kind == "synthesize-start":
            if self._stream is not None:
                raise StreamStateError("synthesize-start while a stream is already open")
            voice = event_voice(data)
            self._stream = _Request(voice, splitter=self._ctx.splitter_factory())
        elif kind == "synthesize-chunk":
            stream = self._open_stream(kind)
            text = event_text(data, kind)
            stream.chars += len(text)
            self._check_length(stream.chars)
            assert stream.splitter is not None
            self._speak_sentences(stream, stream.splitter.feed(text))
        elif kind == "synthesize-stop":
            stream = self._open_stream(kind)
            assert stream.splitter is not None
            self._speak_sentences(stream, stream.splitter.flush())
            if not stream.spoken:
                # Home Assistant writes its WAV header at the first audio-start: without one,
                # a text with nothing to speak would reach it as zero bytes, not an empty WAV.
                self._enqueue(_Speak(stream, []))
            self._stream = None
            self._enqueue(_Finish())
        else:
            _LOGGER.debug("Ignoring %s event from %s", kind, self._peer)

    def _open_stream(self, kind: str) -> _Request:
        if self._stream is None:
            raise StreamStateError(f"{kind} without synthesize-start")
        return self._stream

    def _speak_sentences(self, stream: _Request, sentences: list[str]) -> None:
        for sentence in sentences:
            if has_speech(sentence):
                stream.spoken += 1
                self._enqueue(_Speak(stream, [sentence]))

    def _enqueue(self, job: _Speak | _Finish) -> None:
        self._pending += 1
        self._jobs.put_nowait(job)

    def _check_length(self, chars: int) -> None:
        if chars > self._limits.max_text_chars:
            raise LimitExceededError(
                f"text of {chars} characters is over the limit of {self._limits.max_text_chars}"
            )

    def _info(self) -> Any:
        catalog = self._ctx.host.catalog
        return build_info(
            catalog, streaming=self._config.profile.streaming, model=self._config.model
        )

    # --- speaking -----------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            job = await self._jobs.get()
            try:
                if isinstance(job, _Finish):
                    self._out.put_nowait(SynthesizeStopped().event())
                else:
                    await self._speak(job)
            except (SynthesisCancelled, asyncio.CancelledError):
                return
            except _ClientStalledError:
                _LOGGER.warning("Client %s stopped reading; dropping it", self._peer)
                self._cancel.set()
                self._writer.transport.abort()
                return
            except ClientError as err:
                self._fail(err)
                return
            except EngineUnknownSpeaker as err:
                self._fail(VoiceNotFoundError(str(err)))
                return
            except TextInputError as err:
                self._fail(TextError(str(err)))
                return
            except EngineError as err:
                self._fail(SynthesisError(str(err) or type(err).__name__))
                return
            except Exception as err:  # report it, keep the server alive
                _LOGGER.exception("Synthesis failed for %s", self._peer)
                self._fail(SynthesisError(f"internal error: {type(err).__name__}: {err}"))
                return
            finally:
                self._pending -= 1
                self._last_activity = time.monotonic()

    async def _speak(self, job: _Speak) -> None:
        if not job.sentences:
            self._send_empty_audio()
            return
        host, limits = self._ctx.host, self._limits
        await host.wait_ready(limits.load_wait_s)
        request = job.request
        if request.voice_resolved is None:  # once per request: a stream keeps its voice
            request.voice_resolved, request.instruct = self._resolve_voice(
                request.voice, " ".join(job.sentences)
            )
        voice = request.voice_resolved
        options = self._config.profile.options(
            speaker=voice.speaker,
            seed=self._config.seed,
            instruct=request.instruct,
            force_tokens=self._config.force_tokens,
        )
        started = time.monotonic()
        _LOGGER.debug(
            "Speaking %d sentence(s) as %s for %s (queue %d)",
            len(job.sentences),
            voice.name,
            self._peer,
            host.waiting,
        )
        self._out.put_nowait(AudioStart(rate=SAMPLE_RATE, width=_WIDTH, channels=_CHANNELS).event())
        stats = {"samples": 0, "first": 0.0}

        async def on_chunk(chunk: AudioChunk) -> None:
            if not stats["first"]:
                stats["first"] = time.monotonic() - started
            stats["samples"] += len(chunk.samples)
            await self._send_audio(chunk)

        for sentence in job.sentences:
            await self._wait_for_space()
            await host.synthesize(
                sentence, options, self._cancel, on_chunk, load_timeout=limits.load_wait_s
            )
        self._out.put_nowait(AudioStop().event())
        _LOGGER.info(
            "Spoke %.2f s of audio (%s) for %s: first audio after %.2f s, done in %.2f s",
            stats["samples"] / SAMPLE_RATE,
            voice.name,
            self._peer,
            stats["first"],
            time.monotonic() - started,
        )

    def _send_empty_audio(self) -> None:
        """audio-start + audio-stop: the client gets a valid WAV with no samples."""
        self._out.put_nowait(AudioStart(rate=SAMPLE_RATE, width=_WIDTH, channels=_CHANNELS).event())
        self._out.put_nowait(AudioStop().event())
        _LOGGER.info("Nothing to speak for %s: sent an empty audio block", self._peer)

    async def _wait_for_space(self) -> None:
        """Wait while the client has more than ``max_buffered_audio_s`` unread.

        Called between sentences, never while holding the engine: a client that stops reading
        only stops itself. Within a sentence audio is queued without waiting; the splitter's
        sentence-length cap bounds that.
        """
        while self._buffered >= self._max_buffered:
            self._space.clear()
            try:
                await asyncio.wait_for(self._space.wait(), self._limits.stall_timeout_s)
            except asyncio.TimeoutError as err:
                raise _ClientStalledError from err

    async def _send_audio(self, chunk: AudioChunk) -> None:
        if chunk.sample_rate != SAMPLE_RATE:
            raise SynthesisError(f"engine produced {chunk.sample_rate} Hz, expected {SAMPLE_RATE}")
        pcm = chunk.pcm16
        step = self._config.samples_per_chunk * _WIDTH
        for start in range(0, len(pcm), step):
            piece = pcm[start : start + step]
            self._buffered += len(piece) // _WIDTH
            event = WyomingAudioChunk(
                rate=SAMPLE_RATE, width=_WIDTH, channels=_CHANNELS, audio=piece
            ).event()
            self._out.put_nowait(event)

    def _resolve_voice(self, request: dict[str, str] | None, text: str) -> tuple[Voice, str | None]:
        """The voice, and the per-request instruction ``voice.speaker`` may carry."""
        host = self._ctx.host
        catalog = host.catalog
        wanted, instruct = split_instruction(request, catalog, getattr(host.engine, "kind", None))
        return catalog.resolve(wanted, default=self._config.voice, text=text), instruct

    # --- events out ---------------------------------------------------------------------

    async def _sender(self) -> None:
        try:
            while (event := await self._out.get()) is not None:
                await async_write_event(event, self._writer)
                self._last_activity = time.monotonic()
                if event.type == "info":
                    self._unsent_info -= 1
                    self._info_sent.set()
                if event.type == "audio-chunk" and event.payload:
                    self._buffered -= len(event.payload) // _WIDTH
                    self._space.set()
            if self._closing and self._writer.can_write_eof():
                self._writer.write_eof()  # the client reads the error, then our end of stream
        except (ConnectionError, OSError):
            self._cancel.set()  # the client is gone: stop its synthesis
