"""When to release the first audio: at once (``eager``) or once playback cannot starve.

On a machine slower than real time (RTF > 1) a stream played from its first chunk stops and
starts. The ``gapless`` policy holds the first chunks back until, at the production rate
measured so far, the audio already made plus what is still to come keeps a real-time player
busy to the end: with ``A`` seconds produced, ``R`` still to produce and a rate of ``r`` audio
seconds per wall second (r < 1), playback started now never waits iff ``A >= R·(1/r − 1)``.
``R`` comes from an estimate of the utterance's length, so the policy is only as good as that
estimate; a safety margin covers modest errors.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Iterator

from engine.core.constants import TOKEN_RATE
from engine.core.types import AudioChunk

EAGER = "eager"
GAPLESS = "gapless"
START_POLICIES = (EAGER, GAPLESS)
SAFETY = 1.15  # hold 15 % more than the rate estimate says is needed

_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")
_WORD = re.compile(r"[A-Za-z]+")
# Typical speaking rates of the CosyVoice speakers: ~4.5 CJK syllables and ~3 English words
# per second.
_SECONDS_PER_CJK = 0.22
_SECONDS_PER_WORD = 0.33


def estimate_speech_seconds(
    text: str, forced_tokens: int | None = None, token_rate: int = TOKEN_RATE
) -> float:
    """Rough spoken length of ``text`` (exact when the count of speech tokens, ``token_rate`` a
    second, is forced)."""
    if forced_tokens is not None:
        return forced_tokens / token_rate
    return len(_CJK.findall(text)) * _SECONDS_PER_CJK + len(_WORD.findall(text)) * _SECONDS_PER_WORD


def hold_until_gapless(
    chunks: Iterable[AudioChunk],
    expected_s: float,
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[AudioChunk]:
    """Yield ``chunks`` unchanged, but only once playback from then on would not starve."""
    start = clock()
    held: list[AudioChunk] = []
    produced = 0.0
    released = False
    for chunk in chunks:
        if released:
            yield chunk
            continue
        held.append(chunk)
        produced += chunk.duration_s
        rate = produced / max(clock() - start, 1e-6)  # audio seconds per wall second
        remaining = max(0.0, expected_s - produced)
        if rate >= 1.0 or produced >= SAFETY * remaining * (1.0 / rate - 1.0):
            released = True
            yield from held
            held.clear()
    yield from held  # the stream ended before the condition was met
