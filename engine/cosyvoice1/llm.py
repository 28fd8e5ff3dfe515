"""TransformerLM (``llm.pt``): text encoder + autoregressive speech-token LM.

Attribute names equal the official state-dict keys. Decoding uses the preallocated KV cache of
:class:`engine.core.transformer.RelPosEncoder`; :meth:`TransformerLM.generate` yields tokens one by
one so a streaming consumer can take them as they come. No threads, no asyncio inside.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.lm_step import SpeechTokenLM, StepOut, TokenIds, token_ids
from engine.core.transformer import KVCache, RelPosEncoder, weight_key
from engine.cosyvoice1.hparams import LLMArgs


class TransformerLM(SpeechTokenLM):
    """The CosyVoice v1 speech-token LM."""

    def __init__(self, args: LLMArgs) -> None:
        super().__init__()
        self.args = args
        d = args.llm_input_size
        self.speech_token_size = args.speech_token_size
        self.eos = args.speech_token_size  # the decoder's extra class; no embedding row
        self.stop_tokens = frozenset((self.eos,))
        self.text_embedding = nn.Embedding(args.text_token_size, args.text_encoder_input_size)
        self.text_encoder = RelPosEncoder(args.text_encoder)
        self.text_encoder_affine_layer = nn.Linear(args.text_encoder.output_size, d)
        self.llm_embedding = nn.Embedding(2, d)  # row 0 = SOS, row 1 = TASK_ID
        self.llm = RelPosEncoder(args.llm)
        self.llm_decoder = nn.Linear(args.llm_output_size, args.speech_token_size + 1)
        self.speech_embedding = nn.Embedding(args.speech_token_size, d)
        self.spk_embed_affine_layer = nn.Linear(args.spk_embed_dim, d)
        # The LM's input row for each speech token decoded so far (4 KB each): a decode step's
        # input layer (a float32 1024 x 1024 product) depends on its token alone. Kept with
        # the identity of the weights it was computed from; a reload starts it afresh.
        self._input_rows: tuple[tuple, dict[int, Tensor]] | None = None

    @property
    def _device(self) -> torch.device:
        return self.llm_embedding.weight.device

    # --- input assembly --------------------------------------------------------------------

    def encode_text(self, ids: Tensor) -> Tensor:
        """(1, N) ids → (1, N, D): embedding → causal text encoder → affine."""
        x = self.text_embedding(ids)
        x = self.text_encoder(x, torch.tensor([ids.shape[1]], device=ids.device))
        return self.text_encoder_affine_layer(x)

    def speaker_input(self, embedding: Tensor | None) -> Tensor:
        """(1, 1, D) projected L2-normalised x-vector, or (1, 0, D) when there is none."""
        d = self.llm_embedding.weight.shape[1]
        w = self.spk_embed_affine_layer.weight
        if embedding is None or embedding.numel() == 0:
            return w.new_zeros(1, 0, d)
        e = F.normalize(
            embedding.reshape(1, -1).to(dtype=w.dtype, device=w.device), dim=1, eps=1e-12
        )
        return self.spk_embed_affine_layer(e).unsqueeze(1)

    def build_input(
        self,
        text_ids: TokenIds,
        prompt_text_ids: TokenIds | None = None,
        prompt_speech_ids: TokenIds | None = None,
        embedding: Tensor | None = None,
    ) -> Tensor:
        """(1, L0, D) = [SOS | spk? | encoded(prompt_text ++ text) | TASK | prompt speech]."""
        dev = self._device
        text = torch.cat([token_ids(prompt_text_ids, dev), token_ids(text_ids, dev)], dim=1)
        emb = self.llm_embedding.weight
        parts = [emb[0].view(1, 1, -1), self.speaker_input(embedding)]
        if text.shape[1] > 0:
            parts.append(self.encode_text(text))
        parts.append(emb[1].view(1, 1, -1))
        parts.append(self.speech_embedding(token_ids(prompt_speech_ids, dev)))
        return torch.cat(parts, dim=1)

    # --- decoding --------------------------------------------------------------------------

    def new_cache(self, max_len: int, batch: int = 1) -> KVCache:
        return self.llm.new_cache(batch, max_len)

    def prefill(self, lm_input: Tensor, cache: KVCache, lengths: Tensor | None = None) -> StepOut:
        """Run the assembled input (B, L0, D) through the LM; outputs of its last position."""
        hidden = self.llm.forward_cached(lm_input, cache, lengths)[:, -1]
        return StepOut(hidden, self.llm_decoder(hidden))

    def decode_step(self, tokens: Tensor | int, cache: KVCache) -> StepOut:
        """Feed the previous token(s) (B,) (or one int) and return the next step's outputs."""
        if isinstance(tokens, int) and cache.key_mask is None and not torch.is_grad_enabled():
            hidden = self.llm.decode_input_row(self._input_row(tokens), cache)[:, -1]
            return StepOut(hidden, self.llm_decoder(hidden))
        if isinstance(tokens, int):
            tokens = torch.tensor([tokens], device=self._device)
        x = self.speech_embedding(tokens.view(-1, 1))  # (B, 1, D)
        hidden = self.llm.forward_cached(x, cache)[:, -1]
        return StepOut(hidden, self.llm_decoder(hidden))

    def _input_row(self, token: int) -> Tensor:
        """The input layer's output (1, 1, D) for ``token``, computed once per token."""
        key = (
            weight_key(self.speech_embedding.weight),
            *(weight_key(p) for p in self.llm.embed.parameters()),
        )
        held = self._input_rows
        if held is None or held[0] != key:
            held = self._input_rows = (key, {})
        row = held[1].get(token)
        if row is None:
            ids = torch.tensor([[token]], device=self._device)
            row = held[1][token] = self.llm.input_row(self.speech_embedding(ids))
        return row

    @staticmethod
    def length_limits(n_tts_text: int) -> tuple[int, int]:
        """(min_len, max_len) = (2, 20) × tts-text tokens (prompt text excluded)."""
        return int(2 * n_tts_text), int(20 * n_tts_text)
