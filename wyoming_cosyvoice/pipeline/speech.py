"""The speech pipeline every front end drives: text → sentences → voices → engine → audio.

::

    text, whole or in streamed fragments
      │  sentences.py: split once (the frontend's IncrementalSplitter); each sentence's
      ▼  language detected once
    Sentence(text, language) ──► Speech.say()
      │  VoiceChoice: the voice asked for, else the server's default, else one of the
      ▼  text's language (one per request, or one per sentence)
    Speech (a task per request) ──► Scheduler.synthesize(sentence): engine thread, FIFO turn
      │                                    │ AudioChunk (float32) ─► the sentence's gain,
      │                                    │ fixed before it starts (loudness.py) ─► PCM16
      ▼                                    ▼
    Speech.next() ◄── SentenceStart · Audio … · SentenceEnd, per sentence, then None
      │
      ▼  translated by handler.py (Wyoming), http/stream.py (HTTP), synthesize.py (a WAV file)

Backpressure: between sentences, never while holding the engine, a speech waits while more
than ``max_buffered_audio_s`` of its audio is made but not yet delivered (the front end calls
:meth:`Speech.delivered` once its client has it). After ``stall_timeout_s`` of waiting the
client counts as stalled: the speech ends with :class:`ClientStalledError` and calls
``on_stall`` (a front end stuck writing to that client cannot see the error itself). Within a
sentence audio is queued without waiting; the splitter's sentence-length cap bounds that.
Cancellation: :meth:`Speech.cancel` or the request's ``cancel`` event stops the engine within
one chunk, and a sentence not yet started never reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from engine.api import Engine
from engine.core.text_feed import TextFeed
from engine.core.types import AudioChunk, EngineError, SynthesisCancelled, SynthesisOptions
from engine.text.normalize import detect_language
from wyoming_cosyvoice.config import AUTO_PROFILE, Limits, ProfileConfig
from wyoming_cosyvoice.errors import LimitExceededError, VoiceNotFoundError
from wyoming_cosyvoice.pipeline.metrics import SpeechReport, speech_outcome
from wyoming_cosyvoice.pipeline.scheduler import Scheduler
from wyoming_cosyvoice.pipeline.sentences import Sentence
from wyoming_cosyvoice.voices.catalog import Voice, VoiceCatalog
from wyoming_cosyvoice.voices.loudness import SentenceLevel
from wyoming_cosyvoice.voices.presets import split_preset, with_presets

_LOGGER = logging.getLogger(__name__)

WIDTH = 2  # bytes per sample: 16-bit PCM, mono
MAX_INSTRUCTION_CHARS = 1000  # as NAME.instruct.txt (the engine's transcript limit)


class ClientStalledError(Exception):
    """The client read nothing for ``stall_timeout_s`` while audio waited for it."""


# --- what a speech hands out ------------------------------------------------------------------


@dataclass(frozen=True)
class SentenceStart:
    """A sentence is about to be synthesized, in this voice."""

    index: int
    sentence: Sentence
    voice: Voice


@dataclass(frozen=True)
class Audio:
    """16-bit little-endian mono PCM at the engine's sample rate, in order."""

    pcm: bytes

    @property
    def samples(self) -> int:
        return len(self.pcm) // WIDTH


@dataclass(frozen=True)
class SentenceEnd:
    """A sentence is finished; ``skipped`` holds why it gave no audio when skipping failures."""

    index: int
    skipped: Exception | None = None


SpeechEvent = SentenceStart | Audio | SentenceEnd


@dataclass(frozen=True)
class GrowingSentence:
    """A sentence whose text is still arriving (an LLM's reply, streamed): the engine speaks it
    while it grows (:meth:`Speech.say_growing`)."""

    text: TextFeed
    language: str

    @property
    def so_far(self) -> Sentence:
        return Sentence(self.text.now.text, self.language)


_Todo = Sentence | Iterator[Sentence] | GrowingSentence  # what a speech is given to say


# --- per-request settings ---------------------------------------------------------------------


