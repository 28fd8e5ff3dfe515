"""CosyVoice2 prompts: features against the official v2 frontend (tests/data/cosyvoice2,
"Prompt features"), the tiny v2 speech-tokenizer stand-in, the voice cache keyed by model family,
the three v2 modes through the tiny v2 model, and built-in voices made with the tiny v1 model."""

from __future__ import annotations

import dataclasses
import math
import shutil
import threading
import wave
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import DATA
from parity import EMBEDDING_ATOL, PROMPT_MEL_ATOL, WHISPER_LOG_MEL_ATOL

from engine.core.constants import HOP, tokens_to_frames
from engine.core.types import AudioChunk, SynthesisOptions
from engine.cosyvoice2.builtin_voices import (
    SENTENCES,
    SPEAKER_LANGUAGES,
    make_builtin_voices,
)
from engine.cosyvoice2.frontend import CosyVoice2TextFrontend
from engine.cosyvoice2.prompt import (
    COSYVOICE2,
    CROSS_LINGUAL,
    INSTRUCT2,
    V2_SPEECH_TOKENIZER,
    ZERO_SHOT,
    conditioning,
    flow_prompt,
    model_input_instruct2,
    prompt_models,
    voice_library,
)
from engine.prompt.audio import load_prompt
from engine.prompt.errors import PromptModelError, VoiceError
from engine.prompt.extract import (
    align_tokens_and_mel,
    extract_features,
    extract_recording,
    model_input_cross_lingual,
    model_input_zero_shot,
)
from engine.prompt.features import V2_PROMPT_MEL, campplus_input, prompt_mel, whisper_log_mel
from engine.prompt.onnx_models import PromptModels, SpeechTokenizer
from engine.prompt.recipe import COSYVOICE1
from engine.prompt.voices import CACHE_SUFFIX, load_voice, to_engine_voice, voice_names

V2 = DATA / "cosyvoice2"
TINY = V2 / "tiny"
ONNX = DATA / "zero_shot" / "onnx"
CAMPPLUS = ONNX / "tiny_campplus.onnx"
TOKENIZER_V1 = ONNX / "tiny_speech_tokenizer_v1.onnx"
TOKENIZER_V2 = ONNX / "tiny_speech_tokenizer_v2.onnx"
SIGNALS = {
    "prompt16k": DATA / "zero_shot" / "prompt16k_pcm16.wav",
    "prompt22k": V2 / "prompt22k_pcm16.wav",
    "prompt48k_stereo": V2 / "prompt48k_stereo_pcm16.wav",
}
V2_CACHE = "anna.cosyvoice2.prompt.pt"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"
TTS_TEXT = "CosyVoice is a multilingual voice generation model."
INSTRUCT_TEXT = "用四川话说这句话<|endofprompt|>"

pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def cases() -> dict[str, torch.Tensor]:
    return torch.load(V2 / "prompt_cases.pt", weights_only=True)


@pytest.fixture(scope="module")
def v1_features() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "zero_shot" / "features.pt", weights_only=True)


@pytest.fixture()
def models() -> PromptModels:
    return PromptModels(CAMPPLUS, TOKENIZER_V2, kind=V2_SPEECH_TOKENIZER)


@pytest.fixture()
def v1_models() -> PromptModels:
    return PromptModels(CAMPPLUS, TOKENIZER_V1)


@pytest.fixture(scope="module")
def frontend() -> CosyVoice2TextFrontend:
    return CosyVoice2TextFrontend(TINY / "CosyVoice-BlankEN")


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.double() - b.double()).abs().max())


# --- features against the official extractors ------------------------------------------------


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_24k_prompt_mel_equals_the_official_extractor(cases, name: str) -> None:
    recording = load_prompt(SIGNALS[name])
    mel = prompt_mel(recording.at(24000), V2_PROMPT_MEL)
    want = cases[f"{name}/speech_feat"]
    assert _max_abs(mel, want) <= PROMPT_MEL_ATOL
    # 50 frames a second: T = (N - 480) // 480 + 1 for N samples at 24 kHz.
    samples = recording.at(24000).shape[1]
    assert mel.shape[1] == (samples - 480) // 480 + 1 == int(cases[f"{name}/speech_feat_len"])


