"""A recording's transcript from a Wyoming speech-to-text server (``server.stt_uri``).

Home Assistant users already run one (the Whisper add-on answers at
``tcp://core-whisper:10300``); the voice maker asks it what a new recording says, so the user
only corrects the transcript instead of typing it. One connection per request, as Home
Assistant's own pipeline does: ``transcribe`` (with the language when the user chose one), then
``audio-start``, ``audio-chunk``s of 16 kHz 16-bit mono, ``audio-stop``; the answer is the first
``transcript`` event (streaming servers send ``transcript-start``/``-chunk`` before it).
"""

from __future__ import annotations

import asyncio

import numpy as np
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncClient
from wyoming.error import Error

RATE, WIDTH, CHANNELS = 16000, 2, 1
CHUNK_SAMPLES = 1024
TIMEOUT_S = 120.0  # Whisper on a small CPU can take a while for 30 s of audio


class SpeechToTextError(Exception):
    """The speech-to-text server could not be reached or gave no transcript."""


def pcm16(audio: np.ndarray) -> bytes:
    """Float samples in [-1, 1] as 16-bit little-endian PCM."""
    return (np.clip(audio, -1.0, 1.0) * 32767).round().astype("<i2").tobytes()


async def transcribe(
    uri: str, audio_16k: np.ndarray, language: str | None = None, timeout: float = TIMEOUT_S
) -> str:
    """The transcript of 16 kHz mono float audio; raises :class:`SpeechToTextError`."""
    try:
        return await asyncio.wait_for(_transcribe(uri, pcm16(audio_16k), language), timeout)
    except asyncio.TimeoutError as err:
        raise SpeechToTextError(f"the speech-to-text server at {uri} gave no transcript "
                                f"within {timeout:g} s") from err  # fmt: skip
    except (OSError, ValueError) as err:
        raise SpeechToTextError(
            f"cannot use the speech-to-text server at {uri}: {err or type(err).__name__}"
        ) from err


async def _transcribe(uri: str, pcm: bytes, language: str | None) -> str:
    async with AsyncClient.from_uri(uri) as client:
        await client.write_event(Transcribe(language=language or None).event())
        await client.write_event(AudioStart(rate=RATE, width=WIDTH, channels=CHANNELS).event())
        step = CHUNK_SAMPLES * WIDTH
        for start in range(0, len(pcm), step):
            chunk = AudioChunk(rate=RATE, width=WIDTH, channels=CHANNELS,
                               audio=pcm[start : start + step])  # fmt: skip
            await client.write_event(chunk.event())
        await client.write_event(AudioStop().event())
        while (event := await client.read_event()) is not None:
            if Transcript.is_type(event.type):
                return Transcript.from_event(event).text.strip()
            if Error.is_type(event.type):
                raise SpeechToTextError(
                    f"the speech-to-text server at {uri} answered: {Error.from_event(event).text}"
                )
    raise SpeechToTextError(f"the speech-to-text server at {uri} closed the connection "
                            "without a transcript")  # fmt: skip
