"""CosyVoice2's low-latency hops: a schedule's durations as speech tokens, ending on the
flow's attention chunks, and where the voice's prompt is cut so the first hop completes its
last chunk (the official schedule's hops are :func:`~engine.cosyvoice2.streaming.official_hops`)."""

from __future__ import annotations

import math
from collections.abc import Iterator

from engine.core.types import StreamSchedule

# A schedule's hops count 20 ms units (v1's 50 Hz speech tokens) for every family, so one
# profile asks the same audio durations of both; CosyVoice2's tokens are 40 ms.
SCHEDULE_UNITS_PER_SECOND = 50


def chunk_hops(
    schedule: StreamSchedule,
    chunk: int,
    prompt_tokens: int = 0,
    token_rate: int = SCHEDULE_UNITS_PER_SECOND,
) -> Iterator[int]:
    """The schedule's hops in speech tokens of ``token_rate`` per second, ending on attention
    chunk boundaries (chunks of ``chunk`` tokens counted from the first of ``prompt_tokens``):
    ``first_hop`` rounded up to a chunk, less the prompt's tokens in its unfinished last chunk;
    then growing by ``growth`` up to ``max_hop`` (rounded down, at least one chunk)."""
    scale = token_rate / SCHEDULE_UNITS_PER_SECOND
    limit = max(chunk, int(schedule.max_hop * scale) // chunk * chunk)
    hop = max(1.0, schedule.first_hop * scale)
    into_chunk = prompt_tokens % chunk
    while True:
        yield min(limit, -(-math.ceil(hop) // chunk) * chunk) - into_chunk
        into_chunk = 0
        hop *= max(1.0, schedule.growth)


def prompt_tail(schedule: StreamSchedule, chunk: int, lookahead: int, token_rate: int) -> int:
    """How many prompt tokens to leave in the prompt's last, unfinished attention chunk.

    The answer's first chunk completes that chunk, so it holds ``chunk − tail`` new tokens:
    the schedule's first hop when it fits (audio after that hop and the look-ahead), else the
    look-ahead alone stays in the prompt (the first hop then ends on a later chunk boundary).
    The prompt's last whole chunk needs its look-ahead, hence at least ``lookahead`` tokens.
    """
    first = max(1, math.ceil(schedule.first_hop * token_rate / SCHEDULE_UNITS_PER_SECOND))
    return chunk - first if first <= chunk - lookahead else lookahead
