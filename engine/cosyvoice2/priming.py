"""A voice's flow streams with their prompt chunks computed once (primed), shared by the forks
each of its utterances streams from (:meth:`~engine.cosyvoice2.flow.FlowStream.fork`)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.cosyvoice2.flow import FlowStream
    from engine.prompt.voices import CustomVoice

# Primed prompt streams are kept for the last voice used only (their flow state: 2.3 MB a mel
# frame at full size in float16 for 10 steps with guidance, so a 5 s prompt holds about 0.5 GB),
# one per flow setting it was asked in, up to this many: a server choosing among profiles per
# request (auto) then never recomputes a prompt.
PRIMED_SETTINGS = 4

#: (voice, flow steps, guidance, prompt tokens kept, flow weights, flow solver)
PrimedKey = tuple[str, int, float, int, str, str]


@dataclass
class _Primed:
    """A voice's flow stream with its prompt chunks computed, for one set of flow settings."""

    voice: CustomVoice
    stream: FlowStream


class PrimedStreams:
    """The primed streams of the last voice used, by flow settings (safe across threads)."""

    def __init__(self, limit: int = PRIMED_SETTINGS) -> None:
        self.limit = limit
        self._streams: OrderedDict[PrimedKey, _Primed] = OrderedDict()
        self._lock = threading.Lock()

    def get(
        self, voice: CustomVoice, key: PrimedKey, prime: Callable[[], FlowStream]
    ) -> FlowStream:
        """``voice``'s stream for ``key``: the kept one, else ``prime()``'s, kept in place of
        any other voice's (and of this voice's least recently used settings beyond the limit)."""
        with self._lock:
            primed = self._streams.get(key)
            if primed is not None and primed.voice is voice:
                self._streams.move_to_end(key)
                return primed.stream
            stream = prime()
            for other in [k for k, p in self._streams.items() if p.voice is not voice]:
                del self._streams[other]  # another voice (or an older copy of this one)
            self._streams[key] = _Primed(voice, stream)
            self._streams.move_to_end(key)
            while len(self._streams) > self.limit:
                self._streams.popitem(last=False)
            return stream

    def drop(self, key: PrimedKey) -> bool:
        """Let go of the stream of ``key``; whether one was kept."""
        with self._lock:
            return self._streams.pop(key, None) is not None

    def clear(self) -> None:
        with self._lock:
            self._streams.clear()

    def keys(self) -> list[PrimedKey]:
        """The kept settings, least recently used first."""
        with self._lock:
            return list(self._streams)

    def stream(self, key: PrimedKey) -> FlowStream | None:
        with self._lock:
            primed = self._streams.get(key)
            return None if primed is None else primed.stream
