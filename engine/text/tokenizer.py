"""Whisper multilingual BPE tokenizer (the text vocabulary of CosyVoice-300M v1).

The v1 models were trained on ``whisper.tokenizer.get_tokenizer(multilingual=True,
num_languages=100)``: the 50,257 byte-level BPE ranks of ``multilingual.tiktoken`` followed by
1,609 special tokens (51,866 ids).  CosyVoice calls ``encode(text, allowed_special='all')``
and adds no start/language/task tokens, so neither do we.  We build the same tiktoken
``Encoding`` from the vocabulary file shipped in ``engine/assets`` (no openai-whisper
dependency, no network).
"""

from __future__ import annotations

import binascii
import logging
import threading
from collections.abc import Iterable
from importlib.resources import files

import tiktoken

_LOGGER = logging.getLogger(__name__)

VOCAB_RESOURCE = "multilingual.tiktoken"
VOCAB_SHA256 = "b34b360dbb493e781e479794586d661700670d65564001f23024971d1f2fa126"
N_RANKS = 50257
N_VOCAB = 51866

# GPT-2 pre-tokenisation pattern used by whisper's multilingual encoding.
PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Whisper's 100 language codes, in the order their <|xx|> tokens get ids (en=50259 ...).
LANGUAGE_CODES: tuple[str, ...] = (
    "en", "zh", "de", "es", "ru", "ko", "fr", "ja", "pt", "tr", "pl", "ca", "nl", "ar", "sv",
    "it", "id", "hi", "fi", "vi", "he", "uk", "el", "ms", "cs", "ro", "da", "hu", "ta", "no",
    "th", "ur", "hr", "bg", "lt", "la", "mi", "ml", "cy", "sk", "te", "fa", "lv", "bn", "sr",
    "az", "sl", "kn", "et", "mk", "br", "eu", "is", "hy", "ne", "mn", "bs", "kk", "sq", "sw",
    "gl", "mr", "pa", "si", "km", "sn", "yo", "so", "af", "oc", "ka", "be", "tg", "sd", "gu",
    "am", "yi", "lo", "uz", "fo", "ht", "ps", "tk", "nn", "mt", "sa", "lb", "my", "bo", "tl",
    "mg", "as", "tt", "haw", "ln", "ha", "ba", "jw", "su", "yue",
)  # fmt: skip


def special_tokens() -> list[str]:
    """All 1,609 whisper special tokens in id order (ids 50257 ... 51865)."""
    specials = ["<|endoftext|>", "<|startoftranscript|>"]
    specials += [f"<|{code}|>" for code in LANGUAGE_CODES]
    specials += [
        "<|translate|>",
        "<|transcribe|>",
        "<|startoflm|>",
        "<|startofprev|>",
        "<|nospeech|>",
        "<|notimestamps|>",
    ]
    specials += [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
    return specials


def _load_ranks() -> dict[bytes, int]:
    """Parse ``base64-token rank`` lines from the packaged vocabulary file."""
    data = files("engine.assets").joinpath(VOCAB_RESOURCE).read_bytes()
    # binascii's decoder in one comprehension: the 50k lines are parsed at every start.
    ranks = {
        binascii.a2b_base64(token): int(rank)
        for token, rank in (line.split() for line in data.splitlines() if line)
    }
    if len(ranks) != N_RANKS:
        raise RuntimeError(f"{VOCAB_RESOURCE}: expected {N_RANKS} ranks, found {len(ranks)}")
    return ranks


class WhisperTokenizer:
    """Thin wrapper over a tiktoken ``Encoding`` with CosyVoice's calling convention."""

    def __init__(self) -> None:
        ranks = _load_ranks()
        specials = {tok: N_RANKS + i for i, tok in enumerate(special_tokens())}
        self.encoding = tiktoken.Encoding(
            name="whisper_multilingual_100",
            pat_str=PAT_STR,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        self.special_ids: dict[str, int] = specials

    @property
    def n_vocab(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text``; whisper specials written in the text become single ids."""
        return self.encoding.encode(text, allowed_special="all")

    def decode(self, ids: Iterable[int]) -> str:
        return self.encoding.decode(list(ids))

    def language_id(self, code: str) -> int:
        """Id of the ``<|code|>`` language tag (e.g. 'zh' -> 50260)."""
        return self.special_ids[f"<|{code}|>"]


_TOKENIZER: WhisperTokenizer | None = None
_TOKENIZER_LOCK = threading.Lock()


def get_tokenizer() -> WhisperTokenizer:
    """The process-wide tokenizer, built on first use (thread-safe)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        with _TOKENIZER_LOCK:
            if _TOKENIZER is None:
                _LOGGER.debug("Loading whisper multilingual vocabulary")
                _TOKENIZER = WhisperTokenizer()
    return _TOKENIZER
