"""CosyVoice2's speech-token LM (``llm.pt``): the Qwen2 backbone with speech input and output.

Input layout (one sequence of embeddings, each row ``llm_input_size`` wide)::

    [SOS | embed_tokens(prompt_text ++ text) | TASK_ID | speech_embedding(prompt speech tokens)]

``SOS`` and ``TASK_ID`` are rows 0 and 1 of ``llm_embedding``; text goes through the Qwen2
token embedding, speech tokens through ``speech_embedding``. Zero-shot fills every part;
instruct2 puts the instruction (ending in ``<|endofprompt|>``) where the prompt text goes and
no prompt speech; cross-lingual has neither. The LM takes no speaker embedding.

``llm_decoder`` maps the backbone's last (normed) hidden state to ``speech_token_size + 3``
classes: the speech tokens, then EOS and two more stop tokens (the last one is the "fill" token
of interleaved text input). Sampling any of the three ends the answer; only EOS is masked while
fewer than ``min_len`` tokens were drawn. Lengths count the text tokens only (prompt excluded):
``min_len = int(2 n)``, ``max_len = int(20 n)``. The draw is v1's repetition-aware nucleus
sampling (:mod:`engine.core.sampling`) with the yaml's top-p / top-k / window.

Text that arrives in pieces (an LLM's reply) goes through a
:class:`~engine.cosyvoice2.bistream.BistreamSession` on this LM: text and speech tokens
interleaved by ``mix_ratio``, speech drawn as soon as the text read so far allows, one KV cache
for the whole answer.

Loading: build on the ``meta`` device and assign a state dict with the official keys
(:func:`load_speech_lm`); missing, unexpected or misshapen keys raise :class:`ModelLoadError`
naming them. :meth:`CosyVoice2LM.int8_layer_names` lists the layers the int8 option replaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from engine.core.hparams import (
    ModelConfigError,
    SamplingArgs,
    Section,
    TaggedNode,
    read_model_yaml,
    sampling_args,
)
from engine.core.lm_step import SpeechTokenLM, StepOut, TokenIds, token_ids
from engine.core.transformer import KVCache
from engine.core.types import ModelLoadError
from engine.core.weights import state_dict_problems
from engine.cosyvoice2.qwen2 import (
    Qwen2CausalLM,
    Qwen2Config,
    Qwen2Model,
    float_sources,
    int8_layer_names,
    quantize_int8,
)

CONFIG_FILE = "cosyvoice2.yaml"
BACKBONE_DIR = "CosyVoice-BlankEN"  # config.json and tokenizer files of the Qwen2 backbone
LM_CLASS = "Qwen2LM"  # the yaml's class name for this layout
# Read by nothing at inference (the text head of the backbone): a prepared file may leave it out.
UNUSED_KEYS = ("llm.model.lm_head.weight",)


@dataclass(frozen=True)
class SpeechLMArgs:
    """The speech LM's hyperparameters: the yaml's ``llm`` section plus the backbone config."""

    llm_input_size: int
    llm_output_size: int
    speech_token_size: int
    mix_ratio: tuple[int, int]
    sampling: SamplingArgs
    backbone: Qwen2Config
    min_token_text_ratio: float = 2.0
    max_token_text_ratio: float = 20.0


def speech_lm_args(
    llm_section: object, backbone: Qwen2Config, source: str, lm_class: str = LM_CLASS
) -> SpeechLMArgs:
    """The args from a parsed yaml ``llm`` section (``!new:...<lm_class>``) and the backbone's.

    A family on this backbone with another layout names its own ``lm_class``.
    """
    if isinstance(llm_section, TaggedNode) and llm_section.target.rsplit(".", 1)[-1] != lm_class:
        raise ModelConfigError(f"{source}: 'llm' is {llm_section.target}, expected {lm_class}")
    sec = Section(llm_section, "llm", source)
    mix_ratio = sec.ints("mix_ratio", [5, 15])
    if len(mix_ratio) != 2:
        raise ModelConfigError(f"{source}: 'llm.mix_ratio' must hold two integers")
    args = SpeechLMArgs(
        llm_input_size=sec.int("llm_input_size"),
        llm_output_size=sec.int("llm_output_size"),
        speech_token_size=sec.int("speech_token_size"),
        mix_ratio=(mix_ratio[0], mix_ratio[1]),
        sampling=sampling_args(sec.sub("sampling")),
        backbone=backbone,
    )
    if not args.llm_input_size == args.llm_output_size == backbone.hidden_size:
        raise ModelConfigError(
            f"{source}: llm_input_size / llm_output_size ({args.llm_input_size} / "
            f"{args.llm_output_size}) must equal the backbone's hidden_size "
            f"({backbone.hidden_size})"
        )
    return args


def load_speech_lm_args(model_dir: Path) -> SpeechLMArgs:
    """Read ``cosyvoice2.yaml`` and ``CosyVoice-BlankEN/config.json`` of a model folder."""
    model_dir = Path(model_dir)
    doc = read_model_yaml(model_dir / CONFIG_FILE)
    if "llm" not in doc:
        raise ModelConfigError(f"{model_dir / CONFIG_FILE}: missing top-level section 'llm'")
    backbone = Qwen2Config.read(model_dir / BACKBONE_DIR)
    return speech_lm_args(doc["llm"], backbone, CONFIG_FILE)


class Qwen2Backbone(nn.Module):
    """Holds the Qwen2 model under the checkpoint's ``llm.model`` prefix."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2CausalLM(cfg)