@dataclass(frozen=True)
class SpeechSettings:
    """How one request is synthesized: its profile's per-request part and its seed."""

    profile: ProfileConfig
    seed: int | None
    force_tokens: int | None = None
    volume: float | None = None  # a factor on the server's loudness; None = the server's volume
    speed: float = 1.0  # speaking speed, unless the request's speaker names one

    def options(
        self, voice: Voice, instruct: str | None, sentence: Sentence, speed: float | None = None
    ) -> SynthesisOptions:
        """The engine options for one sentence: already split, its language already known."""
        options = self.profile.options(
            speaker=voice.speaker, seed=self.seed, instruct=instruct, force_tokens=self.force_tokens
        )
        speed = self.speed if speed is None else speed
        return replace(options, split=False, language=sentence.language, speed=speed)


def instruction_text(text: str, field: str) -> str | None:
    """A free-text instruction as the engine gets it (runs of white space as one space; None
    if empty); :class:`LimitExceededError` naming ``field`` past :data:`MAX_INSTRUCTION_CHARS`.
    One limit for every front end: Wyoming's speaker, HTTP's ``speaker`` and ``instructions``."""
    instruction = " ".join(text.split())
    if len(instruction) > MAX_INSTRUCTION_CHARS:
        raise LimitExceededError(
            f"the instruction in {field} has {len(instruction)} characters; "
            f"the limit is {MAX_INSTRUCTION_CHARS}"
        )
    return instruction or None


def split_instruction(
    request: Mapping[str, str] | None,
    catalog: VoiceCatalog,
    form: str | None,
    field: str = "voice.speaker",
) -> tuple[dict[str, str], str | None]:
    """(voice request, instruction): ``speaker`` is an instruction when it names no voice.

    Only with a model that takes instructions (``form``, engine.api's ``instruction_form``:
    -Instruct, CosyVoice2): there Wyoming's
    ``voice.speaker`` is the one free-text field
    Home Assistant forwards per request (``tts.speak`` options ``voice`` + ``speaker``). A
    speaker that names a voice keeps its old meaning; with other models an unknown speaker stays
    an error. HTTP's ``speaker`` follows the same rule (``field`` names it in the error).
    """
    wanted = dict(request or {})
    speaker = wanted.get("speaker")
    if form is None or not speaker or catalog.find(speaker) is not None:
        return wanted, None
    del wanted["speaker"]
    return wanted, instruction_text(speaker, field)


class VoiceChoice:
    """Which voice speaks each sentence of one request, and the instruction it carries.

    The voice the request asks for ({name, language, speaker}), else the server's default,
    else one of the text's language. One voice per request (Wyoming and HTTP clients expect
    one): chosen at the first sentence with ``text_language`` (the whole text's, when the
    request came whole) or else that sentence's, and kept. ``per_sentence`` (the synthesize
    command): each sentence gets a voice of its own language. ``speaker_instructs``: Wyoming's
    ``voice.speaker`` may name a speed or style, and so may ``voice.name`` (``en-female
    (slow)``; :mod:`~wyoming_cosyvoice.voices.presets`; its speed is then ``speed``), or the speaker
    carries an instruction (:func:`split_instruction`). ``catalog``: choose
    from it instead of the loaded model's (the command checks its voices before the load).
    """

    def __init__(
        self,
        request: Mapping[str, str] | None,
        default: str | None,
        *,
        text_language: str | None = None,
        per_sentence: bool = False,
        instruct: str | None = None,
        speaker_instructs: bool = False,
        catalog: VoiceCatalog | None = None,
    ) -> None:
        self.request = dict(request or {})
        self.default = default
        self.text_language = text_language
        self.per_sentence = per_sentence
        self.instruct = instruct
        self.speaker_instructs = speaker_instructs
        self.catalog = catalog
        self.speed: float | None = None  # the speed a preset speaker names, once resolved
        self._chosen: tuple[Voice, str | None] | None = None

    @classmethod
    def chosen(cls, voice: Voice, instruct: str | None) -> VoiceChoice:
        """A request whose voice was chosen before it was spoken (HTTP: for its headers)."""
        choice = cls({"name": voice.name}, None, instruct=instruct)
        choice._chosen = (voice, instruct)
        return choice

    def resolve(
        self, catalog: VoiceCatalog, form: str | None, sentence: Sentence
    ) -> tuple[Voice, str | None]:
        """(voice, instruction) for ``sentence``; raises VoiceNotFoundError."""
        if self._chosen is not None and not self.per_sentence:
            return self._chosen
        catalog = self.catalog or catalog
        wanted, instruct = self.request, self.instruct
        if self.speaker_instructs:
            wanted, preset = split_preset(wanted, catalog, form)
            if preset is not None:
                self.speed, instruct = preset.speed, instruct or preset.instruction
            wanted, from_speaker = split_instruction(wanted, catalog, form)
            instruct = from_speaker or instruct  # the call's own words over a preset voice's
        language = sentence.language if self.per_sentence else self.text_language
        try:
            voice = catalog.resolve(
                wanted, default=self.default, text_language=language or sentence.language
            )
        except VoiceNotFoundError as err:
            if not self.speaker_instructs:
                raise
            raise with_presets(err, wanted, catalog, form) from err
        self._chosen = (voice, instruct)
        return self._chosen


