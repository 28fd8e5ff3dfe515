"""The custom voices folder: validation, the NAME.prompt.pt cache, scanning, engine Voice."""

from __future__ import annotations

import logging
import os
import wave
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA, ROOT

from engine.prompt.onnx_models import PromptModels
from engine.prompt.voices import (
    CACHE_SUFFIX,
    VoiceLibrary,
    load_voice,
    scan_voices,
    to_engine_voice,
    voice_names,
)

ONNX = DATA / "zero_shot" / "onnx"


def speechlike(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A voiced, syllable-modulated harmonic signal with a little noise (float in [-1, 1])."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    f0 = 140 + 20 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    x = sum(0.2 / h * np.sin(h * phase) for h in range(1, 20) if h * 160 < rate / 2 - 500)
    x = x * (0.55 + 0.45 * np.sin(2 * np.pi * 3.1 * t)) + 0.003 * rng.standard_normal(t.size)
    return (0.7 * x / np.abs(x).max()).astype(np.float64)


def write_wav(path: Path, samples: np.ndarray, rate: int, channels: int = 1) -> None:
    pcm = np.clip(np.round(samples * 32767), -32768, 32767).astype("<i2")
    if channels == 2:
        pcm = np.stack([pcm, pcm // 2], axis=1)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(channels), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes(pcm.tobytes())


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture()
def models() -> PromptModels:
    return PromptModels(ONNX / "tiny_campplus.onnx", ONNX / "tiny_speech_tokenizer_v1.onnx")


@pytest.fixture()
def voices_dir(tmp_path: Path) -> Path:
    d = tmp_path / "voices"
    d.mkdir()
    write_wav(d / "anna.wav", speechlike(4.0, 44100), 44100, channels=2)
    (d / "anna.txt").write_text("Hello, this is my voice for the kitchen speaker.\n")
    return d


def test_bad_recordings_are_rejected_with_clear_messages(voices_dir: Path, models, caplog) -> None:
    d = voices_dir
    write_wav(d / "short.wav", speechlike(2.0, 16000), 16000)
    (d / "short.txt").write_text("Too short.")
    write_wav(d / "long.wav", speechlike(31.0, 16000), 16000)
    (d / "long.txt").write_text("Too long.")
    write_wav(d / "quiet.wav", np.zeros(16000 * 5), 16000)
    (d / "quiet.txt").write_text("Nothing.")
    write_wav(d / "dc.wav", np.full(16000 * 5, 0.3), 16000)
    (d / "dc.txt").write_text("Constant.")
    (d / "noise.wav").write_bytes(os.urandom(5000))
    (d / "noise.txt").write_text("Random bytes.")
    write_wav(d / "notext.wav", speechlike(4.0, 16000), 16000)
    write_wav(d / "empty.wav", speechlike(4.0, 16000), 16000)
    (d / "empty.txt").write_text("  \n ")
    write_wav(d / "punct.wav", speechlike(4.0, 16000), 16000)
    (d / "punct.txt").write_text("... !!")
    (d / "mp3.mp3").write_bytes(b"ID3")
    (d / "mp3.txt").write_text("Compressed.")
    (d / "orphan.txt").write_text("No recording.")
    write_wav(d / "lowrate.wav", speechlike(4.0, 8000), 8000)
    (d / "lowrate.txt").write_text("Telephone quality.")
    with caplog.at_level(logging.WARNING):
        result = scan_voices(d, models, reserved={"中文女"})
    assert sorted(result.voices) == ["anna"]
    reasons = result.rejected
    expected = {
        "short": "2.0 s long; it needs at least 3 s",
        "long": "31.0 s long; the limit is 30 s",
        "quiet": "silent",
        "dc": "silent",
        "noise": "not a WAV file",
        "notext": "transcript notext.txt is missing",
        "empty": "transcript empty.txt is empty",
        "punct": "has no words",
        "mp3": "mp3.mp3 is not a WAV file; convert it",
        "orphan": "recording orphan.wav is missing",
        "lowrate": "8000 Hz is too low",
    }
    assert sorted(reasons) == sorted(expected)
    for name, fragment in expected.items():
        assert fragment in reasons[name], (name, reasons[name])
        assert f"Custom voice {name!r} skipped: " in caplog.text
    assert not (d / f"short{CACHE_SUFFIX}").exists()


def test_reserved_names_and_hidden_files(voices_dir: Path, models) -> None:
    (voices_dir / ".anna2.wav").write_bytes(b"")
    (voices_dir / "anna.instruct.txt").write_text("Speak cheerfully.")
    assert voice_names(voices_dir) == ["anna"]
    result = scan_voices(voices_dir, models, reserved={"anna"})
    assert "built-in speaker" in result.rejected["anna"]
    assert scan_voices(voices_dir, models).voices["anna"].instruct == "Speak cheerfully."
    (voices_dir / "anna.instruct.txt").write_text("\n")  # optional file: ignored, not fatal
    assert scan_voices(voices_dir, models).voices["anna"].instruct is None
    assert scan_voices(voices_dir / "nope", models).voices == {}


def test_cache_is_written_once_reused_and_invalidated(
    voices_dir: Path, models: PromptModels, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs: list[str] = []  # each prompt model run: a cached load runs none

    def counted(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        run = getattr(models, name)

        def counting(x: torch.Tensor) -> torch.Tensor:
            runs.append(name)
            return run(x)

        return counting

    for name in ("speech_tokens", "embedding"):
        monkeypatch.setattr(models, name, counted(name))
    cache = voices_dir / f"anna{CACHE_SUFFIX}"
    first = load_voice(voices_dir, "anna", models)
    assert first.source == "extracted" and cache.is_file()
    assert sorted(runs) == ["embedding", "speech_tokens"]
    state = torch.load(cache, weights_only=True)  # must load without pickled objects
    assert state["wav"]["name"] == "anna.wav" and len(state["wav"]["sha256"]) == 64
    assert {"size", "mtime_ns"} <= set(state["txt"])
    written = cache.stat().st_mtime_ns

    second = load_voice(voices_dir, "anna", models)
    assert second.source == "cache" and cache.stat().st_mtime_ns == written
    assert len(runs) == 2  # neither model ran again
    for a, b in zip(
        first.prompt.to_state().values(), second.prompt.to_state().values(), strict=True
    ):
        assert torch.equal(a, b)

    # Cached voices load without the ONNX models (and without onnxruntime).
    assert load_voice(voices_dir, "anna", None).source == "cache"
    # Touching a file without changing it keeps the cache (content hashes decide) ...
    os.utime(voices_dir / "anna.txt", ns=(1, 1))
    assert load_voice(voices_dir, "anna", models).source == "cache"
    # ... a new transcript or recording invalidates it.
    (voices_dir / "anna.txt").write_text("A different sentence entirely.")
    assert load_voice(voices_dir, "anna", models).source == "extracted"
    write_wav(voices_dir / "anna.wav", speechlike(5.0, 22050, seed=1), 22050)
    third = load_voice(voices_dir, "anna", models)
    assert third.source == "extracted" and third.duration_s == pytest.approx(5.0, abs=1e-3)
    # A corrupt cache is ignored and rewritten.
    cache.write_bytes(b"garbage")
    assert load_voice(voices_dir, "anna", models).source == "extracted"
    assert load_voice(voices_dir, "anna", models).source == "cache"


def test_library_rescan_and_model_release(voices_dir: Path, models) -> None:
    library = VoiceLibrary(voices_dir, models)
    assert library.scan().voices["anna"].source == "extracted"
    assert library.names() == ["anna"] and library.get("anna") is not None
    assert models._sessions == {}  # released after the scan
    write_wav(voices_dir / "bob.wav", speechlike(3.5, 48000, seed=2), 48000)
    (voices_dir / "bob.txt").write_text("你好，我是小明。")
    result = library.scan()
    assert result.voices["anna"].source == "cache" and result.voices["bob"].language == "zh"
    (voices_dir / "bob.txt").unlink()
    library.scan()
    assert library.names() == ["anna"] and "bob" in library.rejected


# --- to the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from engine.cosyvoice1.engine import CosyVoiceEngine

    return CosyVoiceEngine.load(DATA / "tiny_model", threads=1)


def test_voice_modes(engine, voices_dir: Path, models) -> None:
    voice = load_voice(voices_dir, "anna", models)
    tokens = voice.prompt.speech_tokens
    same = to_engine_voice(voice, engine.frontend, "Turn on the lights.")
    assert same.mode == "zero_shot"
    v = same.voice
    assert v.prompt_text_ids == engine.frontend.prompt_text_ids(voice.transcript)
    assert v.llm_prompt_tokens == tokens.reshape(-1).tolist()
    assert v.flow_prompt is not None and torch.equal(v.flow_prompt.tokens, tokens)
    assert v.flow_prompt.feat.shape == (1, voice.prompt.speech_feat.shape[1], 80)
    assert torch.equal(v.llm_embedding, voice.prompt.embedding)

    cross = to_engine_voice(voice, engine.frontend, "把客厅的灯打开。", text_ids=[1, 2])
    assert cross.mode == "cross_lingual"
    assert cross.text_ids == [engine.frontend.tokenizer.language_id("zh"), 1, 2]
    assert to_engine_voice(voice, engine.frontend, "<|yue|>早晨", text_ids=[3]).text_ids == [3]
    assert same.text_ids is None
    assert cross.voice.prompt_text_ids == [] and cross.voice.llm_prompt_tokens == []
    assert cross.voice.llm_embedding.shape == (1, 192)  # the v1 LM keeps the speaker
    assert cross.voice.flow_prompt is not None

    inst = to_engine_voice(
        voice, engine.frontend, "Hi.", kind="instruct", instruct="A calm, slow voice."
    )
    assert inst.mode == "instruct"
    assert inst.voice.llm_embedding.shape == (0, 192) and inst.voice.flow_prompt is None
    assert inst.voice.prompt_text_ids == engine.frontend.instruct_ids("A calm, slow voice.")
    # The base model has no instruct mode: the instruction is ignored.
    assert to_engine_voice(voice, engine.frontend, "Hi.", instruct="x").mode == "zero_shot"


def test_a_language_given_by_the_caller_chooses_the_mode(engine, voices_dir: Path, models) -> None:
    voice = load_voice(voices_dir, "anna", models)  # an English transcript
    text = "Good morning."
    assert to_engine_voice(voice, engine.frontend, text).mode == "zero_shot"
    told = to_engine_voice(voice, engine.frontend, text, text_ids=[7], language="zh")
    assert told.mode == "cross_lingual"
    assert told.text_ids == [engine.frontend.tokenizer.language_id("zh"), 7]


def test_custom_voice_synthesizes_through_the_engine(engine, voices_dir: Path, models) -> None:
    from engine.core.constants import HOP, tokens_to_frames
    from engine.core.types import SynthesisOptions

    voice = load_voice(voices_dir, "anna", models)
    text = "Good morning."
    vin = to_engine_voice(voice, engine.frontend, text, kind=engine.kind)
    assert vin.mode == "zero_shot"
    options = SynthesisOptions(stream=False, seed=3, force_tokens=30)
    segment = engine.frontend.segments(text)[0]
    chunks = list(engine._segment(segment.token_ids, vin.voice, options, 3, None))
    audio = np.concatenate([c.samples for c in chunks])
    # Only the new speech comes out: the prompt's mel frames are conditioning, not output.
    assert audio.size == tokens_to_frames(30) * HOP
    assert np.isfinite(audio).all() and np.abs(audio).max() <= 0.99 + 1e-6
    # Cross-lingual, streamed in several chunks.
    text = "早上好。"
    vin = to_engine_voice(voice, engine.frontend, text, kind=engine.kind)
    assert vin.mode == "cross_lingual"
    stream = SynthesisOptions(stream=True, seed=3, force_tokens=80)
    segment = engine.frontend.segments(text)[0]
    vin = to_engine_voice(
        voice, engine.frontend, segment.text, kind=engine.kind, text_ids=segment.token_ids
    )
    assert vin.text_ids is not None and vin.text_ids[1:] == segment.token_ids
    chunks = list(engine._segment(vin.text_ids, vin.voice, stream, 3, None))
    assert len(chunks) > 1
    assert sum(c.samples.size for c in chunks) == tokens_to_frames(80) * HOP


def test_engine_synthesize_resolves_a_custom_voice_per_segment(
    engine, voices_dir: Path, models
) -> None:
    """The engine's own synthesize(): a custom voice speaks zero-shot and cross-lingual, and
    built-in speakers are untouched (the library gets the tiny ONNX prompt models)."""
    from engine.core.types import SynthesisOptions

    engine.custom_voices = VoiceLibrary(voices_dir, models, reserved=engine.speakers)
    try:
        assert list(engine.custom_voices.scan().voices) == ["anna"]
        options = SynthesisOptions(speaker="anna", stream=False, seed=1, force_tokens=20)
        for text in ("Good morning.", "你好。"):  # zero-shot, cross-lingual
            chunks = list(engine.synthesize(text, options))
            assert len(chunks) == 1 and chunks[0].samples.size > 0
        builtin = SynthesisOptions(
            speaker=engine.speakers[0], stream=False, seed=1, force_tokens=20
        )
        assert len(list(engine.synthesize("Hello.", builtin))) == 1
    finally:
        engine.custom_voices = None


def test_cached_voices_never_import_onnxruntime(voices_dir: Path, models) -> None:
    import subprocess
    import sys

    load_voice(voices_dir, "anna", models)  # writes the cache
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from engine.prompt.onnx_models import PromptModels\n"
        "from engine.prompt.voices import VoiceLibrary\n"
        f"m = PromptModels(Path({str(models.campplus_path)!r}), "
        f"Path({str(models.tokenizer_path)!r}))\n"
        f"lib = VoiceLibrary(Path({str(voices_dir)!r}), m)\n"
        "assert lib.scan().voices['anna'].source == 'cache'\n"
        # Without the model files (deleted after extraction) the cache still serves.
        f"m = PromptModels.from_model_dir(Path({str(voices_dir)!r}))\n"
        f"lib = VoiceLibrary(Path({str(voices_dir)!r}), m)\n"
        "assert lib.scan().voices['anna'].source == 'cache'\n"
        "assert 'onnxruntime' not in sys.modules\n"
    )
    root = ROOT
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
