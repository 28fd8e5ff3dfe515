"""How many speech tokens the next streamed chunk takes, so that playback does not wait.

A listener starts playing at the first chunk and waits whenever the next chunk is not there
when the audio before it runs out. A schedule's hops grow geometrically to spread each chunk's
fixed cost over more audio; but a chunk that takes longer to make than the audio already
waiting in the listener's buffer makes it wait, and on a machine that makes audio at not much
more than real time every step up in size does (a hop twice the last one costs twice the audio
the last one left to play). A paced schedule measures, as the answer streams, what a chunk of
``h`` tokens costs on this machine (a fixed part and a part per token, fitted to the chunks so
far: the LM's tokens, the flow and the vocoder, whatever ran in between) and cuts the next
chunk no larger than the listener's buffer can cover, never larger than the schedule's hop and
never smaller than the family's smallest chunk. Where not even the smallest chunk fits, it
takes the smallest: the shortest wait. Where the chunks cut so far took clearly longer to make
than to play (a busy machine), the listener waits whatever the hop, and larger chunks, whose
fixed costs weigh least, make it wait least in all: the hops then grow as the schedule's do
(that machine wants the ``gapless`` start policy).

Pacing moves the seams between chunks, never what a chunk computes; but where the seams fall
changes the audio (a vocoder's draws, v1's overlapping windows), so a request with a fixed seed,
which asks for the same audio every time, is cut at the schedule's own hops
(:func:`paces`; docs/dev/streaming-pace.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from engine.core.types import SynthesisOptions

# The share of the listener's buffer a chunk may take: a chunk costs a little more or less
# than the last ones said (other programs, the LM's cache growing).
BUFFER_SHARE = 0.85
# The chunks whose cost the fit reads: the latest few follow a machine that gets busier.
FIT_WINDOW = 3
# The least share of the latest chunk's cost per token the fit takes as the per-token part.
MIN_PER_TOKEN_SHARE = 0.5
# How much slower than real time the chunks as cut must be made for larger ones to be cut
# instead: near real time the measured cost is mostly noise, and a large chunk on noise stalls.
CLEARLY_SLOWER = 1.15
# How much larger the largest chunk in the fit must be than the smallest for a line with a
# fixed part: closer sizes give a slope that is mostly noise.
MIN_SIZE_SPREAD = 1.5


def paces(options: SynthesisOptions) -> bool:
    """Whether the request's chunks are paced: its schedule says so and its seed is not fixed."""
    return options.schedule.paced and options.seed is None


