"""Reading Wyoming events with limits.

``wyoming.event.async_read_event`` treats every malformed header as a disconnect and trusts
``data_length``/``payload_length``. A server facing unproofread clients needs to tell the client
what was wrong and to bound what it buffers, so this reader checks every field.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from wyoming.event import Event

from wyoming_cosyvoice.errors import LimitExceededError, ProtocolError


def _length(header: dict[str, Any], key: str, limit: int) -> int:
    value = header.get(key)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"'{key}' must be an integer, not {value!r}")
    if value < 0:
        raise ProtocolError(f"'{key}' must not be negative ({value})")
    if value > limit:
        raise LimitExceededError(f"'{key}' of {value} bytes is over the limit of {limit}")
    return value


async def read_event(
    reader: asyncio.StreamReader,
    *,
    max_header_bytes: int,
    max_data_bytes: int,
    max_payload_bytes: int,
) -> Event | None:
    """Read one event; ``None`` at a clean end of stream.

    The header line is bounded by the reader's own ``limit``, which the server sets to
    ``max_header_bytes`` when it accepts the connection. Raises :class:`ProtocolError` or
    :class:`LimitExceededError` for bad input; a stream cut inside an event raises
    ``asyncio.IncompleteReadError``.
    """
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.IncompleteReadError as err:
        if not err.partial.strip():
            return None
        raise ProtocolError("connection closed in the middle of an event header") from err
    except asyncio.LimitOverrunError as err:
        raise LimitExceededError(
            f"event header line is longer than the limit of {max_header_bytes} bytes"
        ) from err
    if not line.strip():
        raise ProtocolError("empty event header line")
    try:
        header = json.loads(line)
    # ValueError covers JSONDecodeError, bad UTF-8 and integers over Python's digit limit;
    # RecursionError is deeply nested arrays/objects: all the client's fault, not ours.
    except (ValueError, RecursionError) as err:
        raise ProtocolError(f"event header is not JSON: {err}") from err
    if not isinstance(header, dict):
        raise ProtocolError(f"event header must be a JSON object, not {type(header).__name__}")
    event_type = header.get("type")
    if not isinstance(event_type, str) or not event_type:
        raise ProtocolError("event header has no 'type' string")
    data = header.get("data") or {}
    if not isinstance(data, dict):
        raise ProtocolError(f"'data' of a {event_type} event must be a JSON object")

    data_length = _length(header, "data_length", max_data_bytes)
    payload_length = _length(header, "payload_length", max_payload_bytes)
    if data_length:
        block = await reader.readexactly(data_length)
        try:
            extra = json.loads(block)
        except (ValueError, RecursionError) as err:
            raise ProtocolError(f"data block of a {event_type} event is not JSON: {err}") from err
        if not isinstance(extra, dict):
            raise ProtocolError(f"data block of a {event_type} event must be a JSON object")
        data = {**data, **extra}
    payload = await reader.readexactly(payload_length) if payload_length else None
    return Event(type=event_type, data=data, payload=payload)


def event_text(data: dict[str, Any], kind: str) -> str:
    """The required ``text`` string of a synthesize/synthesize-chunk event."""
    text = data.get("text")
    if not isinstance(text, str):
        raise ProtocolError(f"{kind} needs a 'text' string")
    return text


def event_voice(data: dict[str, Any]) -> dict[str, str] | None:
    """The optional ``voice`` object, reduced to its non-empty string fields."""
    voice = data.get("voice")
    if voice is None:
        return None
    if not isinstance(voice, dict):
        raise ProtocolError('\'voice\' must be an object such as {"name": "zh-female"}')
    fields = ("name", "speaker", "language")
    for key in fields:
        if not isinstance(voice.get(key), (str, type(None))):
            raise ProtocolError(f"'voice.{key}' must be a string")
    return {k: voice[k] for k in fields if voice.get(k)}