class CosyVoice2LM(SpeechTokenLM):
    """The CosyVoice2 speech-token LM."""

    LABEL = "CosyVoice2 LM"  # for error messages
    SOS = 0  # rows of llm_embedding
    TASK_ID = 1

    def __init__(self, args: SpeechLMArgs) -> None:
        super().__init__()
        self.args = args
        d = args.llm_input_size
        n_speech = args.speech_token_size
        self.llm_embedding = nn.Embedding(2, d)
        self.llm = Qwen2Backbone(args.backbone)
        self.llm_decoder = nn.Linear(args.llm_output_size, n_speech + 3)
        self.speech_embedding = nn.Embedding(n_speech + 3, d)
        self.speech_token_size = n_speech
        self.eos = n_speech
        self.fill_token = n_speech + 2
        self.stop_tokens = frozenset(range(n_speech, n_speech + 3))

    @property
    def backbone(self) -> Qwen2Model:
        """The Qwen2 decoder stack (``llm.model.model``)."""
        return self.llm.model.model

    @property
    def _device(self) -> torch.device:
        return self.speech_embedding.weight.device

    # --- input assembly ------------------------------------------------------------------------

    def embed_text(self, ids: TokenIds | None) -> Tensor:
        """(1, N, D) Qwen2 token embeddings of text ids."""
        return self.llm.model.model.embed_tokens(token_ids(ids, self._device))

    def embed_speech(self, ids: TokenIds | None) -> Tensor:
        """(1, N, D) embeddings of speech tokens."""
        return self.speech_embedding(token_ids(ids, self._device))

    def special_input(self, row: int) -> Tensor:
        """(1, 1, D): ``SOS`` or ``TASK_ID``."""
        return self.llm_embedding.weight[row].view(1, 1, -1)

    def build_input(
        self,
        text_ids: TokenIds,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
        embedding: Tensor | None = None,
    ) -> Tensor:
        """(1, L0, D) = [SOS | text(prompt ++ text) | TASK_ID | prompt speech]."""
        if embedding is not None:
            raise ValueError(f"the {self.LABEL} takes no speaker embedding (its flow does)")
        dev = self._device
        text = torch.cat([token_ids(prompt_text_ids, dev), token_ids(text_ids, dev)], dim=1)
        return torch.cat(
            [
                self.special_input(self.SOS),
                self.embed_text(text),
                self.special_input(self.TASK_ID),
                self.embed_speech(prompt_speech_ids),
            ],
            dim=1,
        )

    # --- decoding ------------------------------------------------------------------------------

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return self.llm.model.model.new_cache(batch, max_len)

    def _step(self, x: Tensor, cache: KVCache) -> StepOut:
        hidden = self.llm.model.model.forward_cached(x, cache)[:, -1]
        return StepOut(hidden, self.llm_decoder(hidden))

    def prefill(self, lm_input: Tensor, cache: KVCache) -> StepOut:
        """Append embeddings (B, T, D) to the sequence; the outputs of its last position."""
        return self._step(lm_input, cache)

    def decode_step(self, tokens: Tensor | int, cache: KVCache) -> StepOut:
        """Feed the previous token(s) (B,) (or one int) and return the next step's outputs."""
        if isinstance(tokens, int):
            tokens = torch.tensor([tokens], device=self._device)
        return self._step(self.speech_embedding(tokens.view(-1, 1)), cache)

    def length_limits(self, n_tts_text: int) -> tuple[int, int]:
        """(min_len, max_len) in speech tokens for ``n_tts_text`` text tokens (prompt excluded)."""
        return (
            int(n_tts_text * self.args.min_token_text_ratio),
            int(n_tts_text * self.args.max_token_text_ratio),
        )

    # --- int8 ----------------------------------------------------------------------------------

    def int8_layer_names(self) -> list[str]:
        """Dotted names of the int8 layers: every backbone block's, then ``llm_decoder``.

        A name ending in ``qkv_proj`` / ``gate_up_proj`` stands for the float layers whose
        weights it stacks (:func:`int8_sources`).
        """
        return [*int8_layer_names(self.backbone, "llm.model.model."), "llm_decoder"]

    def quantize_int8(self) -> CosyVoice2LM:
        """Swap the int8 layers in, in place (embeddings, norms and the unused head stay)."""
        quantize_int8(self, self.int8_layer_names())
        return self


