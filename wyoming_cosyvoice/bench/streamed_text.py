"""Server-level benchmark: an LLM's reply streamed into the real Wyoming server, word by word, with
the server speaking a sentence while it arrives (``server.early_speech``) and without.

Home Assistant passes an LLM's reply on as it is written: ``synthesize-start``, one
``synthesize-chunk`` per piece of text, the whole text once more as ``synthesize`` (for servers
that do not stream), ``synthesize-stop``. A simulated LLM here sends one word (with its space) per
chunk at a fixed rate in words per second (an LLM writes about 1.3 tokens per English word).

Per run the server (``python -m wyoming_cosyvoice.bench.server``, as the concurrency benchmark
starts it: the benchmark's fixed token count per sentence, the repeat cache off) is started with
``server.early_speech`` true or false and the synthetic 5-second prompt voice of the engine
benchmark, its transcript in the text's language (the LM's prompt is as long as a real voice's:
it decides how much text the LM needs before it can start). Once it has answered a short request,
the reply is streamed once to warm the streamed path up, then once measured: the time from the
first fragment to the first ``audio-chunk``, when the last fragment was sent, when
``synthesize-stopped`` came, the audio seconds and the audio blocks (one per sentence spoken).
The settings alternate (on, off, on, off, ...), each run with a fresh server; the report has each
setting's medians and how much earlier first audio came with early speech (the median of each
repeat's difference).

Without early speech the server's splitter still cuts a sentence longer than its limit (120
characters) at its last comma or space: that first piece is spoken before the whole sentence has
arrived, as a user would hear it, and the blocks column says so.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from pathlib import Path
from typing import Any, TextIO

from engine.bench.report import fmt
from wyoming_cosyvoice.bench.concurrency import (
    REQUEST_TIMEOUT_S,
    ServerProcess,
    read_reply,
    start_server,
    wait_ready,
    write_neighbours,
)

_LOGGER = logging.getLogger(__name__)

# An LLM's first sentence of a smart-home answer: no sentence end until its last word.
DEFAULT_TEXT = (
    "Sure, I have turned on the kitchen lights and set the living room lamp to a warm white at "
    "half brightness, and the thermostat is heating the house to 21 degrees for when you get "
    "home tonight."
)
# The synthetic voice's transcript, about 5 s spoken, in the text's language: the zero-shot
# layout, whose LM prompt is the transcript and the prompt's speech tokens.
PROMPT_TRANSCRIPTS = {
    "zh": "今天的会议改到下午三点，请大家准时参加，不要迟到。",
    "en": "The meeting has moved to three this afternoon, so please be on time.",
}
EARLY_SPEECH = (True, False)  # the order of each repeat's runs
# --synthetic's choices by the family they build (the others are family names already).
SYNTHETIC_FAMILY = {"300m": "cosyvoice"}


def fragments(text: str) -> list[str]:
    """The text as an LLM streams it: one word per fragment, each with its space."""
    words = text.split()
    return [f"{word} " for word in words[:-1]] + words[-1:]


def prompt_transcript(text: str) -> str:
    """The synthetic voice's transcript in the text's language (English for any but Chinese)."""
    from engine.text.normalize import detect_language

    return PROMPT_TRANSCRIPTS["zh" if detect_language(text).startswith("zh") else "en"]


def model_problem(synthetic: str | None, model_dir: Path | None) -> str | None:
    """Why the model cannot show early speech (None: it can): only a family whose engine speaks
    growing text (CosyVoice2, Fun-CosyVoice3) speaks a sentence before it ends. Reads the
    directory's family without loading it."""
    from engine.api import SpeaksGrowingText
    from engine.core.types import ModelLoadError
    from engine.family import family_named, model_family

    needs = (
        "--llm-stream needs a model that speaks a sentence before its end "
        "(CosyVoice2, Fun-CosyVoice3)"
    )
    if synthetic is not None:
        family = family_named(SYNTHETIC_FAMILY.get(synthetic, synthetic))
        if issubclass(family.engine_class(), SpeaksGrowingText):
            return None
        return f"{needs}: --synthetic cosyvoice2 or cosyvoice3"
    assert model_dir is not None
    try:
        family = model_family(model_dir)
    except ModelLoadError as err:
        return f"--model-dir {err}"
    if issubclass(family.engine_class(), SpeaksGrowingText):
        return None
    return f"{needs}; {model_dir} is {family.name}"


