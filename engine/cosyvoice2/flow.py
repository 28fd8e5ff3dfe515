"""CausalMaskedDiffWithXvec: CosyVoice2 speech tokens (25 Hz) → 80-bin mel (50 Hz).

Pipeline for one utterance (batch 1): the speaker x-vector → 80-d ``spks``; prompt + new tokens
→ embedding → :class:`~engine.cosyvoice2.encoder.UpsampleConformerEncoder` (two frames a token)
→ ``encoder_proj`` = ``mu``; then Euler steps of the flow ODE on a cosine time grid from a
*fixed* noise (the official ``randn`` of seed 0, the same frames for every call), the estimator
evaluated on a classifier-free-guidance batch of two rows (conditional, and with mu/spks/cond
zeroed) combined as (1+w)·v_cond − w·v_uncond.

Two ways to run it:

* :meth:`CausalFlow.inference` — the official call: every token so far, in full (non-streaming)
  or chunk (streaming) attention; unless ``finalize``, the last ``pre_lookahead_len`` tokens
  only serve as look-ahead. Streaming calls over a growing prefix recompute everything.
* :class:`FlowStream` — incremental streaming: each chunk runs the encoder and every ODE step
  on its own frames only, with the state the causal design needs (encoder and estimator caches,
  one estimator state per step). Its mel equals the streaming calls' within float rounding.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from engine.core.solver import (
    EXACT_SOLVER,
    FieldInputs,
    GuidedCFM,
    StepCallback,
    VectorField,
    evaluation_count,
)
from engine.core.speaker import project_speaker
from engine.core.types import ModelLoadError
from engine.core.weights import state_dict_problems
from engine.cosyvoice2.encoder import EncoderState, UpsampleConformerEncoder
from engine.cosyvoice2.flow_args import NOISE_FRAMES, NOISE_SEED, CausalFlowArgs
from engine.cosyvoice2.flow_estimator import CausalConditionalDecoder, EstimatorState

_LOGGER = logging.getLogger(__name__)


class CausalCFM(GuidedCFM):
    """The flow's solver with classifier-free guidance and its fixed noise (key ``decoder``).

    ``estimator``: a chunk-causal vector field called as ``estimator(x, mu, t, spks, cond, *,
    streaming, state, time_biases)``, with ``new_state(cache_dtype)`` and ``time_biases(t)``
    (v2's U-Net, CosyVoice3's DiT); ``channels``: the mel bins of the noise.
    """

    def __init__(self, estimator: nn.Module, *, channels: int, t_scheduler: str) -> None:
        super().__init__()
        self.channels = channels
        self.t_scheduler = t_scheduler
        self.estimator = estimator
        self._noise: Tensor | None = None

    def noise(self, start: int, end: int) -> Tensor:
        """Frames start … end−1 of the fixed noise, (1, 80, end − start)."""
        if end > NOISE_FRAMES:
            raise ValueError(
                f"{end} mel frames exceed the flow's fixed noise ({NOISE_FRAMES} frames, "
                f"{NOISE_FRAMES // 50} s): split the text into shorter sentences"
            )
        if self._noise is None:
            generator = torch.Generator().manual_seed(NOISE_SEED)
            self._noise = torch.randn(1, self.channels, NOISE_FRAMES, generator=generator)
        return self._noise[:, :, start:end]

    def vector_field(
        self,
        evaluations: int,
        *,
        streaming: bool = False,
        states: list[EstimatorState] | None = None,
        **options: Any,
    ) -> VectorField:
        """``states``: one estimator state per evaluation of a solve, carried across the chunks
        of a stream (evaluation k of a chunk attends to evaluation k of the earlier ones)."""
        if states is not None and len(states) != evaluations:
            raise ValueError(f"{len(states)} estimator states for {evaluations} evaluations")

        def field(step: int, x: Tensor, at: FieldInputs) -> Tensor:
            return self.estimator(
                x,
                at.mu,
                at.t,
                at.spks,
                at.cond,
                streaming=streaming,
                state=None if states is None else states[step],
                time_biases=at.time_biases,
            )

        return field


class FlowSizes(Protocol):
    """The numbers of a chunk-causal flow that its inference and stream read."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def output_size(self) -> int: ...
    @property
    def token_mel_ratio(self) -> int: ...
    @property
    def pre_lookahead_len(self) -> int: ...
    @property
    def inference_cfg_rate(self) -> float: ...


class EncoderMemory(Protocol):
    """What a flow's encoder keeps of the tokens before a stream's next chunk."""

    @property
    def kv_bytes(self) -> int: ...
    def copy(self) -> EncoderMemory: ...