def int8_sources(name: str) -> list[str]:
    """The float layers (dotted names in the speech LM) an int8 layer's rows come from."""
    return float_sources(name)


# --- loading ---------------------------------------------------------------------------------


def check_speech_lm_state(
    model: CosyVoice2LM, state: Mapping[str, Tensor], source: str = "llm.pt"
) -> None:
    """Raise :class:`ModelLoadError` naming every missing, unexpected or misshapen key.

    With a tied head, ``llm.model.lm_head.weight`` may be absent (it is the embedding).
    """
    optional = set(UNUSED_KEYS) if model.args.backbone.tie_word_embeddings else set()
    if problems := state_dict_problems(model, state, optional):
        raise ModelLoadError(f"{source} does not fit the {model.LABEL}: " + "; ".join(problems))


def build_speech_lm(
    args: SpeechLMArgs,
    device: torch.device | str = "meta",
    model_class: type[CosyVoice2LM] = CosyVoice2LM,
) -> CosyVoice2LM:
    """The module (``model_class``: this LM or a later family's on the same backbone) with
    uninitialised (``meta``: absent) weights, to be assigned."""
    with torch.device(device):
        return model_class(args)


def load_speech_lm(
    state: Mapping[str, Tensor],
    args: SpeechLMArgs,
    *,
    int8: bool = False,
    source: str = "llm.pt",
    model_class: type[CosyVoice2LM] = CosyVoice2LM,
) -> CosyVoice2LM:
    """Build on ``meta``, check ``state`` strictly and assign it (tensors used in place)."""
    model = build_speech_lm(args, model_class=model_class)
    check_speech_lm_state(model, state, source)
    floats = {k: v if v.dtype == torch.float32 else v.float() for k, v in state.items()}
    head = UNUSED_KEYS[0]
    if head not in floats:  # tied: the head is the embedding (checked above)
        floats[head] = floats["llm.model.model.embed_tokens.weight"]
    model.load_state_dict(floats, strict=True, assign=True)
    model.llm.model.tie_weights()
    model.eval().requires_grad_(False)
    if int8:
        model.quantize_int8()
    return model
