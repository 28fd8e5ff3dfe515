"""CosyVoice3's cap on silence: of a run of silent or breath tokens the LM writes, the first five
are spoken and the rest dropped (the official CosyVoice3Model does so between its LM and its
flow; a long run would be seconds of silence)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

# The speech tokens of silence and breath (the official list for the v3 speech tokenizer).
SILENT_TOKENS = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
MAX_SILENT_RUN = 5


def capped_silences(tokens: Iterable[int]) -> Iterator[int]:
    """``tokens`` less every silent token after the first :data:`MAX_SILENT_RUN` of a run."""
    run = 0
    for token in tokens:
        if token in SILENT_TOKENS:
            run += 1
            if run > MAX_SILENT_RUN:
                continue
        else:
            run = 0
        yield token
