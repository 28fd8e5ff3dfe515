"""The scheduler: loads the engine in the background and runs its syntheses in turn.

Threading model: the asyncio loop only parses events and moves bytes. Every engine call (load,
warmup, each ``next()`` of a synthesis generator, ``close()``) runs on a dedicated engine
thread: one per slot (``server.parallel_sentences``, 1 by default), and a sentence keeps its
slot's thread from start to close, so its calls run in submission order with the same
thread-local torch state. Requests from all connections and protocols take a slot in FIFO
order, once per sentence: a long text cannot starve a short one, and ``describe`` never waits
for it. The scheduler also holds what the loaded model offers: its voice catalogue.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import Awaitable, Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.api import Engine, PrimesVoices, SpeaksGrowingText
from engine.core.constants import SAMPLE_RATE
from engine.core.text_feed import TextFeed
from engine.core.types import AudioChunk, SynthesisCancelled, SynthesisOptions
from wyoming_cosyvoice.errors import ServerBusyError
from wyoming_cosyvoice.pipeline.metrics import ServerMetrics
from wyoming_cosyvoice.pipeline.repeat_cache import RepeatCache
from wyoming_cosyvoice.voices.catalog import VoiceCatalog
from wyoming_cosyvoice.voices.loudness import VoiceLevels

if TYPE_CHECKING:
    from engine.text.pronunciations import PronunciationCheck
    from wyoming_cosyvoice.auto.profile import AutoProfile
    from wyoming_cosyvoice.config import ProfileConfig

_LOGGER = logging.getLogger(__name__)


def speaks_growing(engine: Engine | None) -> bool:
    """The engine speaks a sentence while its text is still arriving."""
    return isinstance(engine, SpeaksGrowingText)


EngineFactory = Callable[[Path, "int | None"], Engine]


# --- engine slots ---------------------------------------------------------------------------


class _Slots:
    """Engine slots, handed out in FIFO order (lowest free slot first).

    A waiter asking for every slot (an exclusive job) waits its turn like any other: later
    requests never overtake it.
    """

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = list(range(count))
        self._waiters: collections.deque[tuple[int, asyncio.Future[list[int]]]] = (
            collections.deque()
        )

    async def acquire(self, n: int = 1) -> list[int]:
        if not self._waiters and len(self._free) >= n:
            return self._take(n)
        future: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._waiters.append((n, future))
        try:
            return await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(future.result())  # granted just as the waiter was cancelled
            else:
                self._waiters = collections.deque(w for w in self._waiters if w[1] is not future)
                self._wake()  # a cancelled head must not block the waiters behind it
            raise

    @property
    def all_free(self) -> bool:
        return len(self._free) == self.count

    @property
    def busy(self) -> int:
        """How many slots are taken."""
        return self.count - len(self._free)

    def release(self, slots: list[int]) -> None:
        self._free = sorted(self._free + slots)
        self._wake()

    def _take(self, n: int) -> list[int]:
        taken, self._free = self._free[:n], self._free[n:]
        return taken

    def _wake(self) -> None:
        while self._waiters and len(self._free) >= self._waiters[0][0]:
            n, future = self._waiters.popleft()
            if not future.done():
                future.set_result(self._take(n))


class Scheduler:
    """Owns the engine: loads it in the background and runs its syntheses in turn.

    ``parallel`` sentences run at once, each on its own engine thread (slot).

    ``shared_cores``: with ``parallel`` > 1, a sentence running alone on slot 0 gets every
    torch thread and sentences side by side get one each: set before every chunk, and asked
    again by the engine before every LM token and flow step (``SynthesisOptions.threads``;
    torch's thread count belongs to each thread). Only slot 0 ever runs more than one: a
    thread that has run a multi-thread OpenMP team keeps it, idle, for as long as it lives,
    and an idle team beside an active one slows the active one's operations (measured: a
    140-row product 275 → 364 µs). New sentences take the lowest free slot, so a
    sentence that arrives alone is on slot 0.
    """

    def __init__(
        self,
        model_dir: Path,
        *,
        engine_factory: EngineFactory,
        threads: int | None = None,
        warmup: bool = True,
        speakers_hint: list[str] | None = None,
        parallel: int = 1,
        shared_cores: bool = False,
        sample_rate: int = SAMPLE_RATE,
        instruction_form: str | None = None,
        prime_options: Sequence[SynthesisOptions] = (),
        repeat_cache: RepeatCache | None = None,
        levels: VoiceLevels | None = None,
        auto: AutoProfile | None = None,
        pronunciations: Sequence[str] = (),
    ) -> None:
        self.model_dir = model_dir
        # The rate of the audio the engine makes: the model family's until it has loaded.
        self.sample_rate = sample_rate
        # How the model reads an instruction (engine.api; None: it takes none): the model
        # family's word for the directory until the engine says it.
        self.instruction_form = instruction_form
        # The flow settings of the server's profile: an engine that primes its default voice
        # (CosyVoice2) does so with them after the warm-up, so the first request does not.
        self._prime_options = prime_options
        # The user's ``word = entry`` lines, handed to the engine once it has loaded, and how
        # each fared with the model (the log, the HTTP API).
        self._pronunciations = tuple(pronunciations)
        self.pronunciation_checks: list[PronunciationCheck] = []
        self._factory = engine_factory
        self._threads = threads
        self._shared_cores = shared_cores and parallel > 1
        self._all_threads = 1  # slot 0's torch threads after the load (shared_cores)
        self._warmup = warmup
        self._executors = [
            ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine{'' if i == 0 else i}")
            for i in range(max(1, parallel))
        ]
        self._executor = self._executors[0]  # load, warm-up and exclusive jobs
        self._slots = _Slots(len(self._executors))
        self._ready: asyncio.Future[Engine] = asyncio.get_running_loop().create_future()
        self.catalog = VoiceCatalog(speakers_hint or [])
        self.engine: Engine | None = None
        # Recently spoken sentences' audio, replayed by the speeches (off unless given one).
        self.repeat_cache = repeat_cache if repeat_cache is not None else RepeatCache(0)
        # Each voice's measured loudness and gain (off unless given: the model's level, limited).
        self.levels = levels if levels is not None else VoiceLevels.off()
        self.waiting = 0  # sentences queued for the engine (the log, /health, /metrics)
        # The auto profile's choice: it hears every sentence's stage costs (None: a fixed
        # profile, nothing measured).
        self.auto = auto
        self.metrics = ServerMetrics()  # what every front end's requests report
        self.metrics.add_cache(self.repeat_cache)  # its hits, size and budget in /metrics
        self._calls: set[Future[Any]] = set()  # engine-thread calls that have not returned
        self._sentences: dict[object, threading.Event] = {}  # cancel event of each sentence
        self._stopping = False

    @property
    def idle(self) -> bool:
        """No sentence holds or waits for the engine."""
        return self.waiting == 0 and self._slots.all_free

    @property
    def active_sentences(self) -> int:
        """Sentences queued for or running on the engine."""
        return len(self._sentences)

    @property
    def ready(self) -> asyncio.Future[Engine]:
        """Resolves to the engine, or raises the load error."""
        return self._ready

    async def load(self) -> Engine:
        """Load (and warm up) the engine on the engine thread."""
        loop = asyncio.get_running_loop()
        try:
            _LOGGER.info("Loading model from %s", self.model_dir)
            start = loop.time()
            engine = await self._call(self._executor, self._factory, self.model_dir, self._threads)
            if self._pronunciations:
                self.pronunciation_checks = await self._call(
                    self._executor, engine.use_pronunciations, self._pronunciations
                )
                log_pronunciation_checks(self.pronunciation_checks)
            if self._warmup:
                await self._call(self._executor, engine.warmup)
                await self._prime(engine)
                if self.auto is not None:
                    await self._call(self._executor, self.auto.calibrate, engine)
                    await self._unprime(engine, self.auto.out_of_reach(engine))
            if self._shared_cores:
                self._all_threads = await self._call(self._executor, _torch_threads)
            _LOGGER.info(
                "Model ready in %.1f s (%s, HiFT in %s, speakers: %s)",
                loop.time() - start,
                engine.kind,
                engine.hift_dtype,  # bfloat16: the fast profiles
                ", ".join(engine.speakers) or "none",
            )
        except BaseException as err:
            if not self._ready.done():
                self._ready.set_exception(err)
                self._ready.exception()  # retrieved: no "never retrieved" log; waiters see it
            raise
        self.engine = engine
        self.sample_rate = engine.sample_rate
        self.instruction_form = engine.instruction_form
        self.catalog = VoiceCatalog(list(engine.speakers))
        self._ready.set_result(engine)
        return engine

    async def _prime(self, engine: Engine) -> None:
        """Prime the default voice for the flow settings of the server's profile (``auto``:
        of every profile it chooses from), if the engine primes voices."""
        if not isinstance(engine, PrimesVoices) or not engine.speakers:
            return
        for options in self._prime_options:
            await self._call(self._executor, engine.prime_voice, options)

    async def _unprime(self, engine: Engine, profiles: Sequence[ProfileConfig]) -> None:
        """Let go of the default voice's primed prompt for profiles auto will not choose on this
        machine (CosyVoice2: half a gigabyte for realtime's settings)."""
        if not isinstance(engine, PrimesVoices) or not engine.speakers:
            return
        for profile in profiles:
            options = profile.options(speaker=None, seed=None, instruct=None, force_tokens=None)
            await self._call(self._executor, engine.unprime_voice, options)
            _LOGGER.info("Profile %s cannot start in time here: its primed voice let go",
                         profile.name)  # fmt: skip

    async def wait_ready(self, timeout: float) -> Engine:
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except asyncio.TimeoutError as err:
            raise ServerBusyError(f"the model is still loading after {timeout:.0f} s") from err

    async def synthesize(
        self,
        text: str | TextFeed,
        options: SynthesisOptions,
        cancel: threading.Event,
        on_chunk: Callable[[AudioChunk], Awaitable[None]],
        *,
        load_timeout: float,
    ) -> None:
        """Synthesize ``text`` (one sentence, or one still arriving: :func:`speaks_growing`
        engines only) and await ``on_chunk`` for each chunk, in order.

        Waits its turn (FIFO) behind other requests. Raises ``SynthesisCancelled`` when
        ``cancel`` is set (the engine stops within one chunk) or the scheduler is stopping.
        """
        key = object()  # sentences of one request share its cancel event
        self._sentences[key] = cancel
        try:
            await self._synthesize(text, options, cancel, on_chunk, load_timeout=load_timeout)
        finally:
            del self._sentences[key]

    async def _synthesize(
        self,
        text: str | TextFeed,
        options: SynthesisOptions,
        cancel: threading.Event,
        on_chunk: Callable[[AudioChunk], Awaitable[None]],
        *,
        load_timeout: float,
    ) -> None:
        if self._stopping:
            raise SynthesisCancelled("the server is shutting down")
        engine = await self.wait_ready(load_timeout)
        self.waiting += 1
        try:
            (slot,) = await self._slots.acquire()
        finally:
            self.waiting -= 1
        executor = self._executors[slot]
        # One policy, applied on the slot's thread before each call and by the engine before
        # each LM token and flow step.
        budget = partial(self._shared_threads, slot) if self._shared_cores else None
        if budget is not None:
            options = replace(options, threads=budget)
        if self.auto is not None:
            options = replace(options, on_stage=self.auto.meter.record)
        try:
            if cancel.is_set() or self._stopping:
                raise SynthesisCancelled("cancelled while queued")
            if isinstance(text, str):
                start = partial(engine.synthesize, text, options, cancel)
            elif isinstance(engine, SpeaksGrowingText):
                start = partial(engine.synthesize_growing, text, options, cancel)
            else:  # the speech asks only when speaks_growing(engine)
                raise TypeError(f"the {engine.kind} engine cannot speak a growing sentence")
            chunks = await self._call(executor, _with_threads, budget, start)
            try:
                next_chunk = partial(next, chunks, None)
                while (
                    chunk := await self._call(executor, _with_threads, budget, next_chunk)
                ) is not None:
                    await on_chunk(chunk)
                    if cancel.is_set():
                        raise SynthesisCancelled("cancelled by the client")
            finally:
                # Queued behind any in-flight next(): the slot's thread runs it in order,
                # even when this task was cancelled mid-await.
                self._submit(executor, _close_quietly, chunks)
        finally:
            self._slots.release([slot])

    def _threads_for(self, slot: int) -> int | None:
        """Torch threads for the sentence on ``slot`` from now on (None without
        ``shared_cores``: leave them). Asked on the loop before each chunk and by the engine,
        from its threads, before each LM token and flow step (reads of two ints: no lock)."""
        return self._shared_threads(slot) if self._shared_cores else None

    def _shared_threads(self, slot: int) -> int:
        """With ``shared_cores``: every core for a sentence alone on the first slot, else one."""
        return self._all_threads if slot == 0 and self._slots.busy == 1 else 1

    async def run_on_engine(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the engine thread, in its turn: between two sentences, FIFO with
        queued requests (custom voice scans, which may take seconds, never cut into audio).
        No sentence runs meanwhile."""
        slots = await self._slots.acquire(self._slots.count)
        try:
            # A cancelled sentence frees its slot before its thread has finished its last chunk
            # and close(): wait for the other slots' threads to be idle too.
            await asyncio.gather(*(self._call(e, _idle) for e in self._executors[1:]))
            return await self._call(self._executor, partial(fn, *args))
        finally:
            self._slots.release(slots)

    def _submit(
        self, executor: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any
    ) -> Future[Any]:
        """``fn(*args)`` on an engine thread, tracked until it has returned, even when its
        caller stops waiting for it: :meth:`wait_idle` waits for exactly these calls."""
        call = executor.submit(fn, *args)
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)
        return call

    def _call(
        self, executor: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any
    ) -> Awaitable[Any]:
        """:meth:`_submit`, awaitable on the loop."""
        return asyncio.wrap_future(self._submit(executor, fn, *args))

    def cancel_all(self) -> int:
        """Shutdown: cancel every sentence now, running or queued, and refuse new ones.

        The engine sees the cancel event at its next check (each LM token, each chunk).
        Returns how many requests were cancelled.
        """
        self._stopping = True
        requests = {id(cancel): cancel for cancel in list(self._sentences.values())}
        for cancel in requests.values():
            cancel.set()
        return len(requests)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the engine threads' calls to return.

        False if one is still running: a computation in progress (a load, a long flow pass)
        cannot be interrupted, only abandoned with the process.
        """
        running = [call for call in list(self._calls) if not call.done()]
        if not running:
            return True
        # Outcomes (a cancelled sentence's exception) belong to the callers that awaited them.
        outcomes = asyncio.gather(*map(asyncio.wrap_future, running), return_exceptions=True)
        try:
            await asyncio.wait_for(asyncio.shield(outcomes), max(timeout, 0.0))
        except asyncio.TimeoutError:
            return False
        return True

    def shutdown(self) -> None:
        for executor in self._executors:
            executor.shutdown(wait=False, cancel_futures=True)
        self.levels.close()


def log_pronunciation_checks(checks: Sequence[PronunciationCheck]) -> None:
    """A WARNING line per pronunciation the model cannot apply, one INFO line for the rest:
    the server speaks on with the lines it could apply."""
    for check in checks:
        if check.problem is not None:
            _LOGGER.warning("%s", check.message())
    applied = [check.word for check in checks if check.problem is None]
    _LOGGER.info("Pronunciations applied: %d of %d%s", len(applied), len(checks),
                 f" ({', '.join(map(repr, applied))})" if applied else "")  # fmt: skip


def _torch_threads() -> int:
    import torch  # already loaded by the engine

    return torch.get_num_threads()


def _with_threads(budget: Callable[[], int] | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` after setting this thread's torch thread count to ``budget()`` (None: as it
    is). Also for engines that do not ask the budget themselves."""
    if budget is not None:
        from engine.core.thread_budget import apply_thread_budget  # torch: loaded by the engine

        apply_thread_budget(budget)
    return fn()


def _idle() -> None:
    """Nothing: queued on an engine thread, it returns once the work before it is done."""


def _close_quietly(chunks: Iterator[AudioChunk]) -> None:
    if isinstance(chunks, Generator):
        try:
            chunks.close()
        except Exception:  # a failing cleanup must not kill the engine thread
            _LOGGER.exception("Closing a synthesis generator failed")
