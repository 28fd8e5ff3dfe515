"""Even loudness across voices: every voice at one target level, times the request's volume.

Loudness is ITU-R BS.1770 integrated loudness (LUFS): the K-weighted signal's mean square over
400 ms blocks every 100 ms, gated at −70 LUFS and then 10 LU below the ungated mean. The
K-weighting is two biquads; they are applied here in the frequency domain with numpy (see
docs/dev/loudness.md for why not pyloudnorm: it pulls in scipy, ~60 MB more memory per server
for these two filters).

Audio streams, so a sentence's gain is fixed before its first chunk and never changes inside it
(:class:`SentenceLevel`). Per voice (:class:`VoiceLevels`, one per server) the gain follows an
estimate of the level the model speaks that voice at:

* a voice made from a recording starts from the recording's loudness (the model copies the
  prompt's level); a built-in voice without one starts at unity gain;
* each finished sentence's blocks refine it (a running integrated loudness of the voice's last
  few minutes of speech); after ``TRUST_S`` of measured speech the measurement alone counts;
* the voice's gain moves only when the estimate is more than ``HYSTERESIS_DB`` off, and within
  one request by at most ``MAX_STEP_DB`` from one sentence to the next;
* a peak limiter (instant attack, smooth release) keeps every sample at or under
  ``CEILING_DBFS``, so a gain or a volume above 1 never clips.

What was learnt of each voice is kept across restarts (:class:`LevelStore`, one small file per
model in the data directory), so a restart does not start the voices over from the recording's
level or unity gain.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from wyoming_cosyvoice.voices.catalog import Voice

T = TypeVar("T")

_LOGGER = logging.getLogger(__name__)

DEFAULT_TARGET_LUFS = -18.0
CEILING_DBFS = -1.0  # sample peak the limiter keeps every sample under
RELEASE_S = 0.05  # the limiter's gain recovers by 1/e in this time after a peak
MAX_GAIN_DB = 24.0  # a near-silent voice is not boosted into its noise floor
MIN_GAIN_DB = -24.0
HYSTERESIS_DB = 0.5  # a voice's gain ignores smaller changes of its estimate
MAX_STEP_DB = 3.0  # within one request, from one sentence to the next
TRUST_S = 5.0  # measured speech after which the recording's level no longer counts
HISTORY_BLOCKS = 3000  # 100 ms blocks kept per voice: its last five minutes of speech

_BLOCK_S, _HOP_S = 0.4, 0.1  # BS.1770 gating blocks: 400 ms, 75 % overlap
_ABSOLUTE_GATE_LUFS, _RELATIVE_GATE_LU = -70.0, -10.0
_OFFSET = -0.691  # BS.1770: 997 Hz at 0 dBFS reads −3.01 LUFS
_FILTER_TAIL_S = 0.25  # the filters' impulse response is under 1e-9 after this
_SEGMENT = 1 << 15  # FFT size of the filtering: over twice the tail at 48 kHz


# --- BS.1770 measurement -----------------------------------------------------------------------


def k_weighting(rate: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(b, a) of BS.1770's two stages at ``rate``: the head's high shelf, then the RLB high pass.

    Derived from the analogue prototypes (Brecht De Man's parameters, as libebur128 does), so
    that at 48 kHz they are the recommendation's published coefficients.
    """
    k = math.tan(math.pi * 1681.974450955533 / rate)
    q = 0.7071752369554196
    vh = 10.0 ** (3.999843853973347 / 20.0)
    vb = vh**0.4996667741545416
    a0 = 1.0 + k / q + k * k
    shelf_b = np.array([vh + vb * k / q + k * k, 2.0 * (k * k - vh), vh - vb * k / q + k * k]) / a0
    shelf_a = np.array([a0, 2.0 * (k * k - 1.0), 1.0 - k / q + k * k]) / a0
    k = math.tan(math.pi * 38.13547087602444 / rate)
    q = 0.5003270373238773
    a0 = 1.0 + k / q + k * k
    pass_b = np.array([1.0, -2.0, 1.0])
    pass_a = np.array([a0, 2.0 * (k * k - 1.0), 1.0 - k / q + k * k]) / a0
    return shelf_b, shelf_a, pass_b, pass_a


def _response(b: np.ndarray, a: np.ndarray, z_inv: np.ndarray) -> np.ndarray:
    return (b[0] + z_inv * (b[1] + z_inv * b[2])) / (a[0] + z_inv * (a[1] + z_inv * a[2]))


