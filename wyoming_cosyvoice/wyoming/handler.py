"""One Wyoming connection: events in, audio out, within the configured limits.

This module only translates the protocol; the speech itself is the shared pipeline
(:mod:`~wyoming_cosyvoice.pipeline.speech`). Three tasks per connection, so no step ever waits for
another one that it does not need:
- the reader parses events; ``describe`` is answered at once, each ``synthesize`` (or stream,
  ``synthesize-start`` … ``-stop``) becomes one :class:`~.speech.Speech`, fed with sentences as
  they complete;
- the worker reads the speeches in order and turns their events into audio-start,
  audio-chunk … and audio-stop (one block per request, or per sentence of a stream);
- the sender writes outgoing events, and tells each speech what its client has received: the
  speech's backpressure and stalled-client drop count on that.

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
from collections.abc import Sequence
from dataclasses import dataclass

from wyoming.audio import AudioChunk as WyomingAudioChunk
from wyoming.audio import AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event, async_write_event
from wyoming.info import Attribution, Describe, Info, TtsProgram, TtsVoice, TtsVoiceSpeaker
from wyoming.tts import SynthesizeStopped

from engine.core.text_feed import TextFeed
from engine.core.types import EngineError, SynthesisCancelled
from engine.core.types import UnknownSpeakerError as EngineUnknownSpeaker
from engine.text.errors import TextInputError
from wyoming_cosyvoice import __version__
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.errors import (
    ClientError,
    LimitExceededError,
    ServerBusyError,
    StreamStateError,
    SynthesisError,
    TextError,
    VoiceNotFoundError,
)
from wyoming_cosyvoice.pipeline.scheduler import Scheduler, speaks_growing
from wyoming_cosyvoice.pipeline.sentences import (
    Sentence,
    SentenceStream,
    SplitterFactory,
    has_speech,
    iter_sentences,
    opening_language,
)
from wyoming_cosyvoice.pipeline.speech import (
    WIDTH,
    Audio,
    ClientStalledError,
    SentenceEnd,
    SentenceStart,
    Speech,
    SpeechSettings,
    VoiceChoice,
)
from wyoming_cosyvoice.voices.catalog import VoiceCatalog
from wyoming_cosyvoice.voices.presets import (
    listed_presets,
    preset_voice_name,
    speaker_names,
)
from wyoming_cosyvoice.wyoming.protocol import event_text, event_voice, read_event

_LOGGER = logging.getLogger(__name__)

_CHANNELS = 1
_LINGER_S = 2.0
_MAX_UNSENT_INFO = 16  # describe answers a client may leave unread before we stop reading
# A sentence spoken while it arrives is cut only at its end, or after this many characters
# without one (a long sentence is otherwise cut at a comma: the splitter's max_chars).
GROWING_MAX_CHARS = 600
PROGRAM_NAME = "cosyvoice"
ATTRIBUTION = Attribution(
    name="CosyVoice by FunAudioLLM (Alibaba Tongyi Lab)",
    url="https://github.com/FunAudioLLM/CosyVoice",
)


@dataclass
class ConnectionContext:
    """What every connection shares."""

    config: ServerConfig
    scheduler: Scheduler
    splitter_factory: SplitterFactory
    active: int = 0


@dataclass
class _Request:
    """One ``synthesize`` (one audio block) or one whole stream (a block per sentence)."""

    speech: Speech
    streamed: bool
    chars: int = 0
    sentences: SentenceStream | None = None  # a stream's splitter
    growing: TextFeed | None = None  # the sentence in progress, being spoken as it arrives


@dataclass
class _Delivery:
    """An audio-chunk event, and the speech to tell once it is written."""

    event: Event
    speech: Speech


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
        self._out: asyncio.Queue[Event | _Delivery | None] = asyncio.Queue()
        self._jobs: asyncio.Queue[_Request] = asyncio.Queue()
        self._requests: list[_Request] = []  # queued or being spoken
        self._stream: _Request | None = None
        self._closing = False
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
            for request in self._requests:
                request.speech.cancel()
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
                    max_data_bytes=self._limits.max_text_bytes,
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
        if level >= logging.WARNING:  # an error for the client, not a housekeeping close
            self._ctx.scheduler.metrics.error_sent("wyoming", err.code)
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
            idle = self._out.empty() and all(r.speech.idle for r in self._requests)
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
            self._check_length(len(text))
            voices = self._voice_choice(event_voice(data), opening_language(text))
            request = _Request(self._speech(voices), streamed=False, chars=len(text))
            # Split as spoken; no sentence (emoji, blank): an empty WAV.
            request.speech.say_all(iter_sentences(text, self._ctx.splitter_factory()), text)
            request.speech.end()
            self._enqueue(request)
        elif kind == "synthesize-start":
            if self._stream is not None:
                raise StreamStateError("synthesize-start while a stream is already open")
            voices = self._voice_choice(event_voice(data), None)
            stream = SentenceStream(self._ctx.splitter_factory())
            self._stream = _Request(self._speech(voices), streamed=True, sentences=stream)
            self._enqueue(self._stream)
        elif kind == "synthesize-chunk":
            request = self._open_stream(kind)
            text = event_text(data, kind)
            request.chars += len(text)
            self._check_length(request.chars)
            assert request.sentences is not None
            self._say_streamed(request, request.sentences.feed(text), request.sentences.pending)
        elif kind == "synthesize-stop":
            request = self._open_stream(kind)
            assert request.sentences is not None
            self._say_streamed(request, request.sentences.flush(), None)
            request.speech.end()
            self._stream = None
        else:
            _LOGGER.debug("Ignoring %s event from %s", kind, self._peer)

    def _say_streamed(
        self, request: _Request, sentences: list[Sentence], pending: str | None
    ) -> None:
        """A stream's sentences the splitter released, and the text of the one in progress
        (``pending``; None at the end). The sentence in progress is handed to the speech while
        it grows when the engine can start it early and nothing else waits for the engine."""
        pending = pending.lstrip() if pending is not None else None
        growing = request.growing
        if growing is not None:
            if sentences:
                growing.finish(sentences.pop(0).text)
                growing = None
            elif pending is None or not pending.startswith(growing.now.text):
                growing.finish()  # released with nothing left to say
                growing = None
        for sentence in sentences:
            request.speech.say(sentence)
        if pending is not None and growing is not None:
            growing.update(pending)
        elif pending is not None and self._may_grow(request.speech, pending):
            growing = request.speech.say_growing(pending)
        if request.sentences is not None and (growing is None) != (request.growing is None):
            request.sentences.release_long_sentences(GROWING_MAX_CHARS if growing else None)
        request.growing = growing

    def _may_grow(self, speech: Speech, pending: str) -> bool:
        """Speak the sentence in progress while it arrives: the server allows it, the engine
        can, the sentence has begun, and the engine would otherwise wait for it (this speech
        has nothing else to say and no other request waits: a growing sentence holds the
        engine until it ends)."""
        scheduler = self._ctx.scheduler
        return (
            self._config.early_speech
            and has_speech(pending)
            and speech.idle
            and scheduler.idle
            and speaks_growing(scheduler.engine)
        )

    def _open_stream(self, kind: str) -> _Request:
        if self._stream is None:
            raise StreamStateError(f"{kind} without synthesize-start")
        return self._stream

    def _voice_choice(self, wanted: dict[str, str] | None, language: str | None) -> VoiceChoice:
        # One voice per request; voice.speaker may be an instruction for an -Instruct model.
        return VoiceChoice(wanted, self._config.voice, text_language=language,
                           speaker_instructs=True)  # fmt: skip

    def _speech(self, voices: VoiceChoice) -> Speech:
        config = self._config
        settings = SpeechSettings(config.profile, config.seed, config.force_tokens,
                                  speed=config.speed)  # fmt: skip
        return Speech(self._ctx.scheduler, settings, voices, self._limits, client=self._peer,
                      cancel=self._cancel, front_end="wyoming")  # fmt: skip

    def _enqueue(self, request: _Request) -> None:
        self._requests.append(request)
        self._jobs.put_nowait(request)

    def _check_length(self, chars: int) -> None:
        if chars > self._limits.max_text_chars:
            raise LimitExceededError(
                f"text of {chars} characters is over the limit of {self._limits.max_text_chars}"
            )

    def _info(self) -> Info:
        scheduler = self._ctx.scheduler
        form = scheduler.instruction_form  # the model family's until the engine has loaded
        return build_info(
            scheduler.catalog,
            streaming=self._config.profile.streaming,
            model=self._config.model,
            speakers=speaker_names(form),
            preset_voices=listed_presets(self._config.preset_voices, form),
        )

    # --- speaking -----------------------------------------------------------------------

    async def _worker(self) -> None:
        while True:
            request = await self._jobs.get()
            try:
                await self._speak(request)
            except (SynthesisCancelled, asyncio.CancelledError):
                # The connection is ending, and this request is no longer one the close will
                # cancel: its speech may still wait for more of a stream that never comes.
                request.speech.cancel()
                return
            except ClientStalledError:
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
                self._requests.remove(request)
                self._last_activity = time.monotonic()

    async def _speak(self, request: _Request) -> None:
        """The speech's events as audio blocks: one for a ``synthesize``, one per sentence of
        a stream (then ``synthesize-stopped``). Nothing to speak still gets an empty block:
        Home Assistant writes its WAV header at the first audio-start, and without one a text
        with nothing to speak would reach it as zero bytes, not an empty WAV."""
        speech, streamed = request.speech, request.streamed
        block_open, blocks = False, 0
        while (event := await speech.next()) is not None:
            if isinstance(event, SentenceStart) and not block_open:
                self._out.put_nowait(_audio_start(speech.sample_rate))
                block_open, blocks = True, blocks + 1
            elif isinstance(event, Audio):
                self._send_audio(event, speech)
            elif isinstance(event, SentenceEnd) and streamed:
                self._out.put_nowait(AudioStop().event())
                block_open = False
        if not blocks:
            self._out.put_nowait(_audio_start(speech.sample_rate))
            _LOGGER.info("Nothing to speak for %s: sent an empty audio block", self._peer)
            block_open = True
        if block_open:
            self._out.put_nowait(AudioStop().event())
        if streamed:
            self._out.put_nowait(SynthesizeStopped().event())

    def _send_audio(self, audio: Audio, speech: Speech) -> None:
        step = self._config.samples_per_chunk * WIDTH
        for start in range(0, len(audio.pcm), step):
            piece = audio.pcm[start : start + step]
            event = WyomingAudioChunk(
                rate=speech.sample_rate, width=WIDTH, channels=_CHANNELS, audio=piece
            ).event()
            self._out.put_nowait(_Delivery(event, speech))

    # --- events out ---------------------------------------------------------------------

    async def _sender(self) -> None:
        try:
            while (item := await self._out.get()) is not None:
                event = item.event if isinstance(item, _Delivery) else item
                await async_write_event(event, self._writer)
                self._last_activity = time.monotonic()
                if isinstance(item, _Delivery):
                    item.speech.delivered(len(event.payload or b"") // WIDTH)
                elif event.type == "info":
                    self._unsent_info -= 1
                    self._info_sent.set()
            if self._closing and self._writer.can_write_eof():
                self._writer.write_eof()  # the client reads the error, then our end of stream
        except (ConnectionError, OSError):
            self._cancel.set()  # the client is gone: stop its synthesis


def _audio_start(rate: int) -> Event:
    return AudioStart(rate=rate, width=WIDTH, channels=_CHANNELS).event()


def build_info(
    catalog: VoiceCatalog,
    *,
    streaming: bool,
    model: str,
    speakers: Sequence[str] = (),
    preset_voices: Sequence[str] = (),
) -> Info:
    """The ``info`` answer to ``describe``: one TTS program with one voice per catalogue entry;
    every field Home Assistant needs is always present. ``speakers``: what every voice offers
    per call (:mod:`~wyoming_cosyvoice.voices.presets`); ``preset_voices``: presets each voice is
    also listed at, as ``<voice> (<preset>)`` (its description starts with the voice's, so Home
    Assistant, which sorts voices by it, keeps the plain voice first)."""
    voices = [
        TtsVoice(
            name=preset_voice_name(voice.name, preset) if preset else voice.name,
            description=f"{voice.description} – {preset}" if preset else voice.description,
            attribution=ATTRIBUTION,
            installed=True,
            version=None,
            languages=list(voice.languages),
            speakers=[TtsVoiceSpeaker(name=name) for name in speakers] or None,
        )
        for voice in catalog.voices
        for preset in (None, *preset_voices)
    ]
    program = TtsProgram(
        name=PROGRAM_NAME,
        description=f"CosyVoice text to speech ({model}) on the CPU",
        attribution=ATTRIBUTION,
        installed=True,
        version=__version__,
        voices=voices,
        supports_synthesize_streaming=streaming,
    )
    return Info(tts=[program])
