"""The Wyoming listener: one :class:`~wyoming_cosyvoice.wyoming.handler.EventHandler` per
connection, over the scheduler that loads the model in the background.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from engine.api import Engine
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.models.model import load_cosyvoice, scheduler_for_config
from wyoming_cosyvoice.pipeline.prepared_phrases import PhrasePreparer
from wyoming_cosyvoice.pipeline.scheduler import EngineFactory, Scheduler
from wyoming_cosyvoice.pipeline.sentences import SplitterFactory, make_splitter
from wyoming_cosyvoice.wyoming.handler import ConnectionContext, EventHandler

_LOGGER = logging.getLogger(__name__)


@dataclass
class RunningServer:
    """A started server: its socket address, the scheduler and a way to stop it."""

    server: asyncio.Server
    scheduler: Scheduler
    config: ServerConfig
    load_task: asyncio.Task[Engine]
    handlers: set[asyncio.Task[None]] = field(default_factory=set)
    preparer: PhrasePreparer | None = None  # cache.prepare_phrases, spoken when idle

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.close()
        for task in list(self.handlers):
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        if self.preparer is not None:
            await self.preparer.stop()
        if not self.load_task.done():
            self.load_task.cancel()
        self.scheduler.shutdown()


async def create_server(
    config: ServerConfig,
    model_dir: Path,
    *,
    engine_factory: EngineFactory = load_cosyvoice,
    splitter_factory: SplitterFactory = make_splitter,
) -> RunningServer:
    """Listen on ``config.uri`` at once, then load the model in the background.

    ``engine_factory``/``splitter_factory`` are test hooks (a fake engine, a fixed splitter).
    """
    scheduler = scheduler_for_config(config, model_dir, engine_factory)
    context = ConnectionContext(config, scheduler, splitter_factory)
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
    load_task = asyncio.create_task(scheduler.load(), name="load model")
    preparer = PhrasePreparer.start_for(config, scheduler, splitter_factory)
    return RunningServer(server, scheduler, config, load_task, handlers, preparer)
