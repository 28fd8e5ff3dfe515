"""Fun-CosyVoice3's speech-token LM (``llm.pt``): CosyVoice2's Qwen2 LM with another id layout.

The backbone, the input order and the decoding are CosyVoice2's
(:class:`~engine.cosyvoice2.lm.CosyVoice2LM`)::

    [SOS | embed_tokens(prompt_text ++ text) | TASK_ID | speech_embedding(prompt speech tokens)]

What differs is where the special rows live. There is no ``llm_embedding``: SOS, EOS, the task
id and the fill token are speech ids ``speech_token_size + 0 … 3``, so SOS and TASK_ID are rows
of ``speech_embedding``. The speech embedding and the head (``llm_decoder``, without a bias) are
``speech_token_size + 200`` wide, and any id from ``speech_token_size`` on ends the answer.

The official sampler masks index ``speech_token_size`` while fewer than ``min_len`` tokens were
drawn: CosyVoice2's rule, unchanged, which in this layout is SOS rather than EOS. So only SOS
is masked early, and EOS or any of the other 198 stop ids may end an answer before ``min_len``;
:attr:`CosyVoice3LM.eos` is that masked index, as the shared decoding loop reads it.

The text always holds ``<|endofprompt|>`` (the official LM asserts it): the system prompt ends
with it, and an instruction ends with it (:mod:`engine.cosyvoice3.frontend` assembles both).

Loading, the int8 layers and the KV cache are CosyVoice2's, with this class.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.core.hparams import ModelConfigError, read_model_yaml
from engine.core.lm_step import SpeechTokenLM
from engine.cosyvoice2.lm import (
    BACKBONE_DIR,
    CosyVoice2LM,
    Qwen2Backbone,
    SpeechLMArgs,
    build_speech_lm,
    load_speech_lm,
    speech_lm_args,
)
from engine.cosyvoice2.qwen2 import Qwen2Config

CONFIG_FILE = "cosyvoice3.yaml"
LM_CLASS = "CosyVoice3LM"  # the yaml's class name for this layout
# Ids past the speech tokens: SOS, EOS, TASK_ID, FILL, then unused ones; all of them stop.
EXTRA_IDS = 200


def cosyvoice3_lm_args(llm_section: object, backbone: Qwen2Config, source: str) -> SpeechLMArgs:
    """The args from a parsed ``llm`` section (``!new:...CosyVoice3LM``) and the backbone's."""
    return speech_lm_args(llm_section, backbone, source, lm_class=LM_CLASS)


def load_cosyvoice3_lm_args(model_dir: Path) -> SpeechLMArgs:
    """Read ``cosyvoice3.yaml`` and ``CosyVoice-BlankEN/config.json`` of a model folder."""
    model_dir = Path(model_dir)
    doc = read_model_yaml(model_dir / CONFIG_FILE)
    if "llm" not in doc:
        raise ModelConfigError(f"{model_dir / CONFIG_FILE}: missing top-level section 'llm'")
    return cosyvoice3_lm_args(doc["llm"], Qwen2Config.read(model_dir / BACKBONE_DIR), CONFIG_FILE)


class CosyVoice3LM(CosyVoice2LM):
    """The Fun-CosyVoice3 speech-token LM."""

    LABEL = "CosyVoice3 LM"

    def __init__(self, args: SpeechLMArgs) -> None:
        # CosyVoice2's modules minus llm_embedding, with wider tables: built here, not by
        # CosyVoice2LM.__init__ (as the official class does).
        SpeechTokenLM.__init__(self)
        self.args = args
        d = args.llm_input_size
        n_speech = args.speech_token_size
        self.llm = Qwen2Backbone(args.backbone)
        self.llm_decoder = nn.Linear(args.llm_output_size, n_speech + EXTRA_IDS, bias=False)
        self.speech_embedding = nn.Embedding(n_speech + EXTRA_IDS, d)
        self.speech_token_size = n_speech
        self.SOS = n_speech
        self.end_of_speech = n_speech + 1  # EOS: what ends text fed in pieces
        self.TASK_ID = n_speech + 2
        self.fill_token = n_speech + 3
        self.eos = n_speech  # the index masked before min_len (module docstring)
        self.stop_tokens = frozenset(range(n_speech, n_speech + EXTRA_IDS))

    def special_input(self, row: int) -> Tensor:
        """(1, 1, D): ``SOS`` or ``TASK_ID``, rows of the speech embedding."""
        return self.speech_embedding.weight[row].view(1, 1, -1)


def build_cosyvoice3_lm(args: SpeechLMArgs, device: torch.device | str = "meta") -> CosyVoice3LM:
    """The module with uninitialised (``meta``: absent) weights, to be assigned."""
    model = build_speech_lm(args, device, model_class=CosyVoice3LM)
    assert isinstance(model, CosyVoice3LM)
    return model


def load_cosyvoice3_lm(
    state: Mapping[str, Tensor],
    args: SpeechLMArgs,
    *,
    int8: bool = False,
    source: str = "llm.pt",
) -> CosyVoice3LM:
    """Build on ``meta``, check ``state`` strictly (names every missing, unexpected or
    misshapen key) and assign it; ``int8`` swaps the int8 layers in."""
    model = load_speech_lm(state, args, int8=int8, source=source, model_class=CosyVoice3LM)
    assert isinstance(model, CosyVoice3LM)
    return model