class ChunkCausalFlow(nn.Module):
    """What every chunk-causal flow does around its token encoder (v2's Conformer, v3's
    look-ahead convolution): the speaker projection, the official one-call ``inference`` and
    the incremental :class:`FlowStream`. A flow has ``input_embedding``,
    ``spk_embed_affine_layer`` and a :class:`CausalCFM` ``decoder`` and says how its tokens
    become ``mu`` (:meth:`encode`)."""

    args: FlowSizes
    input_embedding: nn.Embedding
    spk_embed_affine_layer: nn.Linear
    decoder: CausalCFM

    @property
    def chunk_tokens(self) -> int:
        """Tokens per attention chunk in streaming mode."""
        raise NotImplementedError

    def new_encoder_state(self) -> EncoderMemory:
        """An empty encoder memory for a stream."""
        raise NotImplementedError

    def encode(
        self,
        tokens: Tensor,
        ahead: Tensor | None,
        *,
        streaming: bool,
        state: Any = None,
    ) -> Tensor:
        """Token ids (1, n) (and their look-ahead ids, None at the end) → mu (1, 80, 2n)."""
        raise NotImplementedError

    def speaker(self, embedding: Tensor) -> Tensor:
        """Raw x-vector (1, 192) → normalised and projected ``spks`` (1, 80)."""
        return project_speaker(self.spk_embed_affine_layer, embedding)

    def embed(self, tokens: Tensor) -> Tensor:
        """Token ids (1, n) → (1, n, input_size); negative ids read row 0, as upstream."""
        ids = tokens.long()
        if ids.numel() and int(ids.max()) >= self.args.vocab_size:
            raise ValueError(
                f"speech token {int(ids.max())} is not below the flow's {self.args.vocab_size} "
                "(the LM's stop tokens are not speech)"
            )
        return self.input_embedding(ids.clamp(min=0))

    def check_prompt(self, prompt_tokens: Tensor, prompt_feat: Tensor) -> None:
        """Refuse a prompt whose tokens are not (1, N) or whose mel is not their frames."""
        if prompt_tokens.dim() != 2 or prompt_tokens.shape[0] != 1:
            raise ValueError(f"prompt tokens must be (1, N), got {tuple(prompt_tokens.shape)}")
        want = self.args.token_mel_ratio * prompt_tokens.shape[1]
        if tuple(prompt_feat.shape) != (1, want, self.args.output_size):
            raise ValueError(
                f"prompt mel must be (1, {want}, {self.args.output_size}) for "
                f"{prompt_tokens.shape[1]} prompt tokens, got {tuple(prompt_feat.shape)}"
            )

    @torch.inference_mode()
    def inference(
        self,
        tokens: Tensor,
        prompt_tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        streaming: bool,
        finalize: bool,
        n_timesteps: int = 10,
        cfg_rate: float | None = None,
        solver: str = EXACT_SOLVER,
        step_callback: StepCallback | None = None,
    ) -> Tensor:
        """Mel (1, 80, frames) of ``tokens`` (1, N2) after the prompt, in one call.

        prompt_tokens (1, N1) and prompt_feat (1, 2·N1, 80) may be empty; embedding is the raw
        (1, 192) x-vector. Unless ``finalize``, the last ``pre_lookahead_len`` tokens are only
        look-ahead: the mel covers N2 − pre_lookahead_len tokens.
        """
        self.check_prompt(prompt_tokens, prompt_feat)
        ids = torch.cat([prompt_tokens.to(tokens), tokens], dim=1)
        ahead = None
        if not finalize:
            lookahead = self.args.pre_lookahead_len
            if tokens.shape[1] <= lookahead:
                raise ValueError(f"a streaming call needs more than {lookahead} tokens")
            ids, ahead = ids[:, :-lookahead], ids[:, -lookahead:]
        mu = self.encode(ids, ahead, streaming=streaming)
        prompt_frames = prompt_feat.shape[1]
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.to(mu).transpose(1, 2)
        mel = self.decoder.solve(
            self.decoder.noise(0, mu.shape[2]).to(mu),
            mu,
            self.speaker(embedding),
            cond,
            n_timesteps=n_timesteps,
            cfg_rate=self.args.inference_cfg_rate if cfg_rate is None else cfg_rate,
            solver=solver,
            streaming=streaming,
            step_callback=step_callback,
        )
        return mel[:, :, prompt_frames:]

    def stream(
        self,
        prompt_tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        n_timesteps: int = 10,
        cfg_rate: float | None = None,
        solver: str = EXACT_SOLVER,
        cache_dtype: torch.dtype | None = None,
    ) -> FlowStream:
        """An incremental stream for one utterance in the voice of this prompt.

        ``cache_dtype``: the type the estimator's keys and values are kept in (None: float32,
        exact; float16 halves the stream's largest memory for a small deviation).
        """
        return FlowStream(
            self,
            prompt_tokens,
            prompt_feat,
            embedding,
            n_timesteps=n_timesteps,
            cfg_rate=self.args.inference_cfg_rate if cfg_rate is None else cfg_rate,
            solver=solver,
            cache_dtype=cache_dtype,
        )


