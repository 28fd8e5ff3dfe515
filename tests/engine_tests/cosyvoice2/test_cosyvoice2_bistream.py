"""CosyVoice2 speech LM fed text as it arrives (BistreamSession) vs the official bistream cases."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
import torch
from conftest import TESTS

import engine.cosyvoice2.bistream as bistream_module
from engine.core.lm_step import StepOut
from engine.core.types import SynthesisCancelled
from engine.cosyvoice2.bistream import BistreamSession
from engine.cosyvoice2.lm import CosyVoice2LM, load_speech_lm, load_speech_lm_args

DATA = TESTS / "data" / "cosyvoice2"
TINY = DATA / "tiny"
CASES = (
    "zero_shot",
    "cross_lingual_early_fill",
    "instruct2",
    "prompt_multiple_of_15",
    "prompt_not_consumed",
    "short_text",
)
ATOL_LOGITS = 5.6e-5  # four times the official spread of 1.4e-5 (tests/data/cosyvoice2/README.md)
ATOL_HIDDEN = 1.2e-5  # four times 2.9e-6
EOS, MIDDLE_STOP, FILL = 6561, 6562, 6563


@pytest.fixture(scope="module")
def model() -> CosyVoice2LM:
    state = torch.load(TINY / "llm.pt", weights_only=True)
    return load_speech_lm(state, load_speech_lm_args(TINY))


@pytest.fixture(scope="module")
def fx() -> dict[str, torch.Tensor]:
    return torch.load(DATA / "bistream_cases.pt", weights_only=True)


@pytest.fixture(scope="module")
def meta() -> dict:
    return json.loads((DATA / "bistream_cases.json").read_text())


@dataclass
class Record:
    """What a session did: its LM calls and what its sampler was given."""

    rows: list[torch.Tensor] = field(default_factory=list)
    outs: list[StepOut] = field(default_factory=list)
    logp: list[torch.Tensor] = field(default_factory=list)
    histories: list[list[int]] = field(default_factory=list)
    sampled_at: list[int] = field(default_factory=list)  # LM call index of each draw

    def observe(self, rows: torch.Tensor, out: StepOut) -> None:
        self.rows.append(rows[0].clone())
        self.outs.append(StepOut(out.hidden.clone(), out.logits.clone()))


def _replaying(record: Record, decisions: Sequence[int]):
    """A sampler giving the official decisions of the sampled steps, in order."""
    it = iter(decisions)

    def sampler(logp: torch.Tensor, history: Sequence[int]) -> int:
        record.logp.append(logp.clone())
        record.histories.append(list(history))
        record.sampled_at.append(len(record.rows) - 1)
        return int(next(it))

    return sampler


def _session(model: CosyVoice2LM, fx: dict, case: str, record: Record, **kw) -> BistreamSession:
    forced = fx[f"{case}/step_forced"]
    decisions = fx[f"{case}/step_tokens"][~forced].tolist()
    return BistreamSession(
        model,
        fx[f"{case}/in_prompt_text"],
        fx[f"{case}/in_prompt_speech_token"],
        sampler=_replaying(record, decisions),
        observer=record.observe,
        **kw,
    )


def test_case_file_matches_its_index(fx: dict, meta: dict) -> None:
    assert meta["provenance"]["cosyvoice_commit"] == "ace7c47f41bbd303aa6bf1ea80e6f9fbd595cd40"
    assert set(meta["tensors"]) == set(fx)
    for key, entry in meta["tensors"].items():
        assert list(fx[key].shape) == entry["shape"], key
    assert meta["constants"] == {
        "mix_ratio": [5, 15],
        "fill": FILL,
        "eos": EOS,
        "speech_token_size": 6561,
    }


def _fragments(meta: dict, case: str) -> list[list[int]]:
    return meta[case]["fragment_ids"]


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_steps_match_official(model: CosyVoice2LM, fx: dict, meta: dict, case: str) -> None:
    """Every LM call's input rows, rotary position, hidden state and logits; the K/V cache."""
    record = Record()
    session = _session(model, fx, case, record)
    for fragment in _fragments(meta, case):
        session.feed_text(fragment)
    session.finish()
    tokens = list(session.tokens())

    assert tokens == fx[f"{case}/yielded"].tolist() == meta[case]["yielded_tokens"]
    assert session.done and session.text_taken == meta[case]["text_len"]
    rows = fx[f"{case}/step_rows"].tolist()
    assert [r.shape[0] for r in record.rows] == rows
    torch.testing.assert_close(torch.cat(record.rows), fx[f"{case}/step_inputs"], atol=0, rtol=0)
    starts = torch.tensor([0, *rows]).cumsum(0)[:-1]
    assert starts.tolist() == fx[f"{case}/positions_start"].tolist()
    hidden = torch.cat([o.hidden for o in record.outs])
    torch.testing.assert_close(hidden, fx[f"{case}/last_hidden"], atol=ATOL_HIDDEN, rtol=0)
    at = fx[f"{case}/logits_steps"].tolist()
    logits = torch.cat([record.outs[i].logits for i in at])
    torch.testing.assert_close(logits, fx[f"{case}/logits"], atol=ATOL_LOGITS, rtol=0)
    cache = session.cache
    assert cache is not None and cache.length == sum(rows)  # every row computed once
    kv = cache.kv[:, :, 0, :, : cache.length]
    torch.testing.assert_close(kv[:, 0], fx[f"{case}/final_k"], atol=ATOL_HIDDEN, rtol=0)
    torch.testing.assert_close(kv[:, 1], fx[f"{case}/final_v"], atol=ATOL_HIDDEN, rtol=0)


