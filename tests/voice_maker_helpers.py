"""Stand-ins for the voice maker's tests: an engine with a voices folder, a Wyoming
speech-to-text server and Home Assistant's REST API as the Supervisor proxies it.

* :class:`FakeVoiceEngine` offers a folder's voice when the engine's own rules accept its
  recording and transcript (no prompt models: plumbing, not sound).
* :class:`StandInStt` is a Wyoming ASR server on the wyoming library's ``AsyncTcpServer``, run
  in its own thread and loop; it answers every recording with one transcript and keeps what it
  received.
* :class:`StandInHomeAssistant` answers ``GET /api/config/config_entries/entry?domain=wyoming``
  and ``POST /api/config/config_entries/entry/<id>/reload`` as Home Assistant does, for the
  Supervisor's token only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from conftest import FakeEngine, free_port
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from wyoming.server import AsyncEventHandler, AsyncServer


class FakeVoiceEngine(FakeEngine):
    """The fake engine with custom voices; a custom voice speaks with the first speaker's sine."""

    def __init__(self, model_dir: Path, threads: int | None = None, **kwargs: Any) -> None:
        super().__init__(model_dir, threads, **kwargs)
        self.custom: set[str] = set()
        self.custom_calls: list[str] = []
        self.scan_gate = threading.Event()  # cleared: scans wait (a slow first analysis)
        self.scan_gate.set()

    def enable_custom_voices(self, voices_dir: Path | str) -> Any:
        from engine.prompt.audio import load_prompt_16k
        from engine.prompt.errors import VoiceError
        from engine.prompt.validate import check_audio, read_transcript
        from engine.prompt.voices import ScanResult, voice_names
        from engine.text.normalize import detect_language

        self.scan_gate.wait(60)
        folder, result = Path(voices_dir), ScanResult()
        for name in voice_names(folder) if folder.is_dir() else []:
            try:
                audio, _ = load_prompt_16k(folder / f"{name}.wav")
                seconds = check_audio(audio, name)
                text = read_transcript(folder / f"{name}.txt")
            except VoiceError as err:
                result.rejected[name] = str(err)
                continue
            result.voices[name] = SimpleNamespace(
                language=detect_language(text), source="extracted", duration_s=seconds,
                load_seconds=0.0, instruct=None)  # fmt: skip
        self.custom = set(result.voices)
        return result

    def synthesize(self, text: str, options: Any, cancel: threading.Event | None = None
                   ) -> Iterator[Any]:  # fmt: skip
        if options.speaker in self.custom:
            self.custom_calls.append(options.speaker)
            options = dataclasses.replace(options, speaker=self.speakers[0])
        return super().synthesize(text, options, cancel)


class _SttHandler(AsyncEventHandler):
    def __init__(self, stt: StandInStt, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stt = stt
        self.request: dict[str, Any] = {"audio": b""}

    async def handle_event(self, event: Event) -> bool:
        if Transcribe.is_type(event.type):
            self.request["language"] = Transcribe.from_event(event).language
        elif AudioStart.is_type(event.type):
            start = AudioStart.from_event(event)
            self.request["format"] = (start.rate, start.width, start.channels)
        elif AudioChunk.is_type(event.type):
            self.request["audio"] += AudioChunk.from_event(event).audio
        elif AudioStop.is_type(event.type):
            self.stt.requests.append(self.request)
            if self.stt.error:
                await self.write_event(Error(text=self.stt.error).event())
            else:
                await self.write_event(Transcript(text=self.stt.text).event())
            return False
        return True


class StandInStt:
    """A Wyoming ASR server on a free port (``uri``), answering ``text`` (or ``error``)."""

    def __init__(self, text: str = "Hello, this is my voice.", error: str | None = None) -> None:
        self.text, self.error = text, error
        self.requests: list[dict[str, Any]] = []
        self.uri = f"tcp://127.0.0.1:{free_port()}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="stand-in stt")
        self.server = AsyncServer.from_uri(self.uri)

    def __enter__(self) -> StandInStt:
        self.thread.start()
        handler = lambda *args, **kwargs: _SttHandler(self, *args, **kwargs)  # noqa: E731
        asyncio.run_coroutine_threadsafe(self.server.start(handler), self.loop).result(10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


class StandInHomeAssistant:
    """Home Assistant's config-entry REST API on a free port, as the Supervisor proxies it."""

    TOKEN = "supervisor-token-for-tests"

    def __init__(self, entries: list[dict[str, str]], status: int = 200) -> None:
        self.entries, self.status = entries, status
        self.calls: list[tuple[str, str, str | None]] = []  # method, path, Authorization
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: Any) -> None:
                stand_in.calls.append((self.command, self.path,
                                       self.headers.get("Authorization")))  # fmt: skip
                ok = self.headers.get("Authorization") == f"Bearer {stand_in.TOKEN}"
                code = stand_in.status if ok else 401
                data = json.dumps(body if code == 200 else {"message": "Unauthorized"}).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:  # noqa: N802
                assert self.path == "/api/config/config_entries/entry?domain=wyoming", self.path
                self._answer(stand_in.entries)

            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer({"require_restart": False})

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/api"
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="stand-in HA")

    @property
    def reloads(self) -> list[str]:
        return [path for method, path, _ in self.calls if method == "POST"]

    def __enter__(self) -> StandInHomeAssistant:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(10)


WYOMING_ENTRIES = [
    {"entry_id": "01WHISPER", "domain": "wyoming", "title": "Whisper", "source": "hassio"},
    {"entry_id": "01COSYVOICE", "domain": "wyoming", "title": "CosyVoice", "source": "hassio"},
]
