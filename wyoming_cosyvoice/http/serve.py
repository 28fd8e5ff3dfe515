"""Run the HTTP API on Uvicorn inside the caller's event loop, next to the Wyoming listener.

Uvicorn normally owns the process (its own loop, its own SIGINT/SIGTERM handlers). Here the
CLI owns both: Uvicorn's ``Server.serve()`` runs as one task of the running loop and its signal
capture is switched off, so a signal stops Wyoming and HTTP together, in the CLI's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvicorn

from engine.api import Engine
from wyoming_cosyvoice.config import ServerConfig
from wyoming_cosyvoice.custom_voices.folder import CustomVoices
from wyoming_cosyvoice.http.stream import BODY_CUT
from wyoming_cosyvoice.models.model import load_cosyvoice, scheduler_for_config
from wyoming_cosyvoice.pipeline.prepared_phrases import PhrasePreparer
from wyoming_cosyvoice.pipeline.scheduler import EngineFactory, Scheduler
from wyoming_cosyvoice.pipeline.sentences import SplitterFactory, make_splitter

_LOGGER = logging.getLogger(__name__)
_GRACE_S = 3.0  # how long open streams may finish when the server stops


# Uvicorn's words for a response whose body ended without its last message.
_INCOMPLETE = "ASGI callable returned without completing response."


class _CutOnPurpose(logging.Filter):
    """Drops Uvicorn's error for a body that :mod:`.stream` ended early on purpose: ending a
    chunked answer without its terminating chunk is how HTTP says "incomplete", and the cut
    was already logged with its reason. Any other unfinished response is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == _INCOMPLETE and BODY_CUT.get())


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the host process handles signals


@dataclass
class HttpServer:
    """A started HTTP server: its bound port and a way to stop it."""

    server: uvicorn.Server
    task: asyncio.Task[None]

    @property
    def port(self) -> int:
        return int(self.server.servers[0].sockets[0].getsockname()[1])

    async def stop(self) -> None:
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), _GRACE_S + 2)
        except (asyncio.TimeoutError, Exception):  # stopping regardless
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


async def start_http(
    config: ServerConfig,
    scheduler: Scheduler,
    bind: str = "0.0.0.0",
    port: int = 0,
    *,
    splitter_factory: SplitterFactory = make_splitter,
    allow_origins: tuple[str, ...] = (),
    custom_voices: CustomVoices | None = None,
) -> HttpServer:
    """Listen on ``bind:port`` (0 = any free port) in the running loop; returns once bound.

    ``allow_origins``: other sites' web pages that may call the API (``--http-allow-origin``).
    ``custom_voices``: the voices folder the web page saves new voices into.
    """
    from wyoming_cosyvoice.http.app import create_app

    app = create_app(config, scheduler, splitter_factory=splitter_factory,
                     allow_origins=allow_origins, custom_voices=custom_voices)  # fmt: skip
    uv_config = uvicorn.Config(
        app,
        host=bind,
        port=port,
        lifespan="off",  # the scheduler's life is the CLI's, not the app's
        log_config=None,  # keep the CLI's logging set-up
        timeout_graceful_shutdown=int(_GRACE_S),
        # The Wyoming limit bounds HTTP connections too; over it Uvicorn answers 503.
        limit_concurrency=config.limits.max_connections,
        server_header=False,
        # Uvicorn would take the client's address from X-Forwarded-For on connections from
        # 127.0.0.1: anything on the host could then pass as Home Assistant's ingress. The
        # peer's own address is the one the origin guard trusts (origin.py).
        proxy_headers=False,
    )
    uvicorn_log = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _CutOnPurpose) for f in uvicorn_log.filters):
        uvicorn_log.addFilter(_CutOnPurpose())
    server = _EmbeddedServer(uv_config)
    task = asyncio.create_task(server.serve(), name="http server")
    while not server.started:
        if task.done():  # e.g. the port is taken: uvicorn logs it and exits
            task.result()
            raise OSError(f"cannot listen for HTTP on {bind}:{port}")
        await asyncio.sleep(0.02)
    running = HttpServer(server, task)
    _LOGGER.info("HTTP API on http://%s:%d/", bind, running.port)
    return running


@dataclass
class ModelOnly:
    """The scheduler without a Wyoming listener (``--http-only``); mirrors ``RunningServer``."""

    scheduler: Scheduler
    config: ServerConfig
    load_task: asyncio.Task[Engine]
    handlers: set[Any] = field(default_factory=set)
    preparer: PhrasePreparer | None = None  # cache.prepare_phrases, spoken when idle

    async def stop(self) -> None:
        if self.preparer is not None:
            await self.preparer.stop()
        if not self.load_task.done():
            self.load_task.cancel()
        elif not self.load_task.cancelled():
            self.load_task.exception()  # retrieved: the failure was reported by /health
        self.scheduler.shutdown()


async def start_model_only(
    config: ServerConfig, model_dir: Path, *, engine_factory: EngineFactory = load_cosyvoice
) -> ModelOnly:
    """Start loading the model in the background, as ``create_server`` does, without listening."""
    scheduler = scheduler_for_config(config, model_dir, engine_factory)
    load_task = asyncio.create_task(scheduler.load(), name="load model")
    preparer = PhrasePreparer.start_for(config, scheduler, make_splitter)
    return ModelOnly(scheduler, config, load_task, preparer=preparer)