@pytest.mark.parity
@pytest.mark.parametrize("case", CASES)
def test_decisions_match_official(model: CosyVoice2LM, fx: dict, meta: dict, case: str) -> None:
    """Forced fills draw nothing; draws see the official history (fills included) and masks."""
    record = Record()
    session = _session(model, fx, case, record)
    session.feed_text(fx[f"{case}/in_text"])
    session.finish()
    list(session.tokens())

    forced = fx[f"{case}/step_forced"]
    steps = fx[f"{case}/step_tokens"].tolist()
    assert record.sampled_at == (~forced).nonzero().flatten().tolist()
    assert [steps[i] for i in meta[case]["forced_fill_steps"]] == [FILL] * int(forced.sum())
    final = fx[f"{case}/step_final"].tolist()
    eos_masked = fx[f"{case}/step_eos_masked"].tolist()
    for step, logp, history in zip(record.sampled_at, record.logp, record.histories, strict=True):
        assert history == steps[:step]
        assert bool(logp[EOS] == float("-inf")) == eos_masked[step] == (not final[step])
        # the stop token that means nothing mid-answer is masked with EOS (the reference raises)
        assert bool(logp[MIDDLE_STOP] == float("-inf")) == (not final[step])
        assert torch.isfinite(logp[FILL])
        reference = record.outs[step].logits[0].log_softmax(dim=0)
        keep = torch.isfinite(logp)
        torch.testing.assert_close(logp[keep], reference[keep], atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_tokens_come_as_soon_as_the_text_allows(
    model: CosyVoice2LM, fx: dict, meta: dict, case: str
) -> None:
    """Fed one token at a time, each speech token is ready after as many text tokens as the
    official loop had read when it yielded it."""
    record = Record()
    session = _session(model, fx, case, record)
    ready_after: list[int] = []
    assert list(session.ready_tokens()) == []  # nothing to say before any text
    for fed, token in enumerate(fx[f"{case}/in_text"].tolist(), start=1):
        session.feed_text([token])
        ready_after += [fed] * len(list(session.ready_tokens()))
        assert session.text_taken == fed
    session.finish()
    ready_after += [len(fx[f"{case}/in_text"])] * len(list(session.ready_tokens()))
    assert ready_after == fx[f"{case}/yield_text_pulled"].tolist()
    first = meta[case]["text_pulled_before_first_token"]
    assert ready_after[0] == first


def test_pieces_and_timing_do_not_change_the_answer(model: CosyVoice2LM, fx: dict) -> None:
    """Text fed in other pieces, early or late, from another thread: the same tokens."""
    case = "cross_lingual_early_fill"
    text = fx[f"{case}/in_text"].tolist()
    expected = fx[f"{case}/yielded"].tolist()

    record = Record()
    session = _session(model, fx, case, record)
    pieces = [text[:3], text[3:4], [], text[4:17], text[17:]]
    got: list[int] = []
    for piece in pieces:
        session.feed_text(piece)
        got += session.ready_tokens()
    session.finish()
    got += session.tokens()
    assert got == expected

    record = Record()
    session = _session(model, fx, case, record)

    def produce() -> None:
        for i in range(0, len(text), 4):
            session.feed_text(text[i : i + 4])
        session.finish()

    producer = threading.Thread(target=produce)
    producer.start()
    assert list(session.tokens()) == expected
    producer.join()


def test_cache_grows_without_recomputing(
    model: CosyVoice2LM, fx: dict, meta: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache too small for the answer is doubled in place of a re-prefill: same K/V."""
    monkeypatch.setattr(bistream_module, "_CACHE_HEADROOM", 0)
    case = "zero_shot"
    record = Record()
    session = _session(model, fx, case, record)
    for fragment in _fragments(meta, case):
        session.feed_text(fragment)
    session.finish()
    sizes: list[int] = []
    for _ in session.tokens():
        assert session.cache is not None
        sizes.append(session.cache.max_len)
    assert len(set(sizes)) > 2  # grew more than once
    cache = session.cache
    assert cache is not None and cache.length == sum(fx[f"{case}/step_rows"].tolist())
    kv = cache.kv[:, :, 0, :, : cache.length]
    torch.testing.assert_close(kv[:, 0], fx[f"{case}/final_k"], atol=ATOL_HIDDEN, rtol=0)
    hidden = torch.cat([o.hidden for o in record.outs])
    torch.testing.assert_close(hidden, fx[f"{case}/last_hidden"], atol=ATOL_HIDDEN, rtol=0)


def test_cancel_between_tokens(model: CosyVoice2LM, fx: dict) -> None:
    session = BistreamSession(model, forced_tokens=[5] * 40)
    session.feed_text(fx["short_text/in_text"].tolist() * 4)
    tokens = session.ready_tokens()
    next(tokens)
    session.cancel()
    with pytest.raises(SynthesisCancelled):
        next(tokens)


def test_cancel_wakes_a_consumer_waiting_for_text(model: CosyVoice2LM, fx: dict) -> None:
    cancel = threading.Event()
    session = BistreamSession(model, forced_tokens=[5] * 40, cancel=cancel)
    session.feed_text(fx["short_text/in_text"].tolist() * 2)  # 6 tokens: one group, then wait
    outcome: list[object] = []

    def consume() -> None:
        try:
            outcome.append(list(session.tokens()))
        except SynthesisCancelled as err:
            outcome.append(err)

    consumer = threading.Thread(target=consume)
    consumer.start()
    cancel.set()  # an external event is seen while waiting, without a notify
    consumer.join(timeout=30)
    assert not consumer.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], SynthesisCancelled)


def test_waiting_for_text_can_time_out(model: CosyVoice2LM) -> None:
    session = BistreamSession(model, forced_tokens=[5] * 40, text_timeout=0.1)
    session.feed_text([1, 2])
    with pytest.raises(TimeoutError, match="no text"):
        list(session.tokens())


def test_bad_input_is_a_clear_error(model: CosyVoice2LM) -> None:
    with pytest.raises(ValueError, match="text token id 1024"):
        BistreamSession(model).feed_text([3, 1024])
    with pytest.raises(ValueError, match="prompt speech token id -1"):
        BistreamSession(model, [1, 2], [7, -1])
    with pytest.raises(ValueError, match="prompt text token id 5000"):
        BistreamSession(model, [5000])
    session = BistreamSession(model)
    session.finish()
    with pytest.raises(RuntimeError, match="after finish"):
        session.feed_text([1])


def test_no_text_no_speech(model: CosyVoice2LM) -> None:
    calls: list[int] = []
    session = BistreamSession(
        model, [1, 2, 3], [4] * 20, observer=lambda rows, out: calls.append(1)
    )
    session.finish()
    assert list(session.tokens()) == [] and calls == []


def test_stop_tokens_after_the_text_end_the_answer(model: CosyVoice2LM) -> None:
    """After the end any stop token ends the answer; before it a drawn fill is a fill."""
    text = list(range(10, 22))  # 12 tokens: two groups, then the end
    for stop in (EOS, MIDDLE_STOP, FILL):
        session = BistreamSession(model, forced_tokens=[5, FILL, 6, 7, *[8] * 14, 9, stop, 11])
        session.feed_text(text)
        session.finish()
        # group 1: 5, drawn fill; group 2: 6, 7, 8 × 13 (a fill is forced 15 tokens after
        # the drawn one); end: 8, 9, stop
        assert list(session.tokens()) == [5, 6, 7, *[8] * 14, 9]


def test_length_cap_after_the_text(model: CosyVoice2LM) -> None:
    """The end of an answer that never draws a stop token is capped at 20 × the text."""
    session = BistreamSession(model, sampler=lambda logp, history: 5)
    session.feed_text([10, 11])
    session.finish()
    assert len(list(session.tokens())) == 40


def test_sampling_is_seeded_and_in_range(model: CosyVoice2LM, fx: dict) -> None:
    case = "instruct2"

    def run() -> list[int]:
        session = BistreamSession(
            model, fx[f"{case}/in_prompt_text"], generator=torch.Generator().manual_seed(4)
        )
        session.feed_text(fx[f"{case}/in_text"])
        session.finish()
        return list(session.tokens())

    first = run()
    assert first == run() and len(first) > 0
    assert all(0 <= t < model.speech_token_size for t in first)
    assert not torch.is_inference_mode_enabled()


def test_int8_model_runs_the_same_layout(model: CosyVoice2LM, fx: dict, meta: dict) -> None:
    case = "zero_shot"
    record = Record()
    int8 = copy.deepcopy(model).quantize_int8()
    session = _session(int8, fx, case, record)
    session.feed_text(fx[f"{case}/in_text"])
    session.finish()
    assert list(session.tokens()) == meta[case]["yielded_tokens"]
    assert [r.shape[0] for r in record.rows] == fx[f"{case}/step_rows"].tolist()
