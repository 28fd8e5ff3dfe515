"""CAM++ speaker embedding and a model family's speech tokenizer, run with onnxruntime.

onnxruntime is an optional extra (``pip install wyoming-cosyvoice[voices]``): it is imported only
when a prompt actually has to be extracted, so SFT/Instruct users and cached custom voices never
load it. Calls follow the official frontend's contract (tests/data/zero_shot/README.md §4): inputs
are looked up by *position* (the tokenizer's input names are not known), output 0 is flattened, the
embedding comes back as float32 (1, 192) and the tokens as int32 (1, T') whatever dtype the model
returns. Both tokenizers read the same 128-bin whisper log-mel (100 frames/s); v1's gives 50
tokens a second from a 4096-entry codebook, v2's 25 a second from 6561 (:class:`SpeechTokenizer`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.prompt.errors import PromptModelError

_LOGGER = logging.getLogger(__name__)

CAMPPLUS_FILE = "campplus.onnx"
EMBEDDING_DIM = 192
MAX_TOKENIZER_SECONDS = 30.0  # the tokenizers' guard (whisper-style 30 s window)
LOG_MEL_FRAMES_PER_SECOND = 100


@dataclass(frozen=True)
class SpeechTokenizer:
    """What is known of a family's speech tokenizer file."""

    file: str
    frames_per_token: int  # whisper log-mel frames a token covers
    codebook: int  # token ids are 0 .. codebook - 1
    ships_with: str  # where a user finds the file (for error messages)

    def expected_tokens(self, frames: int) -> int:
        return math.ceil(frames / self.frames_per_token)


V1_SPEECH_TOKENIZER = SpeechTokenizer(
    "speech_tokenizer_v1.onnx", 2, 4096, "the FunAudioLLM/CosyVoice-300M model repositories"
)
TOKENIZER_FILE = V1_SPEECH_TOKENIZER.file


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as err:
        raise PromptModelError(
            "custom voices need onnxruntime to extract the prompt: "
            "pip install 'wyoming-cosyvoice[voices]' (or pip install onnxruntime)"
        ) from err
    return onnxruntime


class PromptModels:
    """The two prompt ONNX models, with sessions opened on first use (thread-safe)."""

    def __init__(
        self,
        campplus: Path | str,
        tokenizer: Path | str,
        *,
        threads: int = 1,
        kind: SpeechTokenizer = V1_SPEECH_TOKENIZER,
    ) -> None:
        self.campplus_path = Path(campplus)
        self.tokenizer_path = Path(tokenizer)
        self.threads = threads
        self.kind = kind
        self._sessions: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: Path | str,
        *,
        threads: int = 1,
        kind: SpeechTokenizer = V1_SPEECH_TOKENIZER,
    ) -> PromptModels:
        """``campplus.onnx`` and the family's speech tokenizer of an official model directory."""
        model_dir = Path(model_dir)
        return cls(model_dir / CAMPPLUS_FILE, model_dir / kind.file, threads=threads, kind=kind)

    def identity(self) -> dict[str, object]:
        """What a cached prompt depends on (name + size; hashing 500 MB at start-up is not ok)."""
        out: dict[str, object] = {}
        for key, path in (("campplus", self.campplus_path), ("tokenizer", self.tokenizer_path)):
            size = path.stat().st_size if path.is_file() else -1
            out[key] = f"{path.name}:{size}"
        return out

    def files_present(self) -> bool:
        return self.campplus_path.is_file() and self.tokenizer_path.is_file()

    def check(self) -> None:
        """Raise PromptModelError unless onnxruntime and both model files are present."""
        _onnxruntime()
        missing = [p for p in (self.campplus_path, self.tokenizer_path) if not p.is_file()]
        if missing:
            raise PromptModelError(
                "custom voices need "
                + " and ".join(str(p) for p in missing)
                + f" (they ship with {self.kind.ships_with})"
            )

    def _session(self, path: Path) -> Any:
        with self._lock:
            session = self._sessions.get(str(path))
            if session is not None:
                return session
            self.check()
            ort = _onnxruntime()
            options = ort.SessionOptions()
            # As upstream: full graph optimisation, few threads (the engine owns the cores).
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            options.intra_op_num_threads = self.threads
            options.inter_op_num_threads = 1
            start = time.perf_counter()
            try:
                session = ort.InferenceSession(
                    str(path), sess_options=options, providers=["CPUExecutionProvider"]
                )
            except Exception as err:  # onnxruntime raises its own exception types
                raise PromptModelError(f"cannot load {path}: {err}") from err
            _LOGGER.info("Loaded %s in %.2f s", path.name, time.perf_counter() - start)
            self._sessions[str(path)] = session
            return session

    def close(self) -> None:
        """Drop the sessions (the real tokenizer holds ~0.5 GB; reopened when needed)."""
        with self._lock:
            self._sessions.clear()

    def embedding(self, campplus_feed: torch.Tensor) -> torch.Tensor:
        """(1, T, 80) mean-normalised fbank -> float32 (1, 192) raw x-vector."""
        session = self._session(self.campplus_path)
        inputs = session.get_inputs()
        feed = {inputs[0].name: campplus_feed.reshape(1, -1, 80).to(torch.float32).numpy()}
        out = np.asarray(session.run(None, feed)[0]).reshape(-1)
        if out.size != EMBEDDING_DIM:
            raise PromptModelError(
                f"{self.campplus_path.name} returned {out.size} values, "
                f"expected a {EMBEDDING_DIM}-d embedding"
            )
        return torch.from_numpy(out.astype(np.float32)).reshape(1, EMBEDDING_DIM)

    def speech_tokens(self, log_mel: torch.Tensor) -> torch.Tensor:
        """(1, 128, T) whisper log-mel -> int32 (1, T') speech tokens (T' = ceil(T / 2) for v1,
        ceil(T / 4) for v2); PromptModelError when the model is not the expected tokenizer."""
        frames = log_mel.shape[-1]
        if frames / LOG_MEL_FRAMES_PER_SECOND > MAX_TOKENIZER_SECONDS:
            raise PromptModelError(
                f"the speech tokenizer takes at most {MAX_TOKENIZER_SECONDS:g} s of audio"
            )
        session = self._session(self.tokenizer_path)
        inputs = session.get_inputs()
        feed = {
            inputs[0].name: log_mel.reshape(1, 128, frames).to(torch.float32).numpy(),
            inputs[1].name: np.array([frames], dtype=np.int32),  # no padding: length = T
        }
        out = np.asarray(session.run(None, feed)[0]).reshape(-1)
        self._check_tokens(out, frames)
        # The output dtype is the model's business (int64 in the stand-ins).
        return torch.from_numpy(out.astype(np.int32)).reshape(1, -1)

    def _check_tokens(self, tokens: np.ndarray, frames: int) -> None:
        # A tokenizer of another family (50 instead of 25 tokens a second, or ids past the
        # codebook) would condition the model with tokens it never saw: refuse it.
        name, kind = self.tokenizer_path.name, self.kind
        expected = kind.expected_tokens(frames)
        if abs(tokens.size - expected) > 1:
            raise PromptModelError(
                f"{name} returned {tokens.size} tokens for {frames / 100:.2f} s of audio, "
                f"expected {expected}: it is not the speech tokenizer this model needs "
                f"({kind.file})"
            )
        if tokens.size and (tokens.min() < 0 or tokens.max() >= kind.codebook):
            raise PromptModelError(
                f"{name} returned token ids outside 0..{kind.codebook - 1}: it is not the "
                f"speech tokenizer this model needs ({kind.file})"
            )