@functools.lru_cache(maxsize=4)
def _segment_response(rate: int) -> tuple[np.ndarray, int]:
    """(the filters' frequency response over one FFT segment, their decay length in samples)."""
    z_inv = np.exp(-2j * np.pi * np.arange(_SEGMENT // 2 + 1) / _SEGMENT)
    shelf_b, shelf_a, pass_b, pass_a = k_weighting(rate)
    response = _response(shelf_b, shelf_a, z_inv) * _response(pass_b, pass_a, z_inv)
    return response, int(_FILTER_TAIL_S * rate)


def k_weighted(samples: np.ndarray, rate: int) -> np.ndarray:
    """``samples`` through the K-weighting filters (from rest), as float64.

    FFT products over overlapping segments (overlap-save) instead of a sample-by-sample
    recursion: each segment's first ``tail`` outputs, where the circular product wraps, are
    dropped; past the filters' decay the rest equals the filters' output.
    """
    response, tail = _segment_response(rate)
    hop = _SEGMENT - tail
    x = np.concatenate((np.zeros(tail), np.asarray(samples, dtype=np.float64)))
    out = np.empty(len(samples))
    for start in range(0, len(samples), hop):
        y = np.fft.irfft(np.fft.rfft(x[start : start + _SEGMENT], _SEGMENT) * response, _SEGMENT)
        out[start : start + hop] = y[tail : tail + min(hop, len(samples) - start)]
    return out


def block_powers(samples: np.ndarray, rate: int) -> np.ndarray:
    """Mean square of the K-weighted signal in each whole 400 ms block, every 100 ms."""
    hop = round(_HOP_S * rate)
    block = round(_BLOCK_S / _HOP_S) * hop
    if len(samples) < block:
        return np.zeros(0)
    weighted = k_weighted(samples, rate)
    energy = np.concatenate(([0.0], np.cumsum(weighted * weighted)))
    starts = np.arange(0, len(samples) - block + 1, hop)
    return np.asarray((energy[starts + block] - energy[starts]) / block)


def _lufs(power: float | np.floating) -> float:
    return _OFFSET + 10.0 * math.log10(float(power))


def gated_loudness(powers: Iterable[float] | np.ndarray) -> float | None:
    """BS.1770 integrated loudness (LUFS) of block powers; None when every block is gated."""
    z = np.asarray(list(powers) if not isinstance(powers, np.ndarray) else powers)
    floor = 10.0 ** ((_ABSOLUTE_GATE_LUFS - _OFFSET) / 10.0)
    z = z[z > floor]
    if not len(z):
        return None
    relative = _lufs(z.mean()) + _RELATIVE_GATE_LU
    z = z[z > 10.0 ** ((relative - _OFFSET) / 10.0)]
    return _lufs(z.mean())


def integrated_loudness(samples: np.ndarray, rate: int) -> float | None:
    """BS.1770 integrated loudness (LUFS) of mono ``samples``; None if shorter than 400 ms or
    silent."""
    return gated_loudness(block_powers(samples, rate))


def recording_loudness(path: Path) -> float | None:
    """The integrated loudness of a WAV recording (its channels mixed, as prompts are)."""
    from engine.prompt.audio import read_wav

    samples, info = read_wav(path)
    return integrated_loudness(samples.mean(axis=0), info.sample_rate)


# --- gain and peak limiting --------------------------------------------------------------------


def db_to_gain(db: float) -> float:
    return float(10.0 ** (db / 20.0))


class PeakLimiter:
    """Keeps every sample's magnitude at or under ``ceiling``: the gain drops at once to meet a
    peak and recovers exponentially (``release_s``). Its state runs across one sentence's chunks.
    """

    def __init__(self, rate: int, ceiling: float = db_to_gain(CEILING_DBFS),
                 release_s: float = RELEASE_S) -> None:  # fmt: skip
        self.ceiling = ceiling
        self.decay = 1.0 / (release_s * rate)  # log gain recovered per sample
        self.over = 0.0  # log of how far the last sample's envelope was over the ceiling

    def __call__(self, x: np.ndarray) -> np.ndarray:
        peak = float(np.abs(x).max(initial=0.0))
        if peak <= self.ceiling and self.over <= self.decay:  # no reduction anywhere in x
            self.over = 0.0
            return x
        # envelope[n] = max over k <= n of (over_k - decay * (n - k)): one running maximum.
        ramp = self.decay * np.arange(len(x))
        over = np.log(np.maximum(np.abs(x), 1e-12) / self.ceiling)
        start = np.array([self.over - self.decay])
        envelope = np.maximum.accumulate(np.concatenate((start, over + ramp)))[1:] - ramp
        self.over = float(envelope[-1])
        return np.asarray(x * np.exp(-np.maximum(envelope, 0.0)), dtype=x.dtype)


def pcm16(samples: np.ndarray) -> bytes:
    """16-bit little-endian PCM of float samples in [-1, 1] (as ``AudioChunk.pcm16``)."""
    return bytes((np.clip(samples, -1.0, 1.0) * 32767.0).round().astype("<i2").tobytes())


# --- per voice and per sentence ----------------------------------------------------------------

RecordingKey = tuple[str, int, int]  # a recording's path, size and modification time


@dataclass
class _VoiceLevel:
    """What is known of the level the model speaks one voice at."""

    recording: RecordingKey | None = None  # the recording measured
    recording_lufs: float | None = None
    blocks: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY_BLOCKS))
    gain_db: float = 0.0  # the voice's normalising gain, volume excluded

    def estimate(self) -> float | None:
        """The voice's level (LUFS): the recording's, blended into the measured speech's."""
        measured = gated_loudness(self.blocks) if self.blocks else None
        if measured is None or self.recording_lufs is None:
            return measured if measured is not None else self.recording_lufs
        trust = min(1.0, len(self.blocks) * _HOP_S / TRUST_S)
        return (1.0 - trust) * self.recording_lufs + trust * measured