# --- one request's speech ---------------------------------------------------------------------


class Speech:
    """One request's sentences spoken through the scheduler, as a bounded stream of events.

    Feed it with :meth:`say` (any time, as sentences complete) and :meth:`end`; read it with
    :meth:`next`, which starts the synthesis on its first call. ``skip_failed``: a sentence the
    engine or the text frontend refuses ends with ``SentenceEnd.skipped`` instead of ending the
    speech (a long text read to a file loses one sentence, not the rest). ``front_end``
    ("wyoming", "http"): the speech is a server's request, reported to its metrics when it ends.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        settings: SpeechSettings,
        voices: VoiceChoice,
        limits: Limits,
        *,
        client: str,
        cancel: threading.Event | None = None,
        skip_failed: bool = False,
        front_end: str | None = None,
    ) -> None:
        self.scheduler, self.settings, self.voices = scheduler, settings, voices
        self.front_end = front_end
        self.limits = limits
        self.client = client  # who asked, for the log
        self.cancel_event = cancel or threading.Event()  # seen by the engine thread
        self.skip_failed = skip_failed
        self.on_stall: Callable[[], Any] | None = None
        self.stalled = False
        self.samples = 0  # made so far
        self.first_audio_s: float | None = None
        self.engine_s = 0.0  # its sentences' time queued for and inside the engine
        self._voices_used: dict[str, None] = {}
        self._started: float | None = None
        self._todo: asyncio.Queue[_Todo | None] = asyncio.Queue()
        self._events: asyncio.Queue[SpeechEvent | BaseException | None] = asyncio.Queue()
        self._undelivered = 0  # samples made but not yet delivered to the client
        self._space = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._speaking = False
        self._levels = scheduler.levels.request(settings.volume)  # each sentence's gain
        self._level: SentenceLevel | None = None  # the sentence being spoken's
        self._known_text: list[str] = []  # the text given so far (auto chooses by it)

    # --- the front end's side -------------------------------------------------------------

    def say(self, sentence: Sentence) -> None:
        self._known_text.append(sentence.text)
        self._todo.put_nowait(sentence)

    def say_growing(self, text: str) -> TextFeed:
        """A sentence that has begun but not ended: the engine may start speaking it before it
        ends. Give it the rest with :meth:`TextFeed.update` and, once it has ended, the whole
        sentence with :meth:`TextFeed.finish` (a stream's sentences stay in order: say the next
        ones after that)."""
        feed = TextFeed(text)
        self._known_text.append(text)
        self._todo.put_nowait(GrowingSentence(feed, detect_language(text)))
        return feed

    def say_all(self, sentences: Iterable[Sentence], text: str | None = None) -> None:
        """Sentences taken one at a time as the speech reaches them: a whole text given as
        :func:`~.sentences.iter_sentences` is split as it is spoken. ``text``: that whole text
        (the ``auto`` profile chooses by its length)."""
        if text:
            self._known_text.append(text)
        self._todo.put_nowait(iter(sentences))

    def end(self) -> None:
        """No more sentences."""
        self._todo.put_nowait(None)

    def start(self) -> None:
        """Start synthesizing (idempotent; :meth:`next` calls it)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"speech for {self.client}")

    async def next(self) -> SpeechEvent | None:
        """The next event, ``None`` at the end or after :meth:`cancel`; raises what stopped the
        synthesis (``SynthesisCancelled`` for the ``cancel`` event or a shutdown)."""
        self.start()
        item = await self._events.get()
        if isinstance(item, BaseException):
            raise item
        return item

    @property
    def finished(self) -> bool:
        """The synthesis has ended (all said, failed or cancelled)."""
        return self._task is not None and self._task.done()

    @property
    def idle(self) -> bool:
        """Nothing to say for now: no sentence waiting or being spoken (an open stream may
        get more)."""
        return self._todo.empty() and not self._speaking

    @property
    def sample_rate(self) -> int:
        """The rate of this speech's audio: the model's (22050 or 24000 Hz)."""
        return self.scheduler.sample_rate

    @property
    def _max_undelivered(self) -> int:
        return int(self.limits.max_buffered_audio_s * self.sample_rate)

    def delivered(self, samples: int) -> None:
        """The client has ``samples`` more of the audio handed out."""
        self._undelivered -= samples
        self._space.set()

    def cancel(self) -> None:
        """Stop (idempotent): the engine stops within one chunk, a queued sentence never starts."""
        self.cancel_event.set()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        self._events.put_nowait(None)  # wakes a reader waiting in next()

    # --- the synthesis --------------------------------------------------------------------

    async def _run(self) -> None:
        stopped_by: BaseException | None = None
        try:
            await self._speak_all()
            self._events.put_nowait(None)
        except asyncio.CancelledError as err:
            stopped_by = err
            self._events.put_nowait(None)
            raise
        except ClientStalledError as err:
            stopped_by = err
            self.stalled = True
            self.cancel_event.set()
            self._events.put_nowait(err)
            if self.on_stall is not None:
                self.on_stall()
        except Exception as err:  # handed to the reader, which reports it
            stopped_by = err
            self._events.put_nowait(err)
        finally:
            self._report(stopped_by)

    async def _speak_all(self) -> None:
        index = 0
        while (item := await self._todo.get()) is not None:
            if self._started is None:
                self._started = time.monotonic()
            self._speaking = True
            try:
                for sentence in (item,) if isinstance(item, (Sentence, GrowingSentence)) else item:
                    await self._speak(index, sentence)
                    index += 1
            finally:
                self._speaking = False
        if index:
            self._log_done()

    async def _speak(self, index: int, item: Sentence | GrowingSentence) -> None:
        scheduler, limits = self.scheduler, self.limits
        engine = await scheduler.wait_ready(limits.load_wait_s)
        growing = item.text if isinstance(item, GrowingSentence) else None
        sentence = item.so_far if isinstance(item, GrowingSentence) else item
        voice, instruct = self.voices.resolve(scheduler.catalog, engine.instruction_form, sentence)
        self._voices_used[voice.name] = None
        if index == 0:
            self._choose_profile(engine, voice, growing=growing is not None)
        await self._wait_for_space()
        if self.cancel_event.is_set():
            raise SynthesisCancelled("cancelled before the sentence started")
        _LOGGER.debug("Speaking sentence %d as %s for %s (queue %d)", index + 1, voice.name,
                      self.client, scheduler.waiting)  # fmt: skip
        level = self._level = await self._levels.sentence(voice, self.sample_rate)
        self._events.put_nowait(SentenceStart(index, sentence, voice))
        engine_started = time.monotonic()
        try:
            await self._synthesize(
                voice,
                growing or sentence.text,
                self.settings.options(voice, instruct, sentence, self.voices.speed),
                load_timeout=limits.load_wait_s,
            )
        except (EngineError, ValueError) as err:  # TextInputError is a ValueError
            if not self.skip_failed or isinstance(err, SynthesisCancelled):
                raise
            self._events.put_nowait(SentenceEnd(index, skipped=err))
            return
        finally:
            self.engine_s += time.monotonic() - engine_started
        self._events.put_nowait(SentenceEnd(index))
        await self._levels.finished(level)

    def _choose_profile(self, engine: Engine, voice: Voice, *, growing: bool) -> None:
        """``auto``: the profile of this request, chosen once by the text given so far
        (``growing``: its first sentence is still arriving)."""
        auto = self.scheduler.auto
        if auto is None or self.settings.profile.name != AUTO_PROFILE:
            return
        profile = auto.choose(
            " ".join(self._known_text),
            engine=engine,
            speaker=voice.speaker,
            client=self.client,
            force_tokens=self.settings.force_tokens,
            growing=growing,
        )
        self.settings = replace(self.settings, profile=profile)

    async def _synthesize(
        self,
        voice: Voice,
        text: str | TextFeed,
        options: SynthesisOptions,
        *,
        load_timeout: float,
    ) -> None:
        """One sentence's audio through :meth:`_on_chunk`: replayed from the repeat cache when
        it was spoken lately, else made by the engine and kept for the next time (a sentence
        still arriving is neither: its text is not known yet)."""
        scheduler = self.scheduler
        if isinstance(text, TextFeed):
            await scheduler.synthesize(text, options, self.cancel_event, self._on_chunk,
                                       load_timeout=load_timeout)  # fmt: skip
            return
        cached = scheduler.repeat_cache.lookup(text, voice, options, scheduler.catalog,
                                               count=self.front_end is not None)  # fmt: skip
        if cached.hit:
            for chunk in cached.replay():
                await self._on_chunk(chunk)
            return
        on_chunk = cached.record(self._on_chunk)
        await scheduler.synthesize(text, options, self.cancel_event, on_chunk,
                                   load_timeout=load_timeout)  # fmt: skip
        if not self.cancel_event.is_set():  # a cancelled engine may stop without raising
            cached.store()

    async def _on_chunk(self, chunk: AudioChunk) -> None:
        if chunk.sample_rate != self.sample_rate:
            raise EngineError(
                f"engine produced {chunk.sample_rate} Hz, expected {self.sample_rate}"
            )
        if self.first_audio_s is None and self._started is not None:
            self.first_audio_s = time.monotonic() - self._started
        level = self._level
        audio = Audio(level.pcm16(chunk.samples) if level is not None else chunk.pcm16)
        self.samples += audio.samples
        self._undelivered += audio.samples
        self._events.put_nowait(audio)

    async def _wait_for_space(self) -> None:
        while self._undelivered >= self._max_undelivered:
            self._space.clear()
            try:
                await asyncio.wait_for(self._space.wait(), self.limits.stall_timeout_s)
            except asyncio.TimeoutError as err:
                raise ClientStalledError("the client stopped reading") from err

    def _log_done(self) -> None:
        elapsed = time.monotonic() - (self._started or time.monotonic())
        _LOGGER.info(
            "Spoke %.2f s of audio (%s) for %s with profile %s: first audio after %.2f s, "
            "done in %.2f s", self.samples / self.sample_rate, ", ".join(self._voices_used),
            self.client, self.settings.profile.name, self.first_audio_s or 0.0, elapsed,
        )  # fmt: skip

    def _report(self, stopped_by: BaseException | None) -> None:
        """Tell the server's metrics how this request went (front ends' requests only)."""
        if self.front_end is None:
            return
        self.scheduler.metrics.speech_done(SpeechReport(
            front_end=self.front_end, outcome=speech_outcome(stopped_by, self.stalled),
            profile=self.settings.profile.name, audio_s=self.samples / self.sample_rate,
            engine_s=self.engine_s, first_audio_s=self.first_audio_s,
        ))  # fmt: skip
