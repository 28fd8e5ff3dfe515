"""CausalMaskedDiffWithDiT: CosyVoice3 speech tokens (25 Hz) → 80-bin mel (50 Hz).

For one utterance (batch 1): the speaker x-vector → 80-d ``spks``; prompt + new tokens →
embedding (80 wide) → the pre-look-ahead layer (each token sees the next three) → each token
repeated ``token_mel_ratio`` times = ``mu``; then CosyVoice2's causal CFM (the same fixed noise,
cosine Euler steps with classifier-free guidance, :mod:`engine.core.solver`) with the
:class:`~engine.cosyvoice3.dit.DiT` as the vector field.

The official call (:meth:`DiTFlow.inference`) and the incremental stream (``stream``: each
chunk's frames computed once, keys and values kept per ODE step) are CosyVoice2's
:class:`~engine.cosyvoice2.flow.ChunkCausalFlow`; this module says how tokens become ``mu``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from engine.core.onednn_layers import onednn_linears_faster, use_onednn_linears_in_groups
from engine.core.types import ModelLoadError
from engine.cosyvoice2.encoder import PreLookahead
from engine.cosyvoice2.flow import CausalCFM, ChunkCausalFlow, assign_weights
from engine.cosyvoice2.flow_cache import ConvTail
from engine.cosyvoice3.dit import DiT, rotary_frequencies
from engine.cosyvoice3.flow_args import DiTFlowArgs

# The official DiT keeps its rotary frequencies in flow.pt; the engine computes them.
ROTARY_KEY = "decoder.estimator.rotary_embed.inv_freq"


@dataclass
class LookaheadState:
    """What a stream keeps of its tokens: the look-ahead layer's causal convolution tail."""

    tail: ConvTail = field(default_factory=ConvTail)

    @property
    def kv_bytes(self) -> int:
        frames = self.tail.frames
        return 0 if frames is None else frames.numel() * frames.element_size()

    def copy(self) -> LookaheadState:
        return LookaheadState(self.tail.copy())


class DiTFlow(ChunkCausalFlow):
    """CausalMaskedDiffWithDiT with the official ``flow.pt`` key names."""

    args: DiTFlowArgs

    def __init__(self, args: DiTFlowArgs) -> None:
        super().__init__()
        self.args = args
        self.input_embedding = nn.Embedding(args.vocab_size, args.input_size)
        self.spk_embed_affine_layer = nn.Linear(args.spk_embed_dim, args.output_size)
        self.pre_lookahead_layer = PreLookahead(
            args.input_size, args.pre_lookahead_len, hidden=args.pre_lookahead_channels
        )
        self.decoder = CausalCFM(
            DiT(args.estimator), channels=args.output_size, t_scheduler=args.t_scheduler
        )

    @property
    def chunk_tokens(self) -> int:
        return self.args.chunk_tokens

    def new_encoder_state(self) -> LookaheadState:
        return LookaheadState()

    def encode(
        self,
        tokens: Tensor,
        ahead: Tensor | None,
        *,
        streaming: bool,
        state: LookaheadState | None = None,
    ) -> Tensor:
        # Nothing before the DiT attends, so streaming changes nothing here.
        del streaming
        ahead_x = self.embed(ahead) if ahead is not None and ahead.shape[1] else None
        tail = ConvTail() if state is None else state.tail
        h = self.pre_lookahead_layer(self.embed(tokens), ahead_x, tail)
        return h.repeat_interleave(self.args.token_mel_ratio, dim=1).transpose(1, 2)


def build_flow(args: DiTFlowArgs, device: torch.device | str = "meta") -> DiTFlow:
    """The flow with uninitialised (``meta``: absent) weights, to be assigned."""
    with torch.device(device):
        return DiTFlow(args)


def load_flow(state: Mapping[str, Tensor], args: DiTFlowArgs, source: str = "flow.pt") -> DiTFlow:
    """Build on ``meta``, check ``state`` strictly and assign it. The rotary frequencies a
    checkpoint may hold must be the ones its sizes imply."""
    weights = dict(state)
    stored = weights.pop(ROTARY_KEY, None)
    if stored is not None:
        expected = rotary_frequencies(args.estimator.dim_head)
        if stored.shape != expected.shape or not torch.allclose(stored.float(), expected):
            raise ModelLoadError(
                f"{source}: {ROTARY_KEY} is not the rotary frequencies of dim_head "
                f"{args.estimator.dim_head}"
            )
    flow = build_flow(args)
    assign_weights(flow, weights, source)
    return flow


def int8_layer_names(flow: DiTFlow) -> list[str]:
    """Dotted names (in ``flow.pt``) of the Linear layers an int8 flow swaps: every DiT Linear
    but the time MLP's, as v2's estimator. The modulation Linears run once per ODE step, not
    per frame; they are 139 M of the 331 M DiT weights at full size, so int8 saves their memory.
    q, k and v stay three layers (the rotary angles turn q and k apart)."""
    return [
        f"decoder.estimator.{name}"
        for name, module in flow.decoder.estimator.named_modules()
        if isinstance(module, nn.Linear) and not name.startswith("time_embed.")
    ]


def modulation_layer_names(flow: DiTFlow) -> list[str]:
    """Dotted names (in ``flow.pt``) of the DiT's modulation Linears: read only to compute a
    time grid's modulations (engine.cosyvoice3.dit.DiT.keep_time_biases)."""
    return [f"decoder.estimator.{name}" for name in flow.decoder.estimator.modulation_layers()]


# Each DiT block's Linears that run on every frame (official key names): the attention's q, k,
# v and output, the feed-forward's two.
_FRAME_LAYERS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "ff.ff.0.0", "ff.ff.2")


def frame_layer_groups(flow: DiTFlow) -> list[list[str]]:
    """Dotted names (in ``flow.pt``) of the Linears each DiT block runs on every frame, one list
    per block. Not the modulation Linears (once per time grid) nor the input and output
    projections (under 1 % of a pass)."""
    return [
        [f"decoder.estimator.transformer_blocks.{index}.{layer}" for layer in _FRAME_LAYERS]
        for index in range(flow.args.estimator.depth)
    ]


def use_onednn_frame_linears(
    flow: DiTFlow, reread: Callable[[Sequence[str]], None] | None = None
) -> int:
    """Where oneDNN's matmul is the faster path (:func:`onednn_linears_faster`), swap the float32
    Linears of :func:`frame_layer_groups` for oneDNN ones, a block at a time (``reread``: as
    :func:`~engine.core.onednn_layers.use_onednn_linears_in_groups`). Returns how many were
    swapped: what the engine's load does, for tests to run the kernels the engine runs."""
    if not onednn_linears_faster():
        return 0
    return use_onednn_linears_in_groups(flow, frame_layer_groups(flow), reread)
