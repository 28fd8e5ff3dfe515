"""Even loudness: the BS.1770 meter, the peak limiter, and every voice at the target level
through the real server (Wyoming over TCP, HTTP) with the fake engine.

The engine here speaks a custom voice by replaying its recording, looped to the sentence's
length: the level a cloning model copies from its prompt. Recordings are the same speech-like
signal at very different levels, so the server must give them very different gains. Sentence
boundaries are known exactly (``FakeEngine.SAMPLES_PER_CHAR`` per character), so each
sentence's gain is read off the audio against what the engine made.
"""

from __future__ import annotations

import asyncio
import contextlib
import wave
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyloudnorm
import pytest
import scipy.signal
from conftest import TINY_MODEL, FakeEngine, fake_server, synthesize, until

from wyoming_cosyvoice.config import ConfigError, load_config
from wyoming_cosyvoice.home_assistant import addon
from wyoming_cosyvoice.voices.catalog import Voice
from wyoming_cosyvoice.voices.loudness import (
    CEILING_DBFS,
    MAX_STEP_DB,
    PeakLimiter,
    SentenceLevel,
    VoiceLevels,
    block_powers,
    db_to_gain,
    gated_loudness,
    integrated_loudness,
    k_weighted,
    k_weighting,
)

RATE = 22050
TARGET = -18.0
CEILING = db_to_gain(CEILING_DBFS)
# Four sentences of about 2.5 s each (the fake engine: 20 ms of audio per character).
SENTENCES = [
    "The kitchen lights are on and the oven is warming up for the evening bread now.",
    "Tomorrow brings light rain in the morning with a little sunshine after lunch time.",
    "Your parcel was delivered to the front door a few minutes ago by the courier van.",
    "The washing machine has finished its cycle and the clothes are ready to be dried.",
]
TEXT = " ".join(SENTENCES)