@dataclass
class ChunkCosts:
    """What the chunks so far cost: (tokens, seconds) pairs, the latest last (the tokens the LM
    made for the chunk: its hop, and for the first its look-ahead or overlap too)."""

    samples: list[tuple[int, float]] = field(default_factory=list)

    def add(self, tokens: int, seconds: float) -> None:
        self.samples.append((tokens, seconds))

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token) of a chunk, fitted to the first chunk and the
        latest ones (None: none yet). The first has the most tokens per chunk of work (all it
        waited for: its hop and the look-ahead or overlap), which tells the per-token part
        from the fixed one while the later chunks are all of one size."""
        window = self.samples[:1] + self.samples[1:][-FIT_WINDOW:]
        if not window:
            return None
        hops = [hop for hop, _ in window]
        latest_hop, latest_s = window[-1]
        if max(hops) < MIN_SIZE_SPREAD * min(hops):
            # Sizes too alike to tell the parts apart (noise would tilt the line): all of the
            # cost counted per token, the safe side.
            return 0.0, sum(seconds for _, seconds in window) / sum(hops)
        n = len(window)
        mean_h = sum(hops) / n
        mean_s = sum(seconds for _, seconds in window) / n
        spread = sum((h - mean_h) ** 2 for h in hops)
        slope = sum((h - mean_h) * (s - mean_s) for h, s in window) / spread
        # A noisy chunk can tilt the line flat (tokens for free); no chunk's fixed part is more
        # than half its cost (the LM alone costs more per token on every machine measured).
        # Then the line goes through the latest chunk instead of the mean.
        floor = MIN_PER_TOKEN_SHARE * latest_s / max(1, latest_hop)
        if slope < floor:
            return latest_s - floor * latest_hop, floor
        return max(0.0, mean_s - slope * mean_h), slope

    def made_per_token(self) -> float | None:
        """Seconds per token the latest chunks after the first (until there are some: the
        first) took in all, fixed parts included (None: none yet)."""
        window = (self.samples[1:] or self.samples)[-FIT_WINDOW:]
        if not window:
            return None
        return sum(seconds for _, seconds in window) / sum(tokens for tokens, _ in window)


class ChunkPacer:
    """The hops of one streamed answer: the schedule's (``hops``), or, ``paced``, each no larger
    than the listener's buffer can cover.

    ``growth``: a paced hop is at most this many times the last one. ``step``: a hop is a
    whole number of these tokens (CosyVoice2's attention chunk, 1 for v1). ``smallest``: the
    smallest hop after the first. ``token_s``: a token's audio seconds. ``sample_rate``: the
    audio's. The stream tells it when the first token arrived (:meth:`started`) and when each
    chunk's audio was handed on (:meth:`delivered`), then asks for the next hop (:meth:`next`).
    """

    def __init__(
        self,
        hops: Iterator[int],
        *,
        paced: bool,
        growth: float = 2.0,
        step: int = 1,
        smallest: int = 1,
        token_s: float = 0.0,
        sample_rate: int = 1,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self._hops, self.paced, self._growth = hops, paced, growth
        self._step, self._smallest, self._token_s = max(1, step), max(1, smallest), token_s
        self._sample_rate = sample_rate
        self._clock = clock or time.perf_counter
        self._costs = ChunkCosts()
        self._since: float | None = None  # when the chunk being made started costing
        self._plays_until: float | None = None  # when the audio handed on so far runs out
        self._hop = 0  # the hop of the chunk being made
        self.chosen: list[int] = []  # every hop handed out, for the log and tests

    def __iter__(self) -> ChunkPacer:
        return self

    def __next__(self) -> int:
        """The first hop, then each next one (as :meth:`first` and :meth:`next`)."""
        return self.next() if self.chosen else self.first()

    @classmethod
    def fixed(cls, hops: Iterator[int] | ChunkPacer) -> ChunkPacer:
        """``hops`` as they are (a pacer stays itself)."""
        return hops if isinstance(hops, ChunkPacer) else cls(hops, paced=False)

    @property
    def hop(self) -> int:
        """The hop of the chunk being made (the first hop until one was asked for)."""
        return self._hop if self.chosen else self.first()

    def first(self) -> int:
        """The first hop: the schedule's own (its chunk's cost includes the LM's prefill)."""
        return self._take(next(self._hops))

    def started(self) -> None:
        """The LM's first token is here: from now on the time is the first chunk's to make."""
        if self._since is None:
            self._since = self._clock()

    def delivered(self, samples: int, tokens: int) -> None:
        """The chunk's audio (``samples`` long) is handed to the listener now; the LM made
        ``tokens`` tokens for it."""
        now, audio_s = self._clock(), samples / self._sample_rate
        if self._since is not None:
            self._costs.add(tokens, now - self._since)
        self._since = now
        if audio_s <= 0.0:
            return
        start = now if self._plays_until is None else max(self._plays_until, now)
        self._plays_until = start + audio_s

    def next(self) -> int:
        """The next hop (call once the listener has the last chunk's audio)."""
        planned = next(self._hops)
        if not self.paced or self._plays_until is None:
            return self._take(planned)
        fit = self._costs.fit()
        if fit is None:
            return self._take(planned)
        fixed, per_token = fit
        # Growing from the last hop as the schedule grows: a fit read from small chunks
        # says least about much larger ones.
        grown = int(self._hop * self._growth)
        made = self._costs.made_per_token()
        if made is not None and made >= CLEARLY_SLOWER * self._token_s:
            # The chunks as cut take clearly longer to make than to play (a busy machine):
            # larger ones, whose fixed part weighs least, make the listener wait least in all.
            return self._take(max(self._smallest, min(planned, grown) // self._step * self._step))
        budget = BUFFER_SHARE * (self._plays_until - self._clock()) - fixed
        fits = int(budget / per_token) if per_token > 0 else planned
        hop = min(planned, grown, fits) // self._step * self._step
        return self._take(max(self._smallest, hop))

    def _take(self, hop: int) -> int:
        self._hop = hop
        self.chosen.append(hop)
        return hop
