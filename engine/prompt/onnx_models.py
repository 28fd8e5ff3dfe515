"""CAM++ speaker embedding and the v1 speech tokenizer, run with onnxruntime.

onnxruntime is an optional extra (``pip install wyoming-cosyvoice[voices]``): it is imported only
when a prompt actually has to be extracted, so SFT/Instruct users and cached custom voices never
load it. Calls follow the official frontend's contract (tests/data/zero_shot/README.md §4): inputs
are looked up by *position* (the tokenizer's input names are not known), output 0 is flattened, the
embedding comes back as float32 (1, 192) and the tokens as int32 (1, T') whatever dtype the model
returns.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.prompt.errors import PromptModelError

_LOGGER = logging.getLogger(__name__)

CAMPPLUS_FILE = "campplus.onnx"
TOKENIZER_FILE = "speech_tokenizer_v1.onnx"
EMBEDDING_DIM = 192
MAX_TOKENIZER_SECONDS = 30.0  # the v1 tokenizer's guard (whisper-style 30 s window)


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

    def __init__(self, campplus: Path | str, tokenizer: Path | str, *, threads: int = 1) -> None:
        self.campplus_path = Path(campplus)
        self.tokenizer_path = Path(tokenizer)
        self.threads = threads
        self._sessions: dict[str, Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_model_dir(cls, model_dir: Path | str, *, threads: int = 1) -> PromptModels:
        """``campplus.onnx`` and ``speech_tokenizer_v1.onnx`` of an official model directory."""
        model_dir = Path(model_dir)
        return cls(model_dir / CAMPPLUS_FILE, model_dir / TOKENIZER_FILE, threads=threads)

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
                + " (they ship with the FunAudioLLM/CosyVoice-300M model repositories)"
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
        """(1, 128, T) whisper log-mel -> int32 (1, T') speech tokens (T' = ceil(T/2), 50 Hz)."""
        frames = log_mel.shape[-1]
        if frames / 100.0 > MAX_TOKENIZER_SECONDS:
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
        # The output dtype is the model's business (int64 in the stand-in); ids are < 4096.
        return torch.from_numpy(out.astype(np.int32)).reshape(1, -1)
