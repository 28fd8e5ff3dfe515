"""CosyVoice2's text frontend: v1's normalisation, then the Qwen2 BPE of the model folder.

The tokenizer is read from ``CosyVoice-BlankEN/`` with the ``tokenizers`` library: its
``tokenizer.json`` when there is one, otherwise ``vocab.json`` + ``merges.txt`` set up as a
Qwen2 tokenizer (NFC, Qwen2's split pattern, byte-level BPE, no unknown token) with the added
tokens ``tokenizer_config.json`` lists. CosyVoice2 then adds its own special tokens in a fixed
order (:data:`SPECIAL_TOKENS`), so ``<|endofprompt|>``, ``[laughter]``, ``<strong>``… typed in
the text become single ids; nothing else is added (no BOS/EOS).

Text is normalised exactly as for v1 (:mod:`engine.text.normalize`); the inline tags pass
through it unchanged. English text is cut into segments by its length in Qwen2 tokens.
Instruct2 text is an instruction followed by ``<|endofprompt|>`` and is tokenised as typed
(the official frontend does not normalise it either).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from engine.core.types import ModelLoadError
from engine.text import rules, wetext_backend
from engine.text.errors import TextInputError
from engine.text.frontend import Segment, checked_text
from engine.text.normalize import normalize, normalize_text
from engine.text.pronunciations import PronouncingFrontend

_LOGGER = logging.getLogger(__name__)

END_OF_PROMPT = "<|endofprompt|>"
# Added by CosyVoice2 on top of the Qwen2 vocabulary, in this order (ids follow the vocabulary's
# own added tokens; those already present keep their id).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", END_OF_PROMPT,
    "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]",
    "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)  # fmt: skip
# Qwen2's pre-tokenisation: case-insensitive English contractions, letter runs (with one
# leading non-letter), single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_USER_END_OF_PROMPT = re.compile(r"\s*<\|?endofprompt\|?>\s*$")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise ModelLoadError(f"cannot read {path}: {err.strerror or err}") from err
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{path} is not valid JSON: {err}") from err


def _from_vocab_files(folder: Path) -> Tokenizer:
    """A Qwen2 tokenizer from ``vocab.json`` + ``merges.txt`` (+ the config's added tokens)."""
    vocab, merges = folder / "vocab.json", folder / "merges.txt"
    for path in (vocab, merges):
        if not path.is_file():
            raise ModelLoadError(f"{folder}: tokenizer file {path.name} is missing")
    try:
        bpe = models.BPE.from_file(str(vocab), str(merges), unk_token=None, byte_fallback=False)
    except Exception as err:  # the library's own error types are not exported
        raise ModelLoadError(f"{folder}: unreadable tokenizer files ({err})") from err
    tokenizer = Tokenizer(bpe)
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    config = folder / "tokenizer_config.json"
    if config.is_file():
        _add_configured_tokens(tokenizer, _read_json(config), config)
    return tokenizer


def _add_configured_tokens(tokenizer: Tokenizer, config: Any, source: Path) -> None:
    """The ``added_tokens_decoder`` entries, in id order, each checked to land on its id."""
    added = config.get("added_tokens_decoder", {}) if isinstance(config, dict) else {}
    try:
        entries = sorted((int(i), spec) for i, spec in added.items())
    except (TypeError, ValueError, AttributeError) as err:
        raise ModelLoadError(f"{source}: malformed added_tokens_decoder") from err
    for token_id, spec in entries:
        if not isinstance(spec, dict) or not isinstance(spec.get("content"), str):
            raise ModelLoadError(f"{source}: malformed added token {token_id}")
        token = AddedToken(
            spec["content"],
            single_word=bool(spec.get("single_word", False)),
            lstrip=bool(spec.get("lstrip", False)),
            rstrip=bool(spec.get("rstrip", False)),
            normalized=bool(spec.get("normalized", not spec.get("special", False))),
            special=bool(spec.get("special", False)),
        )
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        got = tokenizer.token_to_id(token.content)
        if got != token_id:
            raise ModelLoadError(
                f"{source}: added token {token.content!r} got id {got}, not {token_id}"
            )


class Qwen2TextTokenizer:
    """The model folder's Qwen2 BPE with CosyVoice2's special tokens."""

    # Added on top of the folder's vocabulary, in this order (a later family adds more).
    SPECIAL_TOKENS: tuple[str, ...] = SPECIAL_TOKENS

    def __init__(self, folder: Path) -> None:
        folder = Path(folder)
        if not folder.is_dir():
            raise ModelLoadError(f"tokenizer folder {folder} does not exist")
        full = folder / "tokenizer.json"
        if full.is_file():
            try:
                self.tokenizer = Tokenizer.from_file(str(full))
            except Exception as err:  # the library's own error types are not exported
                raise ModelLoadError(f"{full}: unreadable tokenizer ({err})") from err
        else:
            self.tokenizer = _from_vocab_files(folder)
        self.tokenizer.add_special_tokens(
            [
                AddedToken(
                    t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True
                )
                for t in self.SPECIAL_TOKENS
            ]
        )
        self.special_ids = {t: self.token_id(t) for t in self.SPECIAL_TOKENS}

    def token_id(self, token: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise KeyError(token)
        return int(token_id)

    @property
    def n_vocab(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """BPE ids of ``text``; special tokens written in it become single ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int], *, skip_special: bool = False) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special))


_TOKENIZERS: dict[tuple[type[Qwen2TextTokenizer], Path], Qwen2TextTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def get_tokenizer(
    folder: Path, kind: type[Qwen2TextTokenizer] = Qwen2TextTokenizer
) -> Qwen2TextTokenizer:
    """The process-wide tokenizer of a folder, built on first use (thread-safe); ``kind`` says
    which family's special tokens it adds."""
    key = (kind, Path(folder).resolve())
    with _TOKENIZERS_LOCK:
        tokenizer = _TOKENIZERS.get(key)
        if tokenizer is None:
            _LOGGER.debug("Loading the %s of %s", kind.__name__, key[1])
            tokenizer = _TOKENIZERS[key] = kind(key[1])
        return tokenizer


class CosyVoice2TextFrontend(PronouncingFrontend):
    """Normalise, split and tokenise text for CosyVoice2 (shareable between threads)."""

    TOKENIZER: type[Qwen2TextTokenizer] = Qwen2TextTokenizer  # which special tokens it adds

    def __init__(self, tokenizer_dir: Path) -> None:
        self.tokenizer = get_tokenizer(tokenizer_dir, self.TOKENIZER)

    def _token_len(self, text: str) -> int:
        return len(self.tokenizer.encode(text))

    def warm_up(self) -> None:
        """Load the wetext grammars and run one sentence through the whole frontend."""
        wetext_backend.warm_up()
        self.segments("Hello, 21.5°C. 你好，7:30。")

    def segments(self, text: str, *, split: bool = True) -> list[Segment]:
        """Segments to synthesise; ``[]`` when nothing speakable is left.

        ``split=False``: ``text`` is one sentence already split off by the caller, normalised
        as one segment.
        """
        text = checked_text(text, "text")
        pieces = normalize(self.pronunciations.apply(text), split=split, token_len=self._token_len)
        out = [Segment(piece, self.tokenizer.encode(piece)) for piece in pieces]
        _LOGGER.debug("frontend: %d chars -> %d segments", len(text), len(out))
        return out

    def piece_text(self, piece: str, *, chinese: bool | None) -> str:
        """A piece of a sentence still arriving, with its pronunciations, normalised alone on
        the sentence's path (``chinese``; None: its own); a piece ends where a word does."""
        normalized, _ = normalize_text(self.pronunciations.apply(piece), chinese=chinese)
        return normalized

    def prompt_text_ids(self, text: str) -> list[int]:
        """Transcript of a zero-shot prompt, normalised without splitting."""
        norm = normalize(checked_text(text, "prompt text"), split=False)
        return self.tokenizer.encode(norm[0]) if norm else []

    def instruct_ids(self, instruct_text: str) -> list[int]:
        """An instruct2 instruction as typed, ending in ``<|endofprompt|>``.

        A trailing ``<|endofprompt|>`` (or v1's ``<endofprompt>``) typed by the user is not
        doubled.
        """
        text = rules.sanitize(checked_text(instruct_text, "instruct text"))
        text = _USER_END_OF_PROMPT.sub("", text).strip()
        if not rules.is_speakable(text):
            raise TextInputError("instruct text is empty or has nothing to say")
        return self.tokenizer.encode(text + END_OF_PROMPT)