LEVELS_DIR = "voice-levels"  # under the data directory: one file per model
STORE_FORMAT = 1  # the layout of a LevelStore file; another one is ignored
SAVE_EVERY_S = 60.0  # while serving; and once more at the stop
_STORED_FLOOR_LUFS = -99.0  # a silent block, stored: gated out, still counted as measured time


class LevelStore:
    """The learnt levels of one model's voices in a small JSON file, kept across restarts.

    Per voice: the recording it was measured with, the recording's loudness, the gain and the
    measured 100 ms blocks (in LUFS, to 0.01 LU). A voice whose recording is no longer the one
    it was measured with is forgotten when the file is read; a missing, unreadable or corrupt
    file reads as empty (the levels are learnt again). Written whole, atomically (a temporary
    file renamed over it): on the measuring thread while serving, and at the stop.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._write_failed = False

    def load(self) -> dict[str, _VoiceLevel]:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
            if raw.get("format") != STORE_FORMAT:
                raise ValueError(f"format {raw.get('format')!r}, not {STORE_FORMAT}")
            voices = {str(k): self._level(v) for k, v in raw["voices"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            _LOGGER.warning("Ignoring the saved voice levels in %s (%s): they are learnt again",
                            self.path, err)  # fmt: skip
            return {}
        kept = {k: v for k, v in voices.items() if _recording_unchanged(v.recording)}
        for speaker in voices.keys() - kept.keys():
            _LOGGER.info("Voice %s was re-recorded: its saved level is dropped", speaker)
        return kept

    @staticmethod
    def _level(raw: dict[str, Any]) -> _VoiceLevel:
        recording = raw["recording"]
        key = (str(recording[0]), int(recording[1]), int(recording[2])) if recording else None
        lufs = None if raw["recording_lufs"] is None else _finite(raw["recording_lufs"])
        blocks = deque((_power(_finite(b)) for b in raw["blocks_lufs"]), maxlen=HISTORY_BLOCKS)
        gain_db = min(MAX_GAIN_DB, max(MIN_GAIN_DB, _finite(raw["gain_db"])))
        return _VoiceLevel(key, lufs, blocks, gain_db)

    @staticmethod
    def snapshot(voices: dict[str, _VoiceLevel]) -> list[tuple[str, _VoiceLevel]]:
        """Copies of the levels for :meth:`save`: taken on the event loop, where they change."""
        return [(speaker, _VoiceLevel(level.recording, level.recording_lufs,
                                      deque(level.blocks), level.gain_db))
                for speaker, level in voices.items()]  # fmt: skip

    def save(self, snapshot: list[tuple[str, _VoiceLevel]]) -> None:
        """Write the levels (blocking: on the measuring thread)."""
        document = {
            "format": STORE_FORMAT,
            "voices": {
                speaker: {
                    "recording": list(level.recording) if level.recording else None,
                    "recording_lufs": level.recording_lufs,
                    "gain_db": level.gain_db,
                    "blocks_lufs": _stored_lufs(level.blocks),
                }
                for speaker, level in snapshot
            },
        }
        staging = self.path.with_name(f".{self.path.name}.part")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            staging.write_text(json.dumps(document, separators=(",", ":")), encoding="utf-8")
            os.replace(staging, self.path)  # a reader sees the old file or the whole new one
        except OSError as err:
            if not self._write_failed:  # said once: the levels work, only not across restarts
                _LOGGER.warning("Cannot save the voice levels to %s: %s", self.path, err)
            self._write_failed = True
            with contextlib.suppress(OSError):
                staging.unlink(missing_ok=True)


def _finite(value: Any) -> float:
    """A number read back from the file; NaN, infinities and non-numbers are corruption."""
    number = float(value)
    if not math.isfinite(number) or isinstance(value, bool):
        raise ValueError(f"{value!r} is not a finite number")
    return number


def _power(lufs: float) -> float:
    return float(10.0 ** ((lufs - _OFFSET) / 10.0))


def _stored_lufs(blocks: Iterable[float]) -> list[float]:
    """Block powers as LUFS to 0.01 LU, silent ones at the floor (numpy: no Python loop)."""
    powers = np.fromiter(blocks, dtype=np.float64)
    lufs = _OFFSET + 10.0 * np.log10(np.maximum(powers, _power(_STORED_FLOOR_LUFS)))
    return list(np.round(lufs, 2).tolist())


def _recording_unchanged(key: RecordingKey | None) -> bool:
    """The recording ``key`` names is still that file (its size and modification time)."""
    if key is None:
        return True
    try:
        stat = Path(key[0]).stat()
    except OSError:
        return False
    return (stat.st_size, stat.st_mtime_ns) == key[1:]


class SentenceLevel:
    """One sentence's fixed gain, its limiter, and its raw audio kept for measuring."""

    def __init__(self, voice: str, gain_db: float, volume: float, rate: int,
                 measure: bool) -> None:  # fmt: skip
        self.voice, self.gain_db = voice, gain_db
        self.gain = db_to_gain(gain_db) * volume
        self.limiter = PeakLimiter(rate)
        self.rate = rate
        self._raw: list[np.ndarray] | None = [] if measure else None

    def pcm16(self, samples: np.ndarray) -> bytes:
        """One chunk of the engine's audio at this sentence's gain, peak-limited, as PCM16."""
        if self._raw is not None:
            self._raw.append(samples)
        out = samples * np.float32(self.gain) if self.gain != 1.0 else samples
        return pcm16(self.limiter(out))

    def raw(self) -> np.ndarray:
        """The engine's audio of the sentence so far, before gain."""
        return np.concatenate(self._raw) if self._raw else np.zeros(0, np.float32)


