"""Fun-CosyVoice3's text frontend: CosyVoice2's, plus pronunciation tokens and the system prompt.

**Tokenizer.** The same Qwen2 BPE of ``CosyVoice-BlankEN/``; on top of CosyVoice2's special
tokens CosyVoice3 adds, in this order, ``<|endofsystem|>``, the CMU phones (``[AA]``,
``[AA0]`` … ``[ZH]``: the 39 ARPAbet phones in alphabetical order, each vowel bare and with
stress 0, 1, 2) and pinyin units (initials and toned finals, ``[a]`` … ``[ǜ]``, in code-point
order). Typed in the text, each becomes one id: ``[j][ǐ]`` or ``[M][AY1][K][AH0][L]`` tells
the model how to say a word.

**Normalisation** is CosyVoice2's, except that runs of those tokens pass through it unchanged
(each stands in as one private-use character while the text around it is normalised): the
normaliser would otherwise read ``[AY1]`` as ``[AYone]``.

**What the LM receives** (the official ``CosyVoice3`` passes a system prompt ending in
``<|endofprompt|>`` with every request, and its LM refuses text without that token):

* zero-shot: prompt text ``You are a helpful assistant.<|endofprompt|>`` + the transcript;
* cross-lingual (no transcript): that system prompt in front of each segment's text;
* instruct2: ``You are a helpful assistant. `` + the instruction + ``<|endofprompt|>`` as the
  prompt text, without prompt speech tokens.

The official frontend skips normalisation and splitting for any text holding ``<|…|>``, so
its cross-lingual text and zero-shot transcript (which carry the system prompt) reach the
model as typed; ours normalises the user's part and adds the system prompt's ids after.
"""

from __future__ import annotations

import re

from engine.cosyvoice2.frontend import (
    END_OF_PROMPT,
    CosyVoice2TextFrontend,
    Qwen2TextTokenizer,
)
from engine.cosyvoice2.frontend import (
    SPECIAL_TOKENS as COSYVOICE2_SPECIAL_TOKENS,
)
from engine.text import rules
from engine.text.errors import TextInputError
from engine.text.frontend import Segment, checked_text
from engine.text.normalize import normalize, normalize_text
from engine.text.pronunciations import CMU_PHONE_TOKENS, PINYIN_TOKENS

END_OF_SYSTEM = "<|endofsystem|>"
SYSTEM_PROMPT = "You are a helpful assistant."

PRONUNCIATION_TOKENS = CMU_PHONE_TOKENS + PINYIN_TOKENS
SPECIAL_TOKENS: tuple[str, ...] = (
    COSYVOICE2_SPECIAL_TOKENS + (END_OF_SYSTEM,) + PRONUNCIATION_TOKENS
)

# A run of pronunciation tokens; longest alternatives first so "[AA0]" is not read as "[AA]".
_PRONUNCIATION_RUN = re.compile(
    "(?:"
    + "|".join(re.escape(t) for t in sorted(PRONUNCIATION_TOKENS, key=len, reverse=True))
    + ")+"
)
# Stand-ins for those runs while the text is normalised: private-use characters, which the
# normaliser keeps as they are (typed ones are dropped first: they have no sound).
_STAND_IN_BASE = 0xE000
_STAND_IN_COUNT = 0x1900  # U+E000 … U+F8FF
_STAND_IN = re.compile(f"[{chr(_STAND_IN_BASE)}-{chr(_STAND_IN_BASE + _STAND_IN_COUNT - 1)}]")


class CosyVoice3Tokenizer(Qwen2TextTokenizer):
    """The model folder's Qwen2 BPE with CosyVoice3's special tokens."""

    SPECIAL_TOKENS = SPECIAL_TOKENS


def _with_stand_ins(text: str) -> tuple[str, list[str]]:
    """``text`` with each pronunciation run replaced by a stand-in, and the runs in order."""
    runs: list[str] = []

    def stand_in(match: re.Match[str]) -> str:
        runs.append(match.group(0))
        return chr(_STAND_IN_BASE + len(runs) - 1)

    return _PRONUNCIATION_RUN.sub(stand_in, _STAND_IN.sub("", text)), runs


def _restored(text: str, runs: list[str]) -> str:
    return _STAND_IN.sub(lambda m: runs[ord(m.group(0)) - _STAND_IN_BASE], text)


class CosyVoice3TextFrontend(CosyVoice2TextFrontend):
    """Normalise, split and tokenise text for CosyVoice3, and assemble the LM's prompt text."""

    TOKENIZER = CosyVoice3Tokenizer
    PHONE_TOKENS = True

    def _normalized(
        self, text: str, *, split: bool, chinese: bool | None = None, whole: bool = True
    ) -> list[str]:
        """The normalised pieces of ``text`` with its pronunciation runs kept as typed
        (``whole=False``: one piece of a growing sentence on its path, ``chinese``)."""
        masked, runs = _with_stand_ins(text)
        if len(runs) > _STAND_IN_COUNT:
            runs = []  # more runs than stand-ins: nothing is protected (never in practice)
            masked = text
        if whole:
            pieces = normalize(masked, split=split, token_len=self._token_len)
        else:
            piece, _ = normalize_text(masked, chinese=chinese)
            pieces = [piece] if piece else []
        if not pieces and runs and not _STAND_IN.sub("", masked).strip():
            pieces = [masked.strip()]  # only pronunciation tokens: still something to say
        return [_restored(piece, runs) for piece in pieces]

    def segments(self, text: str, *, split: bool = True) -> list[Segment]:
        """Segments to synthesise (their ids without the system prompt); ``[]`` when nothing
        speakable is left."""
        text = self.pronunciations.apply(checked_text(text, "text"))
        return [
            Segment(piece, self.tokenizer.encode(piece))
            for piece in self._normalized(text, split=split)
        ]

    def piece_text(self, piece: str, *, chinese: bool | None) -> str:
        """A piece of a growing sentence (CosyVoice2's), its pronunciation runs kept."""
        text = self.pronunciations.apply(piece)
        return "".join(self._normalized(text, split=False, chinese=chinese, whole=False))

    def system_prompt_ids(self) -> list[int]:
        """``You are a helpful assistant.<|endofprompt|>``: what every request starts with."""
        return self.tokenizer.encode(SYSTEM_PROMPT + END_OF_PROMPT)

    def prompt_text_ids(self, text: str) -> list[int]:
        """Zero-shot prompt text: the system prompt, then the normalised transcript."""
        pieces = self._normalized(checked_text(text, "prompt text"), split=False)
        return self.system_prompt_ids() + (self.tokenizer.encode(pieces[0]) if pieces else [])

    def cross_lingual_text_ids(self, segment: Segment) -> list[int]:
        """A segment's text ids when there is no transcript: the system prompt goes first."""
        return self.system_prompt_ids() + list(segment.token_ids)

    def instruct_ids(self, instruct_text: str) -> list[int]:
        """An instruction as the prompt text: ``You are a helpful assistant. `` + the
        instruction (as typed) + ``<|endofprompt|>``; a system prompt the user typed already,
        or a trailing ``<|endofprompt|>``, is not doubled."""
        text = checked_text(instruct_text, "instruct text").strip()
        instruction = text.removeprefix(SYSTEM_PROMPT).replace(END_OF_PROMPT, "")
        if not rules.is_speakable(instruction):
            raise TextInputError("instruct text is empty or has nothing to say")
        if not text.startswith(SYSTEM_PROMPT):
            text = f"{SYSTEM_PROMPT} {text}"
        return super().instruct_ids(text)