@pytest.mark.parity
@pytest.mark.parametrize("name", ["prompt22k", "prompt48k_stereo"])
def test_whisper_log_mel_of_other_rates_equals_the_official_one(cases, name: str) -> None:
    # 22.05 and 48 kHz (stereo) files: mono mix, then the reference resampler to 16 kHz.
    log_mel = whisper_log_mel(load_prompt(SIGNALS[name]).at(16000))
    assert _max_abs(log_mel, cases[f"{name}/whisper_log_mel"]) <= WHISPER_LOG_MEL_ATOL


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_tokens_and_embedding_equal_the_official_frontend(models, cases, name: str) -> None:
    wave_16k = load_prompt(SIGNALS[name]).at(16000)
    tokens = models.speech_tokens(whisper_log_mel(wave_16k))
    assert tokens.dtype == torch.int32
    assert torch.equal(tokens, cases[f"{name}/speech_token"])
    embedding = models.embedding(campplus_input(wave_16k))
    assert torch.allclose(embedding, cases[f"{name}/embedding"], atol=EMBEDDING_ATOL, rtol=0)


def _ours(models: PromptModels, frontend, name: str, mode: str) -> dict[str, torch.Tensor]:
    prompt = extract_recording(load_prompt(SIGNALS[name]), models, COSYVOICE2)
    text_ids = frontend.tokenizer.encode(TTS_TEXT)
    if mode == ZERO_SHOT:
        return model_input_zero_shot(text_ids, frontend.tokenizer.encode(PROMPT_TEXT), prompt)
    if mode == CROSS_LINGUAL:
        return model_input_cross_lingual(text_ids, prompt)
    return model_input_instruct2(text_ids, frontend.instruct_ids(INSTRUCT_TEXT), prompt)


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        ("prompt16k", ZERO_SHOT),
        ("prompt16k", CROSS_LINGUAL),
        ("prompt16k", INSTRUCT2),
        ("prompt22k", ZERO_SHOT),
        ("prompt48k_stereo", ZERO_SHOT),
    ],
)
@pytest.mark.parity
def test_model_input_reproduces_the_official_v2_frontend(
    models, frontend, cases, name: str, mode: str
) -> None:
    ours = _ours(models, frontend, name, mode)
    prefix = f"{name}/{mode}/"
    expected = {k[len(prefix) :]: v for k, v in cases.items() if k.startswith(prefix)}
    n = int(cases[f"{prefix}flow_prompt_speech_token_len"])
    # Stored once in the data: the cut mel is the signal's mel up to 2 frames a kept token.
    expected["prompt_speech_feat"] = cases[f"{name}/speech_feat"][:, : 2 * n]
    assert sorted(ours) == sorted(expected)
    for key, want in expected.items():
        got = ours[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        if key == "prompt_speech_feat":
            assert _max_abs(got, want) <= PROMPT_MEL_ATOL, key
        elif key.endswith("embedding"):
            assert torch.allclose(got, want, atol=EMBEDDING_ATOL, rtol=0), key
        else:
            assert torch.equal(got, want), key
    assert int(ours["prompt_speech_feat_len"]) == 2 * n


def test_tokens_and_mel_are_cut_to_two_frames_a_token(models, cases) -> None:
    # Official sizes before the cut: the tokens bind on every recording (16 kHz: 125 frames,
    # 63 tokens -> 62 tokens, 124 frames).
    for name in SIGNALS:
        frames = cases[f"{name}/speech_feat"].shape[1]
        tokens = cases[f"{name}/speech_token"].shape[1]
        kept = min(frames // 2, tokens)
        assert kept < tokens
        prompt = extract_recording(load_prompt(SIGNALS[name]), models, COSYVOICE2)
        assert prompt.speech_tokens.shape[1] == kept and prompt.speech_feat.shape[1] == 2 * kept
    # The frames bind when the tokenizer gives more than half as many tokens as mel frames.
    feat = torch.randn(1, 9, 80)
    cut_tokens, cut_feat = align_tokens_and_mel(torch.arange(7).reshape(1, 7), feat, 2)
    assert cut_tokens.tolist() == [[0, 1, 2, 3]] and torch.equal(cut_feat, feat[:, :8])
    cut_tokens, cut_feat = align_tokens_and_mel(torch.arange(3).reshape(1, 3), feat, 2)
    assert cut_tokens.shape[1] == 3 and torch.equal(cut_feat, feat[:, :6])


# --- the tiny v2 speech-tokenizer stand-in -----------------------------------------------------


def test_stand_in_has_the_v2_tokenizer_contract(v1_features) -> None:
    session = ort.InferenceSession(str(TOKENIZER_V2), providers=["CPUExecutionProvider"])
    inputs, outputs = session.get_inputs(), session.get_outputs()
    assert [(i.name, i.type) for i in inputs] == [
        ("feats", "tensor(float)"),
        ("feats_length", "tensor(int32)"),
    ]
    assert inputs[0].shape[1] == 128 and len(inputs[1].shape) == 1
    assert [(o.name, o.type, len(o.shape)) for o in outputs] == [("indices", "tensor(int64)", 3)]
    log_mel = v1_features["whisper/log_mel"].numpy()  # (1, 128, 250): 2.5 s
    for frames in (1, 2, 3, 4, 5, 8, 9, 250):
        feats = np.ascontiguousarray(log_mel[:, :, :frames])
        out = session.run(None, {"feats": feats, "feats_length": np.array([frames], np.int32)})[0]
        assert out.shape == (1, 1, math.ceil(frames / 4))  # 25 tokens a second
        assert out.min() >= 0 and out.max() < 6561
    full = session.run(None, {"feats": log_mel, "feats_length": np.array([250], np.int32)})[0]
    short = session.run(None, {"feats": log_mel, "feats_length": np.array([210], np.int32)})[0]
    assert (full != short).any() and (full[..., :50] == short[..., :50]).all()


def test_a_tokenizer_of_the_wrong_family_is_refused(v1_features) -> None:
    log_mel = v1_features["whisper/log_mel"]
    with pytest.raises(PromptModelError, match=r"125 tokens .* expected 63"):
        PromptModels(CAMPPLUS, TOKENIZER_V1, kind=V2_SPEECH_TOKENIZER).speech_tokens(log_mel)
    with pytest.raises(PromptModelError, match=r"63 tokens .* expected 125"):
        PromptModels(CAMPPLUS, TOKENIZER_V2).speech_tokens(log_mel)
    small_codebook = SpeechTokenizer("speech_tokenizer_v2.onnx", 4, 4096, "nowhere")
    with pytest.raises(PromptModelError, match=r"outside 0\.\.4095"):
        PromptModels(CAMPPLUS, TOKENIZER_V2, kind=small_codebook).speech_tokens(log_mel)
    wave_16k = load_prompt(SIGNALS["prompt16k"]).at(16000)
    with pytest.raises(ValueError, match="not the cosyvoice2 tokenizer"):
        extract_features(wave_16k, PromptModels(CAMPPLUS, TOKENIZER_V1), COSYVOICE2)


def test_missing_v2_tokenizer_names_the_v2_model(tmp_path: Path) -> None:
    shutil.copy(CAMPPLUS, tmp_path / "campplus.onnx")
    models = prompt_models(tmp_path)
    assert models.tokenizer_path == tmp_path / "speech_tokenizer_v2.onnx"
    with pytest.raises(PromptModelError, match=r"speech_tokenizer_v2\.onnx .*CosyVoice2-0\.5B"):
        models.check()


# --- the voice cache, keyed by model family ----------------------------------------------------


@pytest.fixture()
def voices_dir(tmp_path: Path) -> Path:
    d = tmp_path / "voices"
    d.mkdir()
    shutil.copy(SIGNALS["prompt16k"], d / "anna.wav")  # 2.5 s: too short for a voice
    with wave.open(str(d / "anna.wav"), "rb") as w:
        pcm = w.readframes(w.getnframes())
    with wave.open(str(d / "anna.wav"), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(pcm + pcm)  # 5 s
    (d / "anna.txt").write_text(PROMPT_TEXT)
    return d


def test_each_family_has_its_own_cache(voices_dir: Path, models, v1_models) -> None:
    v1 = load_voice(voices_dir, "anna", v1_models)
    v2 = load_voice(voices_dir, "anna", models, COSYVOICE2)
    assert (v1.family, v2.family) == ("cosyvoice1", "cosyvoice2")
    assert v1.source == v2.source == "extracted"
    v1_cache, v2_cache = (
        voices_dir / f"anna{CACHE_SUFFIX}",
        voices_dir / "anna.cosyvoice2.prompt.pt",
    )
    assert v1_cache.is_file() and v2_cache.is_file()
    assert torch.load(v2_cache, weights_only=True)["family"] == "cosyvoice2"
    # v1: 50 tokens a second, 22050 Hz mel; v2: 25 a second, 2 mel frames each.
    assert v1.prompt.speech_tokens.shape[1] == 250 and v1.prompt.speech_feat.shape[1] == 430
    assert v2.prompt.speech_tokens.shape[1] == 125 and v2.prompt.speech_feat.shape[1] == 250
    # Each reads back its own; the folder still lists one voice.
    assert load_voice(voices_dir, "anna", v1_models).source == "cache"
    again = load_voice(voices_dir, "anna", models, COSYVOICE2)
    assert again.source == "cache" and torch.equal(
        again.prompt.speech_tokens, v2.prompt.speech_tokens
    )
    assert voice_names(voices_dir) == ["anna"]


def test_a_cache_of_another_family_is_never_read(voices_dir: Path, models, v1_models) -> None:
    v1_cache, v2_cache = (
        voices_dir / f"anna{CACHE_SUFFIX}",
        voices_dir / "anna.cosyvoice2.prompt.pt",
    )
    load_voice(voices_dir, "anna", v1_models)
    # A v1 cache under the v2 name (copied by hand) is not taken for v2 features ...
    shutil.copy(v1_cache, v2_cache)
    with pytest.raises(VoiceError, match=r"not extracted yet .*speech_tokenizer_v2\.onnx"):
        load_voice(voices_dir, "anna", None, COSYVOICE2)
    v2 = load_voice(voices_dir, "anna", models, COSYVOICE2)
    assert v2.source == "extracted" and v2.prompt.speech_tokens.shape[1] == 125
    # ... nor a v2 cache under the v1 name.
    shutil.copy(v2_cache, v1_cache)
    with pytest.raises(VoiceError, match="not extracted yet"):
        load_voice(voices_dir, "anna", None)
    # Caches written before the family was recorded are v1's: v1 reads them, v2 does not.
    load_voice(voices_dir, "anna", v1_models)  # a fresh v1 cache
    state = torch.load(v1_cache, weights_only=True)
    del state["family"]
    torch.save(state, v1_cache)
    assert load_voice(voices_dir, "anna", None).source == "cache"
    shutil.copy(v1_cache, v2_cache)
    with pytest.raises(VoiceError, match="not extracted yet"):
        load_voice(voices_dir, "anna", None, COSYVOICE2)


def test_v2_library_scans_with_the_v2_recipe(voices_dir: Path, models) -> None:
    library = voice_library(voices_dir, models)
    voice = library.scan().voices["anna"]
    assert voice.family == "cosyvoice2" and voice.language == "zh"
    assert library.scan().voices["anna"].source == "cache"
    with pytest.raises(ValueError, match="not the CosyVoice2 speech tokenizer"):
        voice_library(voices_dir, PromptModels(CAMPPLUS, TOKENIZER_V1))


# --- modes, and a prompt through the tiny v2 model ---------------------------------------------


def test_modes_condition_the_lm_and_flow_as_the_official_frontend(
    voices_dir: Path, models, v1_models, frontend
) -> None:
    voice = load_voice(voices_dir, "anna", models, COSYVOICE2)
    tokens = voice.prompt.speech_tokens
    same = conditioning(voice, frontend, "今天天气很好。")
    assert same.mode == ZERO_SHOT
    assert same.prompt_text_ids == frontend.prompt_text_ids(PROMPT_TEXT)
    assert same.llm_prompt_tokens == tokens.reshape(-1).tolist()
    cross = conditioning(voice, frontend, "Turn on the lights.")
    assert cross.mode == CROSS_LINGUAL
    assert cross.prompt_text_ids == [] and cross.llm_prompt_tokens == []
    inst = conditioning(voice, frontend, "Turn on the lights.", instruct="用四川话说这句话")
    assert inst.mode == INSTRUCT2
    assert inst.prompt_text_ids == frontend.instruct_ids(INSTRUCT_TEXT)
    assert inst.llm_prompt_tokens == []
    own = dataclasses.replace(voice, instruct="Speak slowly.")
    assert conditioning(own, frontend, "你好。").mode == INSTRUCT2
    # The flow hears the recording in every mode.
    for plan in (same, cross, inst):
        assert torch.equal(plan.flow_prompt.tokens, tokens.long())
        assert torch.equal(plan.flow_prompt.feat, voice.prompt.speech_feat)
        assert torch.equal(plan.flow_prompt.embedding, voice.prompt.embedding)
    # A voice prepared for one family is refused by the other.
    with pytest.raises(ValueError, match="cosyvoice1, not cosyvoice2"):
        conditioning(load_voice(voices_dir, "anna", v1_models), frontend, "你好。")
    from engine.text.frontend import TextFrontend

    with pytest.raises(ValueError, match="cosyvoice2, not cosyvoice1"):
        to_engine_voice(voice, TextFrontend(), "你好。")


@pytest.fixture(scope="module")
def v2_model():
    from engine.cosyvoice2.flow import load_flow
    from engine.cosyvoice2.flow_args import load_flow_args, load_hift_args
    from engine.cosyvoice2.hift import load_hift
    from engine.cosyvoice2.lm import load_speech_lm, load_speech_lm_args

    yaml = TINY / "cosyvoice2.yaml"
    lm = load_speech_lm(torch.load(TINY / "llm.pt", weights_only=True), load_speech_lm_args(TINY))
    flow = load_flow(torch.load(TINY / "flow.pt", weights_only=True), load_flow_args(yaml))
    hift = load_hift(torch.load(TINY / "hift.pt", weights_only=True), load_hift_args(yaml))
    return lm, flow, hift


@pytest.mark.parametrize("instruct", [None, "用四川话说这句话"])
def test_an_extracted_prompt_drives_the_tiny_v2_model(
    voices_dir: Path, models, frontend, v2_model, instruct
) -> None:
    from engine.core.streaming import GeneratorNoise
    from engine.cosyvoice2.streaming import SpeechStream, official_hops, stream_audio, whole_audio

    lm, flow, hift = v2_model
    voice = load_voice(voices_dir, "anna", models, COSYVOICE2)
    segment = frontend.segments("今天天气很好。")[0]
    plan = conditioning(voice, frontend, segment.text, instruct=instruct)
    assert plan.mode == (INSTRUCT2 if instruct else ZERO_SHOT)
    generator = torch.Generator().manual_seed(0)
    tokens = list(
        lm.generate(
            segment.token_ids,
            plan.prompt_text_ids,
            plan.llm_prompt_tokens,
            generator=generator,
            max_tokens=40,
        )
    )
    assert tokens and all(0 <= t < 6561 for t in tokens)
    noise = GeneratorNoise(torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = whole_audio(flow, hift, plan.flow_prompt, tokens, noise)
        # Only the new speech comes out: 2 mel frames a token, 480 samples a frame.
        assert whole.shape == (1, len(tokens) * 2 * 480)
        speech = SpeechStream(flow, hift, plan.flow_prompt, noise)
        chunks = list(stream_audio(tokens, speech, official_hops(plan.flow_prompt.tokens.shape[1])))
    assert sum(c.shape[1] for c in chunks) == whole.shape[1]
    assert bool(torch.isfinite(whole).all())


def test_flow_prompt_is_int64_tokens_and_float_mel(voices_dir: Path, models) -> None:
    prompt = load_voice(voices_dir, "anna", models, COSYVOICE2).prompt
    flow = flow_prompt(prompt)
    assert flow.tokens.dtype == torch.int64 and flow.feat.dtype == torch.float32
    assert flow.feat.shape[1] == 2 * flow.tokens.shape[1]


# --- voices out of the box: built-in speakers of the tiny v1 model -----------------------------


@pytest.fixture(scope="module")
def v1_engine():
    from engine.cosyvoice1.engine import CosyVoiceEngine

    return CosyVoiceEngine.load(DATA / "tiny_model", threads=1)


# 200 v1 tokens at 50 a second: 4 s of audio, random weights never stop by themselves.
QUICK = SynthesisOptions(force_tokens=200, n_timesteps=2)


def test_builtin_speakers_become_v2_voices(v1_engine, models, tmp_path: Path) -> None:
    folder = tmp_path / "builtin"
    result = make_builtin_voices(v1_engine, folder, models, options=QUICK)
    assert sorted(result.made) == sorted(v1_engine.speakers) == ["中文女", "英文男"]
    assert result.failed == {}
    for name in v1_engine.speakers:
        voice = result.voices[name]
        sentence = SENTENCES[SPEAKER_LANGUAGES[name]]
        assert (folder / f"{name}.txt").read_text(encoding="utf-8").strip() == sentence
        with wave.open(str(folder / f"{name}.wav"), "rb") as w:
            assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (22050, 1, 2)
            assert w.getnframes() == tokens_to_frames(200) * HOP  # all the v1 engine said
        assert (folder / f"{name}.cosyvoice2.prompt.pt").is_file()
        assert voice.family == "cosyvoice2" and voice.transcript == sentence
        assert voice.language == SPEAKER_LANGUAGES[name]
        assert voice.prompt.speech_tokens.shape[1] == 99  # 4 s at 25 a second, cut to the mel
    # An ordinary voices folder for a v2 engine: every voice from its cache.
    scanned = voice_library(folder, models).scan()
    assert sorted(scanned.voices) == ["中文女", "英文男"] and not scanned.rejected
    assert all(v.source == "cache" for v in scanned.voices.values())
    # Made once: a second run keeps the files and makes nothing.
    wav_bytes = (folder / "中文女.wav").read_bytes()
    again = make_builtin_voices(v1_engine, folder, models, options=QUICK)
    assert again.made == [] and sorted(again.voices) == ["中文女", "英文男"]
    assert all(v.source == "cache" for v in again.voices.values())
    assert (folder / "中文女.wav").read_bytes() == wav_bytes


class ScriptedEngine:
    """A stand-in v1 engine: the seconds of audio it says depend on the seed."""

    sample_rate = 22050

    def __init__(self, speakers: list[str], seconds_by_seed: dict[int, float]) -> None:
        self.speakers = speakers
        self.seconds_by_seed = seconds_by_seed
        self.calls: list[tuple[str, str | None, int | None, bool]] = []

    def synthesize(
        self,
        text: str,
        options: SynthesisOptions | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        assert options is not None
        self.calls.append((text, options.speaker, options.seed, options.stream))
        seconds = self.seconds_by_seed.get(options.seed or 0, 4.0)
        n = int(seconds * self.sample_rate)
        t = np.arange(n) / self.sample_rate
        f0 = 150 + 30 * np.sin(2 * np.pi * 0.8 * t)
        phase = 2 * np.pi * np.cumsum(f0) / self.sample_rate
        audio = sum(0.15 / h * np.sin(h * phase) for h in range(1, 12))
        yield AudioChunk(np.asarray(audio, dtype=np.float32), self.sample_rate)


def test_a_draw_that_fails_validation_is_tried_again(models, tmp_path: Path) -> None:
    engine = ScriptedEngine(["英文女"], {1986: 1.5, 1987: 4.5})
    result = make_builtin_voices(engine, tmp_path, models)
    assert result.made == ["英文女"] and result.failed == {}
    assert [c[2] for c in engine.calls] == [1986, 1987]  # a new seed after a 1.5 s draw
    assert all(c[:2] == (SENTENCES["en"], "英文女") and c[3] is False for c in engine.calls)
    assert result.voices["英文女"].duration_s == pytest.approx(4.5, abs=1e-3)


def test_speakers_that_cannot_be_made_are_listed(models, tmp_path: Path) -> None:
    engine = ScriptedEngine(["韩语女", "mystery"], {1986: 1.0, 1987: 1.0, 1988: 1.0})
    result = make_builtin_voices(engine, tmp_path, models, speakers=["韩语女", "mystery", "nobody"])
    assert result.voices == {} and result.made == []
    assert (
        "after 3 attempts" in result.failed["韩语女"] and "at least 3 s" in result.failed["韩语女"]
    )
    assert "no sentence for its language (unknown)" in result.failed["mystery"]
    assert "no such speaker" in result.failed["nobody"]
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # failed draws leave nothing


def test_existing_recordings_are_never_overwritten(models, tmp_path: Path) -> None:
    (tmp_path / "中文女.txt").write_text(PROMPT_TEXT)  # someone's own voice, no WAV yet
    (tmp_path / "英文女.MP3").write_bytes(b"ID3")  # a recording still to be converted
    engine = ScriptedEngine(["中文女", "中文男", "英文女"], {})
    result = make_builtin_voices(engine, tmp_path, models)
    assert [c[1] for c in engine.calls] == ["中文男"]
    assert result.made == ["中文男"]
    assert "recording 中文女.wav is missing" in result.failed["中文女"]
    assert "not a WAV file" in result.failed["英文女"]
    assert (tmp_path / "中文女.txt").read_text() == PROMPT_TEXT
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("英文女")] == ["英文女.MP3"]


def test_prompt_models_are_checked_before_any_synthesis(tmp_path: Path) -> None:
    engine = ScriptedEngine(["中文女"], {})
    with pytest.raises(PromptModelError, match="speech_tokenizer_v2.onnx"):
        make_builtin_voices(engine, tmp_path / "out", prompt_models(tmp_path))
    with pytest.raises(ValueError, match="not the CosyVoice2 speech tokenizer"):
        make_builtin_voices(engine, tmp_path / "out", PromptModels(CAMPPLUS, TOKENIZER_V1))
    assert engine.calls == []


def test_every_family_cache_ends_like_the_ones_the_folder_scan_skips() -> None:
    assert COSYVOICE1.cache_suffix == CACHE_SUFFIX == ".prompt.pt"
    assert COSYVOICE2.cache_suffix.endswith(".prompt.pt")
    with pytest.raises(ValueError, match="must end in .prompt.pt"):
        dataclasses.replace(COSYVOICE2, cache_suffix=".v2.pt")