def setting_args(early_speech: bool, text: str) -> list[str]:
    """The server arguments of one setting: early speech on or off, the synthetic voice."""
    value = "true" if early_speech else "false"
    return ["--set", f"server.early_speech={value}", "--synthetic-voice", prompt_transcript(text)]


# --- one streamed reply -----------------------------------------------------------------------


async def stream_reply(
    port: int, text: str, words_per_s: float, *, timeout: float = REQUEST_TIMEOUT_S
) -> dict[str, Any]:
    """Stream ``text`` as Home Assistant passes an LLM's reply on; times (ms) from the first
    fragment: first audio, last fragment sent, ``synthesize-stopped``; audio seconds and blocks."""
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize, SynthesizeStart, SynthesizeStop

    async with AsyncTcpClient("127.0.0.1", port) as client:
        await client.write_event(SynthesizeStart().event())
        reply = asyncio.create_task(_read_reply(client, timeout))
        try:
            start = time.perf_counter()
            last_sent = await _send_fragments(client, fragments(text), words_per_s, start, reply)
            if not reply.done():
                await client.write_event(Synthesize(text=text).event())
                await client.write_event(SynthesizeStop().event())
            heard = await reply
        except OSError:
            if reply.done():  # the server ended the reply: its error says why, not the socket's
                await reply
            raise
        finally:
            reply.cancel()
    first = heard["first_audio_at"]
    return {
        "first_audio_ms": (first - start) * 1000 if first is not None else None,
        "last_fragment_ms": (last_sent - start) * 1000,
        "stopped_ms": (heard["stopped_at"] - start) * 1000,
        "audio_s": heard["audio_s"],
        "audio_blocks": heard["audio_blocks"],
    }


async def _send_fragments(
    client: Any, parts: list[str], words_per_s: float, start: float, reply: asyncio.Task[Any]
) -> float:
    """Fragment i at ``start + i / words_per_s`` (a schedule, so sending never drifts); when the
    last one was sent. Stops early when the reply has ended (an error)."""
    from wyoming.tts import SynthesizeChunk

    sent = start
    for index, part in enumerate(parts):
        if reply.done():
            break
        await asyncio.sleep(max(0.0, start + index / words_per_s - time.perf_counter()))
        await client.write_event(SynthesizeChunk(text=part).event())
        sent = time.perf_counter()
    return sent


async def _read_reply(client: Any, timeout: float) -> dict[str, Any]:
    """Events until ``synthesize-stopped``: when the first audio came, audio seconds, blocks."""
    reply = await read_reply(client, "synthesize-stopped", timeout)
    return {
        "first_audio_at": reply.first_at,
        "stopped_at": time.perf_counter(),
        "audio_s": reply.audio_s,
        "audio_blocks": reply.blocks,
    }


# --- runs -------------------------------------------------------------------------------------


async def _measure(server: ServerProcess, text: str, words_per_s: float) -> dict[str, Any]:
    ready_s = await wait_ready(server)
    _LOGGER.info("Server ready after %.1f s; streaming the reply once to warm up", ready_s)
    await stream_reply(server.port, text, words_per_s)
    _LOGGER.info("Streaming the reply, measured")
    return {"server_ready_s": ready_s, **await stream_reply(server.port, text, words_per_s)}


def run_once(
    model_dir: Path,
    early_speech: bool,
    *,
    text: str,
    words_per_s: float,
    profile: str,
    threads: int | None,
    tokens: int | None,
    config: Path | None,
    extra_args: list[str],
) -> dict[str, Any]:
    """Start a server with the setting, measure one streamed reply, stop the server."""
    server = start_server(
        model_dir,
        profile=profile,
        threads=threads,
        tokens=tokens,
        config=config,
        extra_args=[*extra_args, *setting_args(early_speech, text)],  # the setting is ours
    )
    try:
        result = asyncio.run(_measure(server, text, words_per_s))
    except BaseException:
        _LOGGER.error("server log tail:\n%s", server.log_tail())
        raise
    finally:
        server.stop()
    _LOGGER.info(
        "  first audio %s ms, last fragment %.0f ms, stopped %.0f ms",
        fmt(result["first_audio_ms"], 0),
        result["last_fragment_ms"],
        result["stopped_ms"],
    )
    return {"early_speech": early_speech, **result, "server_log": str(server.log_path)}