class VoiceLevels:
    """The server's per-voice levels: the gain each sentence gets, refined as voices speak.

    ``target_lufs`` None: no normalising, only the volume and the limiter. ``recording_dirs``:
    (folder of custom voices, folder of built-in voices made from recordings), either None.
    ``store``: where the learnt levels are kept across restarts (None: in memory only).
    """

    def __init__(
        self,
        target_lufs: float | None = DEFAULT_TARGET_LUFS,
        volume: float = 1.0,
        recording_dirs: tuple[Path | None, Path | None] = (None, None),
        store: LevelStore | None = None,
    ) -> None:
        self.target_lufs, self.volume = target_lufs, volume
        self.custom_dir, self.builtin_dir = recording_dirs
        self.store = store if target_lufs is not None else None
        self._voices: dict[str, _VoiceLevel] = self.store.load() if self.store else {}
        self._saved_at = -math.inf  # when the levels were last saved (time.monotonic)
        # Measuring runs off the event loop on one thread of its own: asyncio's shared pool
        # would keep a thread for each sentence that ended at the same time.
        self._measurer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loudness")

    def close(self) -> None:
        """Let the measuring thread go (the server is shutting down) and keep what was learnt:
        the thread's current measurement or write is waited for, so the last write is this."""
        self._measurer.shutdown(wait=True, cancel_futures=True)
        if self.store is not None:
            self.store.save(LevelStore.snapshot(self._voices))

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the measuring thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._measurer, functools.partial(fn, *args))

    @classmethod
    def off(cls) -> VoiceLevels:
        """No normalising, volume 1: only the limiter."""
        return cls(None)

    def request(self, volume: float | None = None) -> RequestLevels:
        """The levels of one request, at ``volume`` (None: the server's)."""
        return RequestLevels(self, self.volume if volume is None else volume)

    def recording_of(self, voice: Voice) -> Path | None:
        """The recording a voice is made from, if it has one on disk."""
        folder = self.custom_dir if voice.custom else self.builtin_dir
        if folder is None:
            return None
        path = folder / f"{voice.speaker}.wav"
        if path.is_file():
            return path
        try:  # a recording saved as NAME.WAV
            return next((p for p in folder.iterdir() if p.stem == voice.speaker
                         and p.suffix.lower() == ".wav" and p.is_file()), None)  # fmt: skip
        except OSError:
            return None

    def probe_recording(self, voice: Voice) -> tuple[RecordingKey | None, float | None] | None:
        """(the voice's recording, its loudness) if either changed since last measured, else
        None. Blocking (file I/O): run off the event loop."""
        level = self._voices.get(voice.speaker)
        path = self.recording_of(voice)
        try:
            stat = path.stat() if path is not None else None
        except OSError:
            stat = None
        key = (str(path), stat.st_size, stat.st_mtime_ns) if path and stat else None
        if level is not None and key == level.recording:
            return None
        try:
            return key, recording_loudness(path) if path is not None else None
        except Exception as err:  # an unreadable recording only loses its estimate
            _LOGGER.warning("Cannot measure the loudness of %s: %s", path, err)
            return key, None

    def set_recording(self, voice: Voice, key: RecordingKey | None, lufs: float | None) -> None:
        """The voice's recording was (re-)measured."""
        level = self._voices.setdefault(voice.speaker, _VoiceLevel())
        if level.recording is not None:  # re-recorded: what was measured is another voice
            level.blocks.clear()
        level.recording, level.recording_lufs = key, lufs
        if lufs is not None:
            _LOGGER.info("Voice %s: its recording measures %.1f LUFS", voice.name, lufs)

    def voice_gain_db(self, voice: Voice) -> float:
        """The voice's normalising gain now (dB), moved only past the hysteresis."""
        level = self._voices.setdefault(voice.speaker, _VoiceLevel())
        estimate = level.estimate() if self.target_lufs is not None else None
        if estimate is None:
            return level.gain_db
        wanted = min(MAX_GAIN_DB, max(MIN_GAIN_DB, self.target_lufs - estimate))  # type: ignore[operator]
        if abs(wanted - level.gain_db) > HYSTERESIS_DB:
            _LOGGER.debug("Voice %s: %.1f LUFS, gain %+.1f dB → %+.1f dB", voice.name, estimate,
                          level.gain_db, wanted)  # fmt: skip
            level.gain_db = wanted
        return level.gain_db

    def add_sentence(self, voice: str, powers: np.ndarray) -> None:
        """A finished sentence's block powers join its voice's running measurement."""
        self._voices.setdefault(voice, _VoiceLevel()).blocks.extend(powers.tolist())

    async def save(self) -> None:
        """Keep what is known now across a restart (written off the event loop), at most every
        ``SAVE_EVERY_S``: the file holds every voice, and :meth:`close` writes the rest."""
        now = time.monotonic()
        if self.store is None or now - self._saved_at < SAVE_EVERY_S:
            return
        self._saved_at = now
        await self.off_loop(self.store.save, LevelStore.snapshot(self._voices))

    @property
    def measuring(self) -> bool:
        return self.target_lufs is not None