class CausalFlow(ChunkCausalFlow):
    """CausalMaskedDiffWithXvec with the official ``flow.pt`` key names."""

    args: CausalFlowArgs

    def __init__(self, args: CausalFlowArgs) -> None:
        super().__init__()
        self.args = args
        self.input_embedding = nn.Embedding(args.vocab_size, args.input_size)
        self.spk_embed_affine_layer = nn.Linear(args.spk_embed_dim, args.output_size)
        self.encoder = UpsampleConformerEncoder(args.encoder)
        self.encoder_proj = nn.Linear(args.encoder.output_size, args.output_size)
        self.decoder = CausalCFM(
            CausalConditionalDecoder(args.estimator),
            channels=args.output_size,
            t_scheduler=args.t_scheduler,
        )

    @property
    def chunk_tokens(self) -> int:
        return self.args.encoder.static_chunk_size

    def new_encoder_state(self) -> EncoderState:
        return self.encoder.new_state()

    def encode(
        self,
        tokens: Tensor,
        ahead: Tensor | None,
        *,
        streaming: bool,
        state: EncoderState | None = None,
    ) -> Tensor:
        ahead_x = self.embed(ahead) if ahead is not None and ahead.shape[1] else None
        h = self.encoder(self.embed(tokens), ahead_x, streaming=streaming, state=state)
        return self.encoder_proj(h).transpose(1, 2)


