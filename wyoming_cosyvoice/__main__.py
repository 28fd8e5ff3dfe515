"""Command line: ``python -m wyoming_cosyvoice --uri tcp://0.0.0.0:10200 --data-dir ./data``.

Order of start-up: settings → model directory (found, or downloaded before listening; offline
with nothing present exits at once) → listen → load the model in the background (``describe``
is answered meanwhile) → optional zeroconf. A model that fails to load ends the process with
its message, so a supervisor (the add-on's s6 ``finish``) sees the failure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from wyoming_cosyvoice import __version__
from wyoming_cosyvoice.config import (
    AUTO_PROFILE,
    LM_OWN,
    LM_WEIGHTS,
    ConfigError,
    ServerConfig,
    load_config,
    parse_override,
)
from wyoming_cosyvoice.models.model import load_cosyvoice, resolve_model_dir
from wyoming_cosyvoice.pipeline.scheduler import EngineFactory

_LOGGER = logging.getLogger("wyoming_cosyvoice")
# How long a stop waits for the engine to notice its cancelled work (it checks before every LM
# token and after every audio chunk): well inside the Supervisor's 10 s before it kills.
SHUTDOWN_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="wyoming-cosyvoice",
        description="CosyVoice text to speech over the Wyoming protocol (Home Assistant).",
        epilog="Defaults come from config.yaml; any value can be set with --set KEY=VALUE. "
        "`wyoming-cosyvoice synthesize --help`: text to a WAV file without a server.",
    )
    add = p.add_argument
    add("--config", type=Path, help="settings file read over the defaults (config.yaml)")
    add("--uri", help="where to listen: tcp://HOST:PORT or unix://PATH")
    add(
        "--model",
        help="CosyVoice-300M-SFT (default), CosyVoice2-0.5B, Fun-CosyVoice3-0.5B, CosyVoice-300M "
        "or CosyVoice-300M-Instruct",
    )
    add("--model-dir", help="use this model directory instead of searching the data dirs")
    add("--data-dir", action="append", help="directory searched for models (repeatable)")
    add("--download-dir", help="where a missing model is downloaded (default: first data dir)")
    add("--voices-dir", help="custom voices folder: NAME.wav + NAME.txt (docs/custom-voices.md)")
    add(
        "--web-voice-maker",
        action="store_true",
        help="let the web page save new voices into --voices-dir (anyone who can reach the HTTP "
        "port can then add voices)",
    )
    add(
        "--stt-uri",
        help="Wyoming speech-to-text server that fills in a new voice's transcript on the web "
        "page, e.g. tcp://core-whisper:10300",
    )
    add("--voice", help="default voice, e.g. zh-female (default: by the text's language)")
    add(
        "--profile",
        help="auto (default: per request, the most exact profile this machine speaks in time) "
        "or a settings profile from config.yaml: realtime, fast, faster, fastest, quality, batch, "
        "...",
    )
    add(
        "--lm-weights",
        choices=(LM_OWN, *LM_WEIGHTS),
        help="LM decoder weights: profile (default: each profile's own, int4 in the fast ones, "
        "int8 in the others), or for every profile int8 (3x faster than fp32), int4 (fewer "
        "bytes where the CPU has a fast int4 kernel; docs/dev/int4.md) or fp32 (exact official "
        "maths)",
    )
    add("--threads", type=int, help="CPU threads for the engine at most (0: all cores)")
    add(
        "--parallel-sentences",
        type=int,
        metavar="N",
        help="sentences synthesized at once for simultaneous clients (default 1)",
    )
    add("--samples-per-chunk", type=int, help="audio samples per audio-chunk event")
    add("--no-streaming", action="store_true", help="do not advertise streaming text input")
    add("--zeroconf", nargs="?", const="cosyvoice", metavar="NAME", help="advertise over mDNS")
    add("--seed", type=int, help="fixed sampling seed (reproducible audio)")
    add("--hub-endpoint", help="Hugging Face hub URL (default: HF_ENDPOINT or huggingface.co)")
    add("--offline", action="store_true", help="never download a model")
    add("--no-warmup", action="store_true", help="skip the warm-up synthesis after loading")
    add("--set", action="append", default=[], metavar="KEY=VALUE", help="override any config key")
    add("--debug", action="store_true", help="log DEBUG messages")
    add("--log-format", help="logging format string")
    add("--http-port", type=int, help="also serve the HTTP API and web page on this port")
    add("--http-host", default="0.0.0.0", help="address of the HTTP API (default 0.0.0.0)")
    add("--http-only", action="store_true", help="serve only HTTP, no Wyoming listener")
    add("--http-allow-origin", action="append", default=[], metavar="ORIGIN",
        help="another site's web page allowed to call the HTTP API (repeatable or a comma list; "
             "* = any)")  # fmt: skip
    add("--version", action="store_true", help="print the version and exit")
    return p


_FLAG_KEYS = {
    "uri": "server.uri",
    "model": "server.model",
    "model_dir": "server.model_dir",
    "download_dir": "server.download_dir",
    "voices_dir": "server.voices_dir",
    "stt_uri": "server.stt_uri",
    "voice": "server.voice",
    "profile": "server.profile",
    "threads": "server.threads",
    "parallel_sentences": "server.parallel_sentences",
    "lm_weights": "server.lm_weights",
    "samples_per_chunk": "server.samples_per_chunk",
    "zeroconf": "server.zeroconf",
    "seed": "server.seed",
    "hub_endpoint": "server.hub_endpoint",
    "log_format": "server.log_format",
}


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """config.yaml ← --set ← dedicated flags (the most specific wins)."""
    overrides: list[tuple[str, Any]] = [parse_override(item) for item in args.set]
    overrides += [
        (key, getattr(args, flag))
        for flag, key in _FLAG_KEYS.items()
        if getattr(args, flag) is not None
    ]
    if args.data_dir:
        overrides.append(("server.data_dirs", list(args.data_dir)))
    for flag, key, value in (
        ("debug", "server.debug", True),
        ("offline", "server.offline", True),
        ("no_warmup", "server.warmup", False),
        ("web_voice_maker", "server.web_voice_maker", True),
    ):
        if getattr(args, flag):
            overrides.append((key, value))
    if args.no_streaming:
        # applies to whichever profile ends up selected
        profile = dict(overrides).get("server.profile") or load_config(args.config).profile.name
        key = "auto.streaming" if profile == AUTO_PROFILE else f"profiles.{profile}.streaming"
        overrides.append((key, False))
    config = load_config(args.config, overrides)
    return config


def import_engine() -> str | None:
    """Import torch and the engine code before listening; returns an error message or None.

    Importing torch holds the GIL for seconds (loading its shared libraries), which would
    stall ``describe`` answers on the event loop; loading the weights afterwards, on the engine
    thread, mostly runs outside the GIL.
    """
    try:
        import engine.cosyvoice1.engine  # noqa: F401
    except ImportError as err:
        return f"cannot import the engine: {err}"
    return None


async def serve(
    config: ServerConfig,
    model_dir: Path,
    http: tuple[str, int, bool, tuple[str, ...]] | None = None,
    *,
    engine_factory: EngineFactory = load_cosyvoice,
) -> int:
    """Run until SIGINT/SIGTERM (exit 0) or until the model fails to load (exit 1).

    ``http`` = (host, port, HTTP only, allowed origins): the HTTP API on the same scheduler.
    ``engine_factory``: the config's loader unless given (the benchmark's launcher gives one).
    """
    from wyoming_cosyvoice.wyoming.server import create_server

    if http is not None and http[2]:
        from wyoming_cosyvoice.http import start_model_only

        running: Any = await start_model_only(config, model_dir, engine_factory=engine_factory)
    else:
        running = await create_server(config, model_dir, engine_factory=engine_factory)
    from wyoming_cosyvoice.custom_voices.folder import CustomVoices, custom_voice_exists

    # Custom voices: scanned once the model has loaded, then re-scanned when the folder changes
    # (or when the web page saves a voice).
    from wyoming_cosyvoice.home_assistant.tts_cache_guard import TtsCacheGuard, settings_identity

    tts_cache = TtsCacheGuard.for_config(config)  # Home Assistant's copies of older audio
    voices = None
    if config.voices_dir is not None:
        voices = CustomVoices(config, running.scheduler, model_dir, tts_cache=tts_cache)
    web = None
    if http is not None:
        from wyoming_cosyvoice.http import start_http

        web = await start_http(config, running.scheduler, http[0], http[1], allow_origins=http[3],
                               custom_voices=voices)  # fmt: skip

    if (
        config.voice
        and running.scheduler.catalog.voices
        and not running.scheduler.catalog.find(config.voice)
        and not custom_voice_exists(config.voices_dir, config.voice)  # known after its scan
    ):
        _LOGGER.error(
            "--voice %s is not a voice of this model; available: %s",
            config.voice,
            ", ".join(running.scheduler.catalog.names),
        )
        await running.stop()
        return 2
    if voices is not None:
        voices.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    settings_check = asyncio.create_task(
        tts_cache.check_settings(settings_identity(config, model_dir)), name="TTS cache check"
    )
    zc = None
    if config.zeroconf and not (http and http[2]):
        from wyoming_cosyvoice.wyoming.zeroconf import WyomingZeroconf

        url = urlparse(config.uri)
        if url.scheme != "tcp":
            _LOGGER.error("--zeroconf needs a tcp:// --uri")
        else:
            try:
                zc = WyomingZeroconf(config.zeroconf, running.port, url.hostname)
                await zc.register()
            except OSError as err:
                _LOGGER.error("Zeroconf disabled: %s", err)
                zc = None
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait({running.load_task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if running.load_task in done and running.load_task.exception() is not None:
        _LOGGER.error("Model failed to load: %s", running.load_task.exception())
        code = 1
    elif running.load_task in done:
        await stopper  # serve until a signal
    _LOGGER.info("Shutting down")
    # The Supervisor kills a container 10 s after SIGTERM: stop the engine's work first.
    deadline = loop.time() + SHUTDOWN_GRACE_S
    if cancelled := running.scheduler.cancel_all():
        _LOGGER.info("Cancelled %d request(s) in progress", cancelled)
    if zc is not None:
        await zc.close()
    stopper.cancel()
    settings_check.cancel()
    if voices is not None:
        await voices.stop()
    if web is not None:
        await web.stop()
    await running.stop()
    if not await running.scheduler.wait_idle(deadline - loop.time()):
        _LOGGER.warning(
            "The engine is still inside a computation %.0f s after the stop; exiting without it",
            SHUTDOWN_GRACE_S,
        )
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process without joining the engine threads (Python would wait for their current
    computation). Everything else is stopped and cache files are written atomically."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["synthesize"]:
        from wyoming_cosyvoice.synthesize import main as synthesize

        return synthesize(argv[1:])
    args = build_parser().parse_args(argv)
    if args.version:
        print(__version__)  # the CLI's only print
        return 0
    try:
        config = config_from_args(args)
    except ConfigError as err:
        sys.stderr.write(f"wyoming-cosyvoice: {err}\n")
        return 2
    logging.basicConfig(
        level=logging.DEBUG if config.debug else logging.INFO, format=config.log_format
    )
    _LOGGER.debug(config)
    http = None
    if args.http_port is not None or args.http_only:
        if args.http_port is None:
            _LOGGER.error("--http-only needs --http-port")
            return 2
        try:
            import wyoming_cosyvoice.http  # noqa: F401
        except ImportError as err:
            _LOGGER.error("The HTTP API needs the http extra (%s): pip install "
                          "'wyoming-cosyvoice[http]'", err)  # fmt: skip
            return 2
        from wyoming_cosyvoice.http.origin import parse_allowed_origins

        try:
            origins = parse_allowed_origins(args.http_allow_origin)
        except ValueError as err:
            _LOGGER.error("--http-allow-origin: %s", err)
            return 2
        http = (args.http_host, args.http_port, args.http_only, origins)

    from wyoming_cosyvoice.models.download import ModelNotFoundError

    try:
        model_dir = resolve_model_dir(config)
    except ModelNotFoundError as err:
        _LOGGER.error("%s", err)
        return 1
    if problem := import_engine():
        _LOGGER.error("%s", problem)
        return 1
    try:
        return asyncio.run(serve(config, model_dir, http))
    except OSError as err:  # e.g. the port is taken
        _LOGGER.error("Cannot listen on %s: %s", config.uri, err)
        return 1
    except KeyboardInterrupt:
        return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())


if __name__ == "__main__":
    run()
