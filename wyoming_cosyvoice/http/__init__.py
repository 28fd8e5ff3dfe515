"""HTTP API: ``POST /tts``, OpenAI's ``POST /v1/audio/speech``, a web page at ``/``.

Needs the ``http`` extra (Starlette, Uvicorn). The app serves the same scheduler as the Wyoming
listener, so both protocols share one engine, one voice catalog and one fair queue.
"""

from __future__ import annotations

from wyoming_cosyvoice.http.app import create_app
from wyoming_cosyvoice.http.serve import HttpServer, start_http, start_model_only

__all__ = ["HttpServer", "create_app", "start_http", "start_model_only"]
