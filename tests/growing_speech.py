"""Speaking a sentence while it still arrives, for the engines' growing-text tests."""

from __future__ import annotations

import threading
from typing import Any

from engine.core.text_feed import TextFeed
from engine.core.types import SynthesisOptions


def speak_while_arriving(
    engine: Any, text: TextFeed, full: str, started: threading.Event, options: SynthesisOptions
) -> list[Any]:
    """``engine.synthesize_growing(text, options)``'s chunks, the text finished as ``full`` once
    ``started`` is set: the engine has begun speaking from the part it had."""

    def finish_once_read() -> None:
        started.wait(60)  # bounded: without a session the answer still ends
        text.finish(full)

    finisher = threading.Thread(target=finish_once_read)
    finisher.start()
    try:
        return list(engine.synthesize_growing(text, options))
    finally:
        finisher.join()