class FlowStream:
    """One utterance's flow, computed chunk by chunk as its tokens arrive.

    :meth:`push` takes new tokens and returns the mel of every whole attention chunk
    (``static_chunk_size`` tokens, counted from the start of the prompt) whose look-ahead is
    known; tokens of an unfinished chunk wait for the next call. ``finalize`` computes the
    rest. Each chunk runs the encoder and every ODE step on its own frames only; its mel equals
    the official streaming call's for those frames.
    """

    def __init__(
        self,
        flow: ChunkCausalFlow,
        prompt_tokens: Tensor,
        prompt_feat: Tensor,
        embedding: Tensor,
        *,
        n_timesteps: int,
        cfg_rate: float,
        solver: str = EXACT_SOLVER,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        flow.check_prompt(prompt_tokens, prompt_feat)
        self.flow, self.n_timesteps, self.cfg_rate = flow, n_timesteps, cfg_rate
        self.solver = solver
        with torch.inference_mode():
            self.spks = flow.speaker(embedding)
        self.prompt_feat = prompt_feat.float().transpose(1, 2)  # (1, 80, prompt frames)
        self.tokens = prompt_tokens.reshape(-1).long().tolist()
        self.encoded = 0  # tokens (prompt included) whose frames are computed
        self.finished = False
        self.encoder_state = flow.new_encoder_state()
        estimator = flow.decoder.estimator
        evaluations = evaluation_count(solver, n_timesteps)
        self.step_states = [estimator.new_state(cache_dtype) for _ in range(evaluations)]

    @property
    def chunk_tokens(self) -> int:
        return self.flow.chunk_tokens

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_feat.shape[2] // self.flow.args.token_mel_ratio

    def ready_tokens(self, finalize: bool) -> int:
        """How many tokens (prompt included) a push with these tokens would have encoded."""
        if finalize:
            return len(self.tokens)
        known = len(self.tokens) - self.flow.args.pre_lookahead_len
        return max(self.encoded, known // self.chunk_tokens * self.chunk_tokens)

    @torch.inference_mode()
    def push(
        self,
        tokens: Tensor | list[int],
        *,
        finalize: bool = False,
        step_callback: StepCallback | None = None,
    ) -> Tensor:
        """Add speech tokens; mel (1, 80, frames) of the tokens that became computable.

        ``step_callback``: called after each estimator evaluation (e.g. to take the cores an LM
        beside it has just given back)."""
        if self.finished:
            raise ValueError("the stream is finalized")
        new = tokens.reshape(-1).tolist() if isinstance(tokens, Tensor) else list(tokens)
        self.tokens.extend(int(t) for t in new)
        end = self.ready_tokens(finalize)
        self.finished = finalize
        if end <= self.encoded:
            return self.prompt_feat.new_zeros(1, self.prompt_feat.shape[1], 0)
        start = self.encoded
        lookahead = self.flow.args.pre_lookahead_len
        ids = torch.tensor([self.tokens[start:end]])
        ahead = None if finalize else torch.tensor([self.tokens[end : end + lookahead]])
        mu = self.flow.encode(ids, ahead, streaming=True, state=self.encoder_state)
        ratio = self.flow.args.token_mel_ratio
        first, last = ratio * start, ratio * end
        cond = torch.zeros_like(mu)
        prompt_frames = self.prompt_feat.shape[2]
        if first < prompt_frames:
            cond[:, :, : prompt_frames - first] = self.prompt_feat[:, :, first:last].to(mu)
        mel = self.flow.decoder.solve(
            self.flow.decoder.noise(first, last).to(mu),
            mu,
            self.spks,
            cond,
            n_timesteps=self.n_timesteps,
            cfg_rate=self.cfg_rate,
            solver=self.solver,
            streaming=True,
            states=self.step_states,
            step_callback=step_callback,
        )
        self.encoded = end
        _LOGGER.debug("flow stream: frames %d-%d (%d steps)", first, last, self.n_timesteps)
        return mel[:, :, max(0, prompt_frames - first) :]

    def fork(self) -> FlowStream:
        """A stream that goes on from this one's tokens on its own.

        Everything computed so far is shared, not copied (a chunk's state is never written
        again). The use: a voice's prompt computed once — ``push([])`` computes every prompt
        chunk whose look-ahead lies inside the prompt — and each utterance a fork of it, whose
        first chunk then computes only the prompt's last chunk and its own.
        """
        if self.finished:
            raise ValueError("a finalized stream cannot be forked")
        twin = copy.copy(self)
        twin.tokens = list(self.tokens)
        twin.encoder_state = self.encoder_state.copy()
        twin.step_states = [state.copy() for state in self.step_states]
        return twin

    def frames_per_step(self) -> list[int]:
        """Frames the estimator computed in each call so far (the same for every step)."""
        return list(self.step_states[0].computed)

    @property
    def cache_bytes(self) -> int:
        """Memory the stream holds for the frames so far (keys and values, mostly)."""
        return self.encoder_state.kv_bytes + sum(s.kv_bytes for s in self.step_states)


# --- loading ---------------------------------------------------------------------------------


def check_state_dict(module: nn.Module, state: Mapping[str, Tensor], source: str) -> None:
    """Raise :class:`ModelLoadError` naming every missing, unexpected or misshapen key."""
    if problems := state_dict_problems(module, state):
        raise ModelLoadError(
            f"{source} does not fit {type(module).__name__}: " + "; ".join(problems)
        )


def assign_weights(module: nn.Module, state: Mapping[str, Tensor], source: str) -> None:
    """Check ``state`` strictly, then assign it (float32, tensors used in place)."""
    check_state_dict(module, state, source)
    floats = {k: v if v.dtype == torch.float32 else v.float() for k, v in state.items()}
    module.load_state_dict(floats, strict=True, assign=True)
    module.eval().requires_grad_(False)


def build_flow(args: CausalFlowArgs, device: torch.device | str = "meta") -> CausalFlow:
    """The flow with uninitialised (``meta``: absent) weights, to be assigned."""
    with torch.device(device):
        return CausalFlow(args)


def load_flow(
    state: Mapping[str, Tensor], args: CausalFlowArgs, source: str = "flow.pt"
) -> CausalFlow:
    """Build on ``meta``, check ``state`` strictly and assign it."""
    flow = build_flow(args)
    assign_weights(flow, state, source)
    return flow


def int8_layer_names(flow: CausalFlow) -> list[str]:
    """Dotted names (in ``flow.pt``) of the Linear layers an int8 flow swaps, as v1's: the
    encoder's Conformer layers (``linear_pos`` stays float) and every estimator Linear, where
    the time goes. q, k and v stay three layers (the chunk attention calls them apart)."""
    names = []
    for name, module in flow.named_modules():
        if not isinstance(module, nn.Linear) or name.endswith("linear_pos"):
            continue
        if name.startswith(("encoder.encoders.", "encoder.up_encoders.", "decoder.estimator.")):
            names.append(name)
    return names
