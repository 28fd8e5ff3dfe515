"""Instant repeats: the audio of recently spoken sentences, kept in memory within a byte budget.

A sentence asked for again with nothing changed that shapes its audio is served from here at
once instead of by the engine. The key is everything the engine is given for it: the
sentence's text, and its engine options (the voice's speaker, the language, the instruction,
the profile's settings, the seed and any other option a request sets), plus the voice's name.
One cache belongs to one scheduler, so to one loaded model.

The audio is kept as the engine made it (float32, before any gain or PCM16 conversion): a
replay goes through the same steps as fresh engine audio. A sentence is stored only once the
engine has finished it; a cancelled or failed one leaves nothing. The least recently used
entries go once the budget is full; a budget of 0 turns the cache off.

A custom voice can change under the same name (a new recording in the voices folder): every
re-scan publishes a new voice catalogue, and a new catalogue drops the custom voices' entries.
A sentence spoken with a random seed and then replayed repeats its first rendering exactly.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

import numpy as np

from engine.core.types import AudioChunk, SynthesisOptions
from wyoming_cosyvoice.voices.catalog import Voice

REPLAY_PIECE_S = 0.5  # a stored sentence is handed out in pieces of this length

ChunkSink = Callable[[AudioChunk], Awaitable[None]]


@dataclass(frozen=True)
class _Key:
    text: str
    voice: str
    options: SynthesisOptions  # speaker, language, instruction, settings, seed, ...


@dataclass(frozen=True)
class _Entry:
    samples: np.ndarray
    sample_rate: int
    custom: bool  # of a custom voice: dropped when the voice catalogue changes

    @property
    def nbytes(self) -> int:
        return int(self.samples.nbytes)


class RepeatCache:
    """A bounded LRU map from sentence keys to engine audio; all its calls run on the event
    loop (no lock)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max(0, max_bytes)
        self.hits = 0
        self.misses = 0
        self._entries: collections.OrderedDict[_Key, _Entry] = collections.OrderedDict()
        self._bytes = 0
        self._catalog: object = None  # the voice catalogue the custom voices' entries are of
        self._generation = 0  # counts catalogue changes

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def lookup(
        self,
        text: str,
        voice: Voice,
        options: SynthesisOptions,
        catalog: object,
        *,
        count: bool = True,
    ) -> Lookup:
        """This sentence's stored audio, or a recorder to store the engine's.

        ``catalog``: the voice catalogue ``voice`` was chosen from. ``count``: a request's
        lookup (hits and misses are counted), not a preparation's.
        """
        self._follow_catalog(catalog)
        key = _Key(text, voice.name, options)
        entry = self._entries.get(key) if self.enabled else None
        if entry is not None:
            self._entries.move_to_end(key)
        if self.enabled and count:
            if entry is None:
                self.misses += 1
            else:
                self.hits += 1
        return Lookup(self, key, voice.custom, self._generation, entry)

    def stats(self) -> dict[str, int]:
        """Hits and misses since the start, and what is held now against the budget."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "entries": len(self._entries),
            "bytes": self._bytes,
            "max_bytes": self.max_bytes,
        }

    def _follow_catalog(self, catalog: object) -> None:
        """A new voice catalogue may have re-recorded custom voices: forget theirs."""
        if catalog is self._catalog:
            return
        self._catalog = catalog
        self._generation += 1
        for key in [k for k, entry in self._entries.items() if entry.custom]:
            self._drop(key)

    def _store(self, key: _Key, entry: _Entry, generation: int) -> None:
        if not self.enabled or entry.nbytes > self.max_bytes:
            return
        if entry.custom and generation != self._generation:
            return  # its voice may have changed while it was being spoken
        if key in self._entries:
            self._drop(key)
        self._entries[key] = entry
        self._bytes += entry.nbytes
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: _Key) -> None:
        self._bytes -= self._entries.pop(key).nbytes


class Lookup:
    """One sentence's turn at the cache: its stored audio (:attr:`hit`), else a recorder of
    the engine's audio (:meth:`record`) that :meth:`store` keeps once the sentence is done."""

    def __init__(
        self, cache: RepeatCache, key: _Key, custom: bool, generation: int, entry: _Entry | None
    ) -> None:
        self._cache, self._key, self._custom, self._generation = cache, key, custom, generation
        self._entry = entry
        self._recorded: list[np.ndarray] | None = [] if cache.enabled else None
        self._recorded_bytes = 0
        self._sample_rate: int | None = None

    @property
    def hit(self) -> bool:
        return self._entry is not None

    def replay(self) -> Iterator[AudioChunk]:
        """The stored audio, in pieces of :data:`REPLAY_PIECE_S` (copies: what is done to them
        downstream never reaches the store)."""
        assert self._entry is not None
        samples, rate = self._entry.samples, self._entry.sample_rate
        step = max(1, int(REPLAY_PIECE_S * rate))
        for start in range(0, len(samples), step):
            yield AudioChunk(samples[start : start + step].copy(), rate)

    def record(self, on_chunk: ChunkSink) -> ChunkSink:
        """``on_chunk``, keeping a copy of each chunk's samples on the way (taken before
        ``on_chunk`` sees them: a gain applied there is not stored)."""

        async def recording(chunk: AudioChunk) -> None:
            self._keep(chunk)
            await on_chunk(chunk)

        return recording if self._recorded is not None else on_chunk

    def store(self) -> None:
        """The sentence is complete: keep what was recorded (nothing if it did not fit)."""
        if not self._recorded or self._sample_rate is None:
            return
        samples = np.concatenate(self._recorded)
        self._recorded = None
        self._cache._store(self._key, _Entry(samples, self._sample_rate, self._custom),
                           self._generation)  # fmt: skip

    def _keep(self, chunk: AudioChunk) -> None:
        if self._recorded is None:
            return
        self._recorded_bytes += chunk.samples.nbytes
        if self._recorded_bytes > self._cache.max_bytes:
            self._recorded = None  # longer than the whole budget: never stored
            return
        self._recorded.append(np.array(chunk.samples, dtype=np.float32))
        self._sample_rate = chunk.sample_rate