class RequestLevels:
    """One request's sentences: each gets its voice's gain, stepped smoothly within the request."""

    def __init__(self, levels: VoiceLevels, volume: float) -> None:
        self.levels, self.volume = levels, volume
        self._checked: set[str] = set()  # voices whose recording this request has looked at
        self._last_db: dict[str, float] = {}  # the gain of each voice's previous sentence

    async def sentence(self, voice: Voice, rate: int) -> SentenceLevel:
        """The next sentence's level (its recording measured first, off the event loop)."""
        levels = self.levels
        if levels.measuring and voice.speaker not in self._checked:
            self._checked.add(voice.speaker)
            if changed := await levels.off_loop(levels.probe_recording, voice):
                levels.set_recording(voice, *changed)
        gain_db = levels.voice_gain_db(voice)
        last = self._last_db.get(voice.speaker)
        if last is not None:
            gain_db = last + max(-MAX_STEP_DB, min(MAX_STEP_DB, gain_db - last))
        self._last_db[voice.speaker] = gain_db
        return SentenceLevel(voice.speaker, gain_db, self.volume, rate, levels.measuring)

    async def finished(self, sentence: SentenceLevel) -> None:
        """Measure a sentence that ended normally (off the event loop) for its voice's level."""
        if not self.levels.measuring:
            return
        powers = await self.levels.off_loop(block_powers, sentence.raw(), sentence.rate)
        if len(powers):
            self.levels.add_sentence(sentence.voice, powers)
            await self.levels.save()
