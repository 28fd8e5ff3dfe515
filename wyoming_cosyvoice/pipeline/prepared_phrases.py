"""Phrases spoken into the repeat cache while the engine is idle (``cache.prepare_phrases``).

A household hears some texts again and again ("The front door is open."). Listed here, each
is spoken once after the model has loaded, as a Wyoming ``synthesize`` that names no voice
would have it (the server's default voice, else one of the text's language; the server's
profile, speed and seed), and its sentences stay in the repeat cache: the first real request for
them plays at once. Only on an idle engine: a phrase starts once no sentence has been queued
or spoken for :data:`IDLE_S`, and a request that comes meanwhile cancels it within one engine
step; it is spoken again at the next idle time (its finished sentences are hits by then). A
phrase is prepared once: one the cache later drops is made again by its next request.
"""

from __future__ import annotations

import asyncio
import logging

from engine.core.types import EngineError, SynthesisCancelled
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.errors import ClientError
from wyoming_cosyvoice.pipeline.scheduler import Scheduler
from wyoming_cosyvoice.pipeline.sentences import SplitterFactory, iter_sentences, opening_language
from wyoming_cosyvoice.pipeline.speech import Audio, Speech, SpeechSettings, VoiceChoice

_LOGGER = logging.getLogger(__name__)

IDLE_S = 1.0  # how long the engine must have been idle before a phrase starts
POLL_S = 0.05  # how often idleness, and a request that pre-empts a phrase, are checked


class PhrasePreparer:
    """Speaks the configured phrases into the repeat cache, one at a time, when idle."""

    def __init__(
        self, config: ServerConfig, scheduler: Scheduler, splitter_factory: SplitterFactory
    ) -> None:
        self.config, self.scheduler, self.splitter_factory = config, scheduler, splitter_factory
        self.prepared = 0  # phrases in the cache
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def start_for(
        cls, config: ServerConfig, scheduler: Scheduler, splitter_factory: SplitterFactory
    ) -> PhrasePreparer | None:
        """A running preparer for the config's phrases; None when there is nothing to do."""
        if not config.cache.prepare_phrases:
            return None
        if not scheduler.repeat_cache.enabled:
            _LOGGER.warning("cache.prepare_phrases is set but the repeat cache is off "
                            "(cache.max_mb: 0): no phrase is prepared")  # fmt: skip
            return None
        preparer = cls(config, scheduler, splitter_factory)
        preparer._task = asyncio.create_task(preparer.run(), name="prepare phrases")
        return preparer

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def run(self) -> None:
        try:
            await asyncio.shield(self.scheduler.ready)
        except Exception:  # a failed load is reported (and ends the server) elsewhere
            return
        for text in self.config.cache.prepare_phrases:
            try:
                while not await self._prepare(text):
                    _LOGGER.debug("A request pre-empted the phrase %r; again when idle", text)
            except SynthesisCancelled:
                return  # the server is stopping
            except (EngineError, ClientError, ValueError) as err:
                _LOGGER.warning("The phrase %r cannot be prepared: %s", text, err)
                continue
            self.prepared += 1
        _LOGGER.info("Prepared %d of %d phrase(s) in the repeat cache", self.prepared,
                     len(self.config.cache.prepare_phrases))  # fmt: skip

    async def _prepare(self, text: str) -> bool:
        """Speak ``text`` into the cache once the engine is idle; False if a request
        pre-empted it."""
        await self._wait_until_idle()
        speech = self._speech(text)
        watcher = asyncio.create_task(self._preempt_on_request(speech))
        try:
            while (event := await speech.next()) is not None:
                if isinstance(event, Audio):
                    speech.delivered(event.samples)
        except SynthesisCancelled:
            if not watcher.done():
                raise  # not pre-empted: the server is stopping
        finally:
            preempted = watcher.done()  # it ends by itself only when it cancelled the phrase
            watcher.cancel()
            speech.cancel()
        return not preempted

    def _speech(self, text: str) -> Speech:
        """``text`` as a Wyoming ``synthesize`` that names no voice speaks it."""
        config = self.config
        voices = VoiceChoice(None, config.voice, text_language=opening_language(text),
                             speaker_instructs=True)  # fmt: skip
        settings = SpeechSettings(config.profile, config.seed, config.force_tokens,
                                  speed=config.speed)  # fmt: skip
        speech = Speech(self.scheduler, settings, voices, config.limits,
                        client="phrase preparation")  # fmt: skip
        speech.say_all(iter_sentences(text, self.splitter_factory()), text)
        speech.end()
        return speech

    async def _wait_until_idle(self) -> None:
        loop = asyncio.get_running_loop()
        idle_since: float | None = None
        while idle_since is None or loop.time() - idle_since < IDLE_S:
            if not self.scheduler.idle:
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            await asyncio.sleep(POLL_S)

    async def _preempt_on_request(self, speech: Speech) -> None:
        """Cancel the phrase as soon as a request's sentence waits for or shares the engine
        (returns then; it is cancelled itself when the phrase ends first)."""
        scheduler = self.scheduler
        while scheduler.waiting == 0 and scheduler.active_sentences <= 1:
            await asyncio.sleep(POLL_S)
        speech.cancel_event.set()  # the engine stops within one step
