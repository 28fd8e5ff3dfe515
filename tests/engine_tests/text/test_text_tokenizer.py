"""Whisper multilingual tokenizer: ids equal the official ones (fixtures/text_frontend.json)."""

from __future__ import annotations

import hashlib
import json
import threading
from importlib.resources import files

import pytest
from conftest import DATA

from engine.text.tokenizer import N_VOCAB, VOCAB_SHA256, get_tokenizer

FIXTURE = json.loads((DATA / "text_frontend.json").read_text("utf-8"))
EXAMPLES = FIXTURE["examples"]


def test_vocab_file_is_the_whisper_one() -> None:
    data = files("engine.assets").joinpath("multilingual.tiktoken").read_bytes()
    assert hashlib.sha256(data).hexdigest() == VOCAB_SHA256
    assert VOCAB_SHA256 == FIXTURE["tokenizer"]["vocab_file_sha256"]


def test_vocabulary_size_and_specials() -> None:
    tok = get_tokenizer()
    assert tok.n_vocab == N_VOCAB == FIXTURE["tokenizer"]["n_vocab_incl_specials"]
    for text, idx in FIXTURE["tokenizer"]["special_tokens"].items():
        assert tok.special_ids[text] == idx, text
    assert tok.special_ids["<|0.00|>"] == 50365
    assert tok.special_ids["<|30.00|>"] == 51865
    assert tok.language_id("yue") == 50358


@pytest.mark.parametrize("example", EXAMPLES, ids=[e["name"] for e in EXAMPLES])
def test_token_ids_equal_fixture(example: dict) -> None:
    tok = get_tokenizer()
    assert tok.encode(example["text"]) == example["token_ids"]
    pieces = [tok.encoding.decode_single_token_bytes(i).hex() for i in example["token_ids"]]
    assert pieces == example["token_bytes_hex"]
    for frontend, norm in example["normalized"].items():
        for seg, ids in zip(norm["split_true"], norm["split_true_token_ids"], strict=True):
            assert tok.encode(seg) == ids, frontend


@pytest.mark.parametrize(
    ("text", "ids"),
    [
        ("<|en|>Hello world.", [50259, 15947, 1002, 13]),
        ("Hello, how are you today?", [15947, 11, 577, 366, 291, 965, 30]),
        ("<endofprompt>", [27, 521, 2670, 28722, 662, 29]),
        ("<|endofprompt|>", [27, 91, 521, 2670, 28722, 662, 91, 29]),
        ("[laughter]", [58, 5330, 60]),
        ("<strong>", [27, 28063, 29]),
    ],
)
def test_spec_vectors(text: str, ids: list[int]) -> None:
    assert get_tokenizer().encode(text) == ids


def test_decode_round_trip() -> None:
    tok = get_tokenizer()
    for text in ("你好，世界！", "Emoji 😀 test", "<|zh|>你好<|en|>hello"):
        assert tok.decode(tok.encode(text)) == text


def test_loaded_once_even_from_threads() -> None:
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(get_tokenizer())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(t is seen[0] for t in seen) and seen[0] is get_tokenizer()