def speechlike(seconds: float, rate: int = RATE, seed: int = 0) -> np.ndarray:
    """Voiced syllables with pauses and a little noise, peak 0.7 (about −16 LUFS)."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * np.cumsum(130 + 25 * np.sin(2 * np.pi * 0.6 * t)) / rate
    x = sum(0.3 / h * np.sin(h * phase) for h in range(1, 16))
    syllables = np.clip(np.sin(2 * np.pi * 2.7 * t), 0, None) * (np.sin(2 * np.pi * 0.4 * t) > -0.7)
    x = x * syllables + 0.002 * rng.standard_normal(t.size)
    return 0.7 * x / np.abs(x).max()


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE) -> None:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(np.round(np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())


def floats(pcm: bytes) -> np.ndarray:
    return np.frombuffer(pcm, "<i2").astype(np.float64) / 32767


def sentence_gains(out: np.ndarray, made: list[np.ndarray]) -> list[float]:
    """Each sentence's gain (dB) of ``out`` over what the engine ``made``; asserts that it is
    one gain for the whole sentence (up to the PCM16 rounding)."""
    assert len(out) == sum(len(m) for m in made)
    gains, start = [], 0
    for raw in made:
        part, start = out[start : start + len(raw)], start + len(raw)
        gain = float(part @ raw / (raw @ raw))
        assert np.abs(part - gain * raw).max() <= 1.01 / 32767  # one gain, sample by sample
        gains.append(20 * np.log10(gain))
    return gains


def loudness_of(samples: np.ndarray) -> float:
    value = integrated_loudness(samples, RATE)
    assert value is not None
    return value


# --- the meter ---------------------------------------------------------------------------------


def test_k_weighting_at_48_khz_is_bs1770s_published_filter() -> None:
    shelf_b, shelf_a, pass_b, pass_a = k_weighting(48000)
    np.testing.assert_allclose(shelf_b, [1.53512485958697, -2.69169618940638, 1.19839281085285],
                               atol=1e-11)  # fmt: skip
    np.testing.assert_allclose(shelf_a, [1.0, -1.69065929318241, 0.73248077421585], atol=1e-11)
    np.testing.assert_allclose(pass_b, [1.0, -2.0, 1.0])
    np.testing.assert_allclose(pass_a, [1.0, -1.99004745483398, 0.99007225036621], atol=1e-11)


@pytest.mark.parametrize("rate", [16000, 22050, 24000, 44100, 48000])
def test_filtering_and_loudness_agree_with_the_reference_meter(rate: int) -> None:
    rng = np.random.default_rng(rate)
    # Longer than one FFT segment, so the overlap-save joins are checked too.
    noise = rng.standard_normal(3 * rate) * 0.1
    shelf_b, shelf_a, pass_b, pass_a = k_weighting(rate)
    reference = scipy.signal.lfilter(pass_b, pass_a, scipy.signal.lfilter(shelf_b, shelf_a, noise))
    np.testing.assert_allclose(k_weighted(noise, rate), reference, atol=1e-9)
    # pyloudnorm's "DeMan" filters are BS.1770's (its "K-weighting" approximates them).
    meter = pyloudnorm.Meter(rate, filter_class="DeMan")
    for signal in (speechlike(7.0, rate), 0.05 * noise, speechlike(3.0, rate, seed=1) * 0.01):
        assert integrated_loudness(signal, rate) == pytest.approx(
            meter.integrated_loudness(signal), abs=1e-6
        )


def test_a_full_scale_997_hz_sine_reads_minus_3_lufs() -> None:
    t = np.arange(48000 * 3) / 48000
    sine = np.sin(2 * np.pi * 997 * t)
    assert integrated_loudness(sine, 48000) == pytest.approx(-3.01, abs=0.01)
    assert integrated_loudness(0.1 * sine, 48000) == pytest.approx(-23.01, abs=0.01)


def test_pauses_do_not_lower_the_loudness_and_short_or_silent_audio_has_none() -> None:
    speech = speechlike(4.0)
    with_pauses = np.concatenate([speech, np.zeros(3 * RATE), speech, np.zeros(3 * RATE)])
    assert loudness_of(with_pauses) == pytest.approx(loudness_of(speech), abs=0.3)
    assert integrated_loudness(speech[: int(0.39 * RATE)], RATE) is None  # no whole 400 ms block
    assert integrated_loudness(np.zeros(RATE), RATE) is None
    assert len(block_powers(speech[: int(0.5 * RATE)], RATE)) == 2  # blocks every 100 ms


# --- the limiter -------------------------------------------------------------------------------


def test_the_limiter_holds_every_sample_under_the_ceiling_and_leaves_the_rest_alone() -> None:
    quiet = 0.3 * speechlike(1.0).astype(np.float32)
    limiter = PeakLimiter(RATE)
    assert limiter(quiet) is quiet  # nothing over the ceiling: untouched
    loud = 3.0 * speechlike(2.0).astype(np.float32)
    whole = PeakLimiter(RATE)(loud)
    assert np.abs(whole).max() <= CEILING + 1e-6
    chunked = PeakLimiter(RATE)
    parts = np.concatenate([chunked(part) for part in np.array_split(loud, 37)])
    np.testing.assert_allclose(parts, whole, atol=1e-6)  # its state runs across chunks
    click = quiet.copy()
    click[1000] = 0.99
    limited = PeakLimiter(RATE)(click)
    assert abs(limited[1000]) <= CEILING + 1e-6 and limited[999] == click[999]
    # the gain has recovered 0.3 s after the click (50 ms release)
    np.testing.assert_allclose(limited[1000 + int(0.3 * RATE) :], click[1000 + int(0.3 * RATE) :],
                               rtol=1e-3)  # fmt: skip


# --- a voice's gain ----------------------------------------------------------------------------


def test_a_voices_gain_ignores_small_changes_and_follows_large_ones(tmp_path: Path) -> None:
    async def main() -> None:
        voice = Voice("anna", "anna", ("en_US",), "anna", custom=True)
        write_wav(tmp_path / "anna.wav", speechlike(5.0))
        levels = VoiceLevels(TARGET, 1.0, (tmp_path, None))
        recorded = loudness_of(speechlike(5.0))
        first = await levels.request().sentence(voice, RATE)
        assert first.gain_db == pytest.approx(TARGET - recorded, abs=0.05)
        speech = speechlike(6.0)
        # speech 0.3 dB louder than the recording: within the hysteresis, the gain stays
        slightly = block_powers(speech * db_to_gain(0.3), RATE)
        levels.add_sentence("anna", slightly)
        assert levels.voice_gain_db(voice) == first.gain_db
        # then 6 dB louder: past TRUST_S of speech the running measurement alone counts
        louder = block_powers(speech * db_to_gain(6.0), RATE)
        levels.add_sentence("anna", louder)
        measured = gated_loudness(np.concatenate([slightly, louder]))
        assert measured is not None and measured > recorded + 3.0
        assert levels.voice_gain_db(voice) == pytest.approx(TARGET - measured)

    asyncio.run(main())


# --- through the real server -------------------------------------------------------------------


class RecordingEngine(FakeEngine):
    """The fake engine, with custom voices spoken as their recording (times ``drift`` dB)."""

    def __init__(self, model_dir: Path, threads: int | None, drift: dict[str, float]) -> None:
        super().__init__(model_dir, threads)
        self.drift = drift
        self.recordings: dict[str, np.ndarray] = {}

    def enable_custom_voices(self, voices_dir: Path) -> SimpleNamespace:
        voices = {}
        for path in sorted(voices_dir.glob("*.wav")):
            with wave.open(str(path)) as w:
                pcm = w.readframes(w.getnframes())
            gain = db_to_gain(self.drift.get(path.stem, 0.0))
            self.recordings[path.stem] = (floats(pcm) * gain).astype(np.float32)
            voices[path.stem] = SimpleNamespace(language="en", source="extracted", instruct=None,
                                                duration_s=5.0, load_seconds=0.0)  # fmt: skip
        return SimpleNamespace(voices=voices, rejected={})

    def made(self, voice: str, sentence: str) -> np.ndarray:
        """What this engine makes of ``sentence`` in a custom voice."""
        return np.resize(self.recordings[voice], self.expected_samples(sentence))

    def synthesize(self, text: str, options: Any, cancel: Any = None) -> Iterator[Any]:
        from engine.core.types import AudioChunk

        if options.speaker not in self.recordings:
            yield from super().synthesize(text, options, cancel)
            return
        audio = self.made(options.speaker, text)
        for start in range(0, len(audio), self.CHUNK):
            yield AudioChunk(audio[start : start + self.CHUNK])


@pytest.fixture
def voices_dir(tmp_path: Path) -> Path:
    """The same test prompt recorded 20 dB apart, a spiky one, and one the model speaks 6 dB
    quieter than its recording."""
    folder = tmp_path / "voices"
    folder.mkdir()
    speech = speechlike(5.0)
    write_wav(folder / "near.wav", speech)  # +0 dB
    write_wav(folder / "far.wav", speech * db_to_gain(-20.0))
    write_wav(folder / "drifting.wav", speech)
    clicks = speech * db_to_gain(-10.0)
    clicks[RATE // 2 :: RATE] = 0.99  # a full-scale click every second
    write_wav(folder / "clicks.wav", clicks)
    return folder


@contextlib.asynccontextmanager
async def voices_server(voices_dir: Path, overrides: dict[str, Any] | None = None
                        ) -> AsyncIterator[SimpleNamespace]:  # fmt: skip
    """The real server with the recording engine and its custom voices offered."""
    from wyoming_cosyvoice.custom_voices.folder import CustomVoices

    def engine(path: Path, threads: int | None) -> RecordingEngine:
        return RecordingEngine(path, threads, {"drifting": -6.0})

    settings = {"server.voices_dir": str(voices_dir), **(overrides or {})}
    async with fake_server(settings, engine=engine) as server:
        custom = CustomVoices(server.config, server.running.scheduler, TINY_MODEL).start()
        try:
            catalog = lambda: server.running.scheduler.catalog  # noqa: E731
            await until(lambda: catalog().find("clicks"), "the custom voices are offered")
            server.engine = server.engines[0]
            yield server
        finally:
            await custom.stop()


def sentence_levels(server: SimpleNamespace, voice: str, out: np.ndarray) -> list[float]:
    """Each sentence's loudness in ``out``, after checking its gain is one for the sentence."""
    made = [server.engine.made(voice, s) for s in SENTENCES]
    sentence_gains(out, made)
    bounds = np.cumsum([0, *(len(m) for m in made)])
    return [loudness_of(out[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def test_voices_recorded_20_db_apart_come_out_at_the_target(voices_dir: Path) -> None:
    async def main() -> dict[str, list[float]]:
        async with voices_server(voices_dir) as server:
            levels = {}
            for voice in ("near", "far"):
                reply = await synthesize(server.port, TEXT, {"name": voice})
                assert reply.error() is None
                levels[voice] = sentence_levels(server, voice, floats(reply.audio))
            return levels

    levels = asyncio.run(main())
    # From its first sentence on: the recording's level is the first estimate.
    for voice, per_sentence in levels.items():
        assert per_sentence == pytest.approx([TARGET] * len(SENTENCES), abs=1.0), voice


def test_a_voice_quieter_than_its_recording_is_corrected_between_sentences(
    voices_dir: Path,
) -> None:
    async def main() -> tuple[list[float], list[float], list[float]]:
        async with voices_server(voices_dir) as server:
            made = [server.engine.made("drifting", s) for s in SENTENCES]
            replies = [await synthesize(server.port, TEXT, {"name": "drifting"}) for _ in "ab"]
            first, second = (floats(r.audio) for r in replies)
            return (sentence_gains(first, made), sentence_levels(server, "drifting", first),
                    sentence_levels(server, "drifting", second))  # fmt: skip

    gains, first, second = asyncio.run(main())
    # The model speaks it 6 dB under its recording: the first sentence is 6 LU too quiet, ...
    assert first[0] == pytest.approx(TARGET - 6.0, abs=1.0)
    # ... then the gain steps up between sentences as the speech is measured (never by more
    # than MAX_STEP_DB), ...
    steps = np.diff(gains)
    assert all(0.5 < step <= MAX_STEP_DB + 0.01 for step in steps)
    assert TARGET - first[-1] < 2.0
    # ... and the next request starts at the target.
    assert second == pytest.approx([TARGET] * len(SENTENCES), abs=1.0)


def test_a_built_in_voice_reaches_the_target_from_the_models_own_level() -> None:
    class LoudEngine(FakeEngine):
        AMPLITUDE = 0.6  # about −8 LUFS: 10 dB over the target

    async def main() -> tuple[list[float], list[float]]:
        async with fake_server(engine=LoudEngine) as server:
            engine, speaker = LoudEngine(TINY_MODEL, delay=0), SimpleNamespace(speaker="中文男")
            made = [np.concatenate([c.samples for c in engine.synthesize(s, speaker)])
                    for s in SENTENCES]  # fmt: skip
            replies = [await synthesize(server.port, TEXT, {"name": "zh-male"}) for _ in "ab"]
            return [sentence_gains(floats(r.audio), made) for r in replies]  # type: ignore[return-value]

    first, second = asyncio.run(main())
    assert first[0] == pytest.approx(0.0, abs=1e-3)  # nothing known of it yet: the model's level
    assert np.diff(first) == pytest.approx([-MAX_STEP_DB] * 3, abs=0.01)  # smooth steps down
    assert second == pytest.approx([TARGET - (-8.2)] * len(SENTENCES), abs=0.5)


def test_volume_over_one_is_limited_never_clipped(voices_dir: Path) -> None:
    async def main() -> np.ndarray:
        async with voices_server(voices_dir, {"server.volume": 2.0}) as server:
            reply = await synthesize(server.port, TEXT, {"name": "clicks"})
            return floats(reply.audio)

    out = asyncio.run(main())
    assert np.abs(out).max() <= CEILING + 1 / 32767
    # the clicks are limited, the speech between them is at the target + 6 dB
    assert loudness_of(out) == pytest.approx(TARGET + 6.0, abs=1.5)


@pytest.mark.parametrize(("overrides", "level"), [
    ({"server.volume": 0.5}, TARGET - 6.02),  # the server's volume
    ({"server.loudness": -23}, -23.0),  # another target
    ({"server.loudness": None}, -16.0),  # off: each voice as the model makes it
])  # fmt: skip
def test_the_servers_loudness_and_volume_settings(
    voices_dir: Path, overrides: dict[str, Any], level: float
) -> None:
    async def main() -> np.ndarray:
        async with voices_server(voices_dir, overrides) as server:
            reply = await synthesize(server.port, TEXT, {"name": "near"})
            return floats(reply.audio)

    assert loudness_of(asyncio.run(main())) == pytest.approx(level, abs=1.0)


def test_http_requests_scale_the_level_with_their_volume() -> None:
    from test_http import BackgroundServer  # skips without the http extra

    text = SENTENCES[0]
    with BackgroundServer(wyoming=False) as server, server.client() as client:

        def level(path: str, **body: Any) -> float:
            r = client.post(path, json=body)
            assert r.status_code == 200, r.text
            return loudness_of(floats(r.content[44:]))

        # The fake engine speaks at the target: volume alone moves the level.
        assert level("/tts", text=text, voice="en-male") == pytest.approx(TARGET, abs=0.3)
        assert level("/tts", text=text, voice="en-male", volume=0.5) == pytest.approx(
            TARGET - 6.02, abs=0.3)  # fmt: skip
        assert level("/v1/audio/speech", model="tts-1", input=text, voice="en-male",
                     volume=2) == pytest.approx(TARGET + 6.02, abs=0.3)  # fmt: skip
        for bad in (0, 2.5, "loud", True):
            r = client.post("/tts", json={"text": text, "volume": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "volume", r.text


# --- settings and the add-on -------------------------------------------------------------------


def test_settings_and_the_add_on_option_check_the_range() -> None:
    config = load_config()
    assert (config.loudness, config.volume) == (TARGET, 1.0)
    for key, value in (("server.volume", 0), ("server.volume", 3), ("server.loudness", 0),
                       ("server.loudness", "loud"), ("server.volume", None)):  # fmt: skip
        with pytest.raises(ConfigError, match=key):
            load_config(None, [(key, value)])
    assert "--set" not in addon.options_to_args({})
    args = addon.options_to_args({"volume": 0.5})
    assert args[args.index("--set") + 1] == "server.volume=0.5"
    with pytest.raises(ValueError, match="'volume'"):
        addon.options_to_args({"volume": 5})


def test_sentences_ending_together_are_measured_on_one_thread_of_their_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Measuring never takes the event loop, and never grows a thread per sentence ending at
    the same time (a long-running server's thread count stays where the warm-up left it)."""
    import threading

    import wyoming_cosyvoice.voices.loudness as module

    threads: set[str] = set()
    measure = module.block_powers

    def recorded(samples: np.ndarray, rate: int) -> np.ndarray:
        threads.add(threading.current_thread().name)
        return measure(samples, rate)

    monkeypatch.setattr(module, "block_powers", recorded)
    levels = VoiceLevels()
    sentences = []
    for n in range(8):
        sentence = SentenceLevel(f"voice{n}", 0.0, 1.0, 24000, True)
        sentence.pcm16(np.full(24000, 0.1, np.float32))
        sentences.append(sentence)

    async def main() -> None:
        await asyncio.gather(*(levels.request().finished(s) for s in sentences))

    asyncio.run(main())
    levels.close()
    assert len(threads) == 1 and next(iter(threads)).startswith("loudness")