def run(
    model_dir: Path,
    *,
    text: str,
    words_per_s: float,
    repeats: int,
    profile: str,
    threads: int | None,
    tokens: int | None,
    config: Path | None = None,
    extra_args: list[str] | None = None,
) -> dict[str, Any]:
    """Each repeat: a run with early speech, then one without; the summary of both."""
    if problem := model_problem(None, model_dir):
        raise ValueError(problem)
    repeats_runs = []
    for index in range(repeats):
        pair = {}
        for early_speech in EARLY_SPEECH:
            _LOGGER.info(
                "Repeat %d/%d, early speech %s", index + 1, repeats, "on" if early_speech else "off"
            )
            pair[early_speech] = run_once(
                model_dir,
                early_speech,
                text=text,
                words_per_s=words_per_s,
                profile=profile,
                threads=threads,
                tokens=tokens,
                config=config,
                extra_args=extra_args or [],
            )
        repeats_runs.append(pair)
    return {
        "mode": "streamed_text",
        "model_dir": str(model_dir),
        "profile": profile,
        "threads": threads,
        "tokens": tokens,
        "text": text,
        "words": len(fragments(text)),
        "llm_words_per_s": words_per_s,
        "voice_transcript": prompt_transcript(text),
        "repeats": repeats,
        **summarize(repeats_runs),
    }


MEDIANS = ("first_audio_ms", "last_fragment_ms", "stopped_ms", "audio_s", "audio_blocks")


def summarize(repeats_runs: list[dict[bool, dict[str, Any]]]) -> dict[str, Any]:
    """Per setting the medians of its runs and the runs; the first-audio gain of early speech
    (each repeat's: without minus with; positive = earlier with it) and its median."""
    settings = []
    for early_speech in EARLY_SPEECH:
        runs = [pair[early_speech] for pair in repeats_runs]
        medians = {key: _median(run[key] for run in runs) for key in MEDIANS}
        first, last = medians["first_audio_ms"], medians["last_fragment_ms"]
        medians["first_audio_after_text_end_ms"] = (
            first - last if first is not None and last is not None else None
        )
        settings.append({"early_speech": early_speech, **medians, "runs": runs})
    gains = [
        pair[False]["first_audio_ms"] - pair[True]["first_audio_ms"]
        for pair in repeats_runs
        if pair[False]["first_audio_ms"] is not None and pair[True]["first_audio_ms"] is not None
    ]
    return {
        "settings": settings,
        "first_audio_gain_ms_each": gains,
        "first_audio_gain_ms": statistics.median(gains) if gains else None,
    }


def _median(values: Any) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


# --- report -----------------------------------------------------------------------------------


def print_table(result: dict[str, Any], out: TextIO) -> None:
    w = out.write
    tokens = result["tokens"] or "until EOS"
    w(
        f"server    {result['model_dir']} profile {result['profile']}, threads "
        f"{result['threads'] or 'default'}, speech tokens per sentence {tokens}\n"
    )
    w(
        f"stream    {result['words']} words at {result['llm_words_per_s']:g} words/s, one "
        f"synthesize-chunk each; {result['repeats']} run(s) per setting, medians\n"
    )
    w(f"text      {result['text']}\n")
    w(f"voice     synthetic 5 s prompt: {result['voice_transcript']}\n")
    write_neighbours(result, out)
    w("\n")
    w(
        f"{'early speech':<14}{'first audio ms':>16}{'vs text end ms':>16}{'last word ms':>14}"
        f"{'stopped ms':>12}{'audio s':>9}{'blocks':>8}\n"
    )
    for setting in result["settings"]:
        w(
            f"{'on' if setting['early_speech'] else 'off':<14}"
            f"{fmt(setting['first_audio_ms'], 0):>16}"
            f"{fmt(setting['first_audio_after_text_end_ms'], 0):>16}"
            f"{fmt(setting['last_fragment_ms'], 0):>14}{fmt(setting['stopped_ms'], 0):>12}"
            f"{fmt(setting['audio_s'], 2):>9}{fmt(setting['audio_blocks'], 0):>8}\n"
        )
    gain = result["first_audio_gain_ms"]
    if gain is not None:
        sooner = "earlier" if gain >= 0 else "later"
        w(f"\nfirst audio with early speech: {abs(gain):,.0f} ms {sooner} than without\n")
