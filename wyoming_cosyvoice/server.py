"""The model host (engine loading and fair synthesis in turn) and the listening server.

Threading model: the asyncio loop only parses events and moves bytes. Every engine call (load,
warmup, each ``next()`` of a synthesis generator, ``close()``) runs on a dedicated engine
thread: one per slot (``server.parallel_sentences``, 1 by default), and a sentence keeps its
slot's thread from start to close, so its calls run in submission order with the same
thread-local torch state. Requests from all connections take a slot in FIFO order, once per
sentence: a long text cannot starve a short one, and ``describe`` never waits for it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import pickle
import threading
import zipfile
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from engine.types import AudioChunk, SynthesisCancelled, SynthesisOptions
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.info import VoiceCatalog
from wyoming_cosyvoice.protocol import ServerBusyError

_LOGGER = logging.getLogger(__name__)


class Engine(Protocol):
    """The part of ``engine.engine.CosyVoiceEngine`` the server uses."""

    speakers: list[str]
    kind: str

    def synthesize(
        self, text: str, options: SynthesisOptions, cancel: threading.Event | None = None
    ) -> Iterator[AudioChunk]: ...

    def warmup(self) -> None: ...


EngineFactory = Callable[[Path, "int | None"], Engine]


def load_cosyvoice(
    model_dir: Path,
    threads: int | None,
    lm_int8: bool = True,
    int8_cache_dir: Path | None = None,
    flow_int8: bool = False,
    hift_bf16: bool = False,
) -> Engine:
    """The real engine; imported here so torch loads on the engine thread, not at startup."""
    from engine.engine import CosyVoiceEngine

    return CosyVoiceEngine.load(
        model_dir,
        threads=threads,
        lm_int8=lm_int8,
        flow_int8=flow_int8,
        hift_bf16=hift_bf16,
        int8_cache_dir=int8_cache_dir,
    )


def int8_cache_dir(config: ServerConfig) -> Path | None:
    """``<download dir>/.cache/int8`` (persistent /data in the add-on) if that dir exists.

    None (the user's cache dir) otherwise: a cache must not create a data dir of its own.
    """
    data = config.effective_download_dir
    return data / ".cache" / "int8" if data.is_dir() else None


# --- speaker names without torch ------------------------------------------------------------


class _Stub:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


class _NamesOnlyUnpickler(pickle.Unpickler):
    """Reads the dict keys of a torch checkpoint; every tensor becomes an inert stub."""

    _ALLOWED = {("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module.startswith("torch"):
            return _Stub  # never import or call anything from the file
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed")

    def persistent_load(self, pid: Any) -> None:
        return None


def peek_speakers(model_dir: Path) -> list[str] | None:
    """Speaker names from ``spk2info.pt`` in milliseconds, before torch is even imported.

    Lets ``describe`` list the right voices while the model is still loading. ``None`` if the
    file is missing or unreadable (the engine's own list is used once it has loaded).
    """
    path = model_dir / "spk2info.pt"
    try:
        with zipfile.ZipFile(path) as archive:
            pkl = next(n for n in archive.namelist() if n.endswith("data.pkl"))
            with archive.open(pkl) as f:
                table = _NamesOnlyUnpickler(f).load()
    except Exception as err:  # a hint only; never fatal
        _LOGGER.debug("Could not read speaker names from %s: %s", path, err)
        return None
    if not isinstance(table, dict) or not all(isinstance(k, str) for k in table):
        return None
    return list(table)


# --- the model host -------------------------------------------------------------------------


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


class ModelHost:
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
        engine_factory: EngineFactory = load_cosyvoice,
        threads: int | None = None,
        warmup: bool = True,
        speakers_hint: list[str] | None = None,
        parallel: int = 1,
        shared_cores: bool = False,
    ) -> None:
        self.model_dir = model_dir
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
        self.waiting = 0  # requests queued for the engine (for the log)
        self._calls: set[Future[Any]] = set()  # engine-thread calls that have not returned
        self._sentences: dict[object, threading.Event] = {}  # cancel event of each sentence
        self._stopping = False

    @property
    def idle(self) -> bool:
        """No sentence holds or waits for the engine."""
        return self.waiting == 0 and self._slots.all_free

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
            if self._warmup:
                await self._call(self._executor, engine.warmup)
            if self._shared_cores:
                self._all_threads = await self._call(self._executor, _torch_threads)
            _LOGGER.info(
                "Model ready in %.1f s (%s, HiFT in %s, speakers: %s)",
                loop.time() - start,
                getattr(engine, "kind", "?"),
                getattr(engine, "hift_dtype", "float32"),  # bfloat16: the fast profiles
                ", ".join(engine.speakers) or "none",
            )
        except BaseException as err:
            if not self._ready.done():
                self._ready.set_exception(err)
                self._ready.exception()  # retrieved: no "never retrieved" log; waiters see it
            raise
        self.engine = engine
        self.catalog = VoiceCatalog(list(engine.speakers))
        self._ready.set_result(engine)
        return engine

    async def wait_ready(self, timeout: float) -> Engine:
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except asyncio.TimeoutError as err:
            raise ServerBusyError(f"the model is still loading after {timeout:.0f} s") from err

    async def synthesize(
        self,
        text: str,
        options: SynthesisOptions,
        cancel: threading.Event,
        on_chunk: Callable[[AudioChunk], Awaitable[None]],
        *,
        load_timeout: float,
    ) -> None:
        """Synthesize ``text`` (one sentence) and await ``on_chunk`` for each chunk, in order.

        Waits its turn (FIFO) behind other requests. Raises ``SynthesisCancelled`` when
        ``cancel`` is set (the engine stops within one chunk) or the host is stopping.
        """
        key = object()  # sentences of one request share its cancel event
        self._sentences[key] = cancel
        try:
            await self._synthesize(text, options, cancel, on_chunk, load_timeout=load_timeout)
        finally:
            del self._sentences[key]

    async def _synthesize(
        self,
        text: str,
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
        try:
            if cancel.is_set() or self._stopping:
                raise SynthesisCancelled("cancelled while queued")
            chunks = await self._call(
                executor, _with_threads, budget, partial(engine.synthesize, text, options, cancel)
            )
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


def _torch_threads() -> int:
    import torch  # already loaded by the engine

    return torch.get_num_threads()


def _with_threads(budget: Callable[[], int] | None, fn: Callable[[], Any]) -> Any:
    """``fn()`` after setting this thread's torch thread count to ``budget()`` (None: as it
    is). Also for engines that do not ask the budget themselves."""
    if budget is not None:
        from engine.thread_budget import apply_thread_budget  # torch: loaded by the engine

        apply_thread_budget(budget)
    return fn()


def _idle() -> None:
    """Nothing: queued on an engine thread, it returns once the work before it is done."""


def _close_quietly(chunks: Iterator[AudioChunk]) -> None:
    close = getattr(chunks, "close", None)
    if close is not None:
        try:
            close()
        except Exception:  # a failing cleanup must not kill the engine thread
            _LOGGER.exception("Closing a synthesis generator failed")


# --- the listening server -------------------------------------------------------------------


@dataclass
class RunningServer:
    """A started server: its socket address, the model host and a way to stop it."""

    server: asyncio.Server
    host: ModelHost
    config: ServerConfig
    load_task: asyncio.Task[Engine]
    handlers: set[asyncio.Task[None]] = field(default_factory=set)

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.close()
        for task in list(self.handlers):
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        if not self.load_task.done():
            self.load_task.cancel()
        self.host.shutdown()


def engine_loader(config: ServerConfig) -> EngineFactory:
    """The real loader with the config's load-time weight formats (LM: a server setting, flow
    and HiFT: the server profile's) and int8 cache directory."""
    weights = config.load.weights
    return partial(
        load_cosyvoice,
        lm_int8=weights.lm == "int8",
        flow_int8=weights.flow == "int8",
        hift_bf16=weights.hift == "bf16",
        int8_cache_dir=int8_cache_dir(config),
    )


def host_for_config(
    config: ServerConfig, model_dir: Path, engine_factory: EngineFactory = load_cosyvoice
) -> ModelHost:
    """The model host both front ends use: the config's threads, warm-up and engine loader.

    ``engine_factory`` other than the real loader (a test fake) is used as given.
    """
    if engine_factory is load_cosyvoice:
        engine_factory = engine_loader(config)
    # Sentences share the cores (every core for one alone, one thread each side by side)
    # unless the user set a thread count: on every core each, two sentences oversubscribe the
    # cores (measured: 0.19 instead of 0.27 audio-s/s for two at once, docs/performance.md).
    shared_cores = config.threads is None and config.parallel_sentences > 1
    return ModelHost(
        model_dir,
        engine_factory=engine_factory,
        threads=config.threads,
        warmup=config.warmup,
        speakers_hint=peek_speakers(model_dir),
        parallel=config.parallel_sentences,
        shared_cores=shared_cores,
    )


async def create_server(
    config: ServerConfig,
    model_dir: Path,
    *,
    engine_factory: EngineFactory = load_cosyvoice,
    splitter_factory: Callable[[], Any] | None = None,
) -> RunningServer:
    """Listen on ``config.uri`` at once, then load the model in the background.

    ``engine_factory``/``splitter_factory`` are test hooks (a fake engine, a fixed splitter).
    """
    from wyoming_cosyvoice.handler import ConnectionContext, EventHandler
    from wyoming_cosyvoice.sentences import make_splitter

    host = host_for_config(config, model_dir, engine_factory)
    context = ConnectionContext(config, host, splitter_factory or make_splitter)
    handlers: set[asyncio.Task[None]] = set()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        handlers.add(task)
        try:
            await EventHandler(reader, writer, context).run()
        except asyncio.CancelledError:
            pass  # server shutdown; asyncio would log a cancelled connection task as an error
        finally:
            handlers.discard(task)

    # The reader's line limit is the header limit: a longer line raises LimitOverrunError.
    limit = config.limits.max_header_bytes
    url = urlparse(config.uri)
    if url.scheme == "unix":
        Path(url.path).unlink(missing_ok=True)
        server = await asyncio.start_unix_server(on_connect, path=url.path, limit=limit)
    else:
        if url.hostname is None or url.port is None:
            raise ValueError(
                f"--uri {config.uri!r} needs a host and a port, e.g. tcp://0.0.0.0:10200"
            )
        server = await asyncio.start_server(on_connect, url.hostname, url.port, limit=limit)
    _LOGGER.info("Listening on %s", config.uri)
    load_task = asyncio.create_task(host.load(), name="load model")
    return RunningServer(server, host, config, load_task, handlers)
