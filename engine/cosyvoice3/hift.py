"""CosyVoice3's causal HiFT vocoder (``hift.pt``, upstream ``CausalHiFTGenerator``) and its stream.

The shared HiFT (:class:`engine.core.hift.HiFTGenerator`, 24 kHz, 480 samples a mel frame) with
every convolution made causal: it pads on the left only, so an output reads no later input, except
two that look ahead: ``conv_pre`` (kernel 5: 4 frames to the right) and the F0 predictor's first
conv (kernel 4: 3 frames). The F0 predictor runs in float64, as upstream does (its output decides
the phase of every later sample). The upsampling is nearest-neighbour repetition followed by a
causal conv (not a transposed conv), the source's phase is held over each frame instead of
interpolated, and its noise is uniform in [0, 1) and indexed by the sample's place in the
utterance (upstream draws one fixed table when the model is built).

Because everything but the two look-aheads is causal and the noise is indexed by position, the
audio of a frame does not change once 8 later frames are known (3 + 4 look-ahead, and the last
frame's samples, which the centred iSTFT still blends with the next). The official runtime
streams by running HiFT on the whole mel so far at every chunk and keeping the samples after an
offset; :class:`CausalHiftStream` gives the same samples with each frame's audio made once, from
a bounded window of earlier frames (:meth:`CausalHiFT.left_context_frames`).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.hift import (
    CausalCLConv1d,
    CLConv1d,
    F0Predictor,
    HiFTGenerator,
    HiftNoise,
    PhaseCarry,
    ResBlock,
)
from engine.core.hparams import (
    HiFTArgs,
    ModelConfigError,
    Section,
    hift_args,
    read_model_yaml,
)
from engine.core.weight_norm import normalize_hift_state_dict
from engine.cosyvoice2.hift import assign_hift

F0_LOOKAHEAD = 3  # mel frames the F0 predictor's first conv (kernel 4) reads to the right
# Stretch of new audio (in mel frames) a stream computes in one filter call: bounds the
# activations' memory (the last stage's 64 channels at 120 frames a mel frame: ≈ 5 MB each).
STREAM_PIECE_FRAMES = 128


@dataclass(frozen=True)
class CausalHiFTArgs(HiFTArgs):
    """HiFTArgs plus the look-ahead of the causal ``conv_pre`` (its kernel is that + 1)."""

    conv_pre_look_right: int = 4


def causal_hift_args_from_doc(
    doc: dict[str, Any], source: str = "cosyvoice3.yaml"
) -> CausalHiFTArgs:
    """The hift section of a parsed v3 yaml."""
    if "hift" not in doc:
        raise ModelConfigError(f"{source}: missing top-level section 'hift'")
    sec = Section(doc["hift"], "hift", source)
    base = hift_args(sec)
    look = sec.int("conv_pre_look_right", 4)
    if look < 1:
        raise ModelConfigError(f"{source}: 'hift.conv_pre_look_right' must be at least 1")
    return CausalHiFTArgs(
        **{f.name: getattr(base, f.name) for f in fields(base)}, conv_pre_look_right=look
    )


def load_causal_hift_args(yaml_path: Path) -> CausalHiFTArgs:
    """Read the HiFT hyperparameters of an official v3 yaml."""
    return causal_hift_args_from_doc(read_model_yaml(yaml_path), Path(yaml_path).name)


class CausalF0Predictor(F0Predictor):
    """Upstream's ``CausalConvRNNF0Predictor``: a kernel-4 conv reading 3 frames ahead, four
    kernel-3 convs reading 2 frames back (ELU after each), a per-frame linear map, |·| in Hz.
    The shared predictor's layout (same keys), its convolutions swapped.

    Float64 throughout, as upstream runs it; the output is rounded to float32.
    """

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__(in_channels, cond_channels)
        f64 = torch.float64
        convs = [nn.Conv1d(in_channels, cond_channels, F0_LOOKAHEAD + 1, dtype=f64)]
        convs += [nn.Conv1d(cond_channels, cond_channels, 3, dtype=f64) for _ in range(4)]
        self.condnet = nn.Sequential(*(m for conv in convs for m in (conv, nn.ELU())))
        self.classifier = nn.Linear(cond_channels, 1, dtype=f64)
        # Earlier frames one output reads: two for each kernel-3 conv.
        self.reach = 2 * (len(convs) - 1)

    def materialize_derived(self) -> None:
        """Back to float64 after an assigning load (which brings the file's float32)."""
        self.double()

    def forward(self, mel: Tensor, *, finalize: bool = True) -> Tensor:
        """(1, 80, T) → (1, T) F0 (``finalize``: the look-ahead of the last frames is zeros) or
        (1, T − 3) (the last 3 frames are only look-ahead)."""
        x = mel.to(torch.float64)
        if finalize:
            x = F.pad(x, (0, F0_LOOKAHEAD))
        for i, module in enumerate(self.condnet):
            if i > 0 and isinstance(module, nn.Conv1d):
                x = F.pad(x, (module.kernel_size[0] - 1, 0))
            x = module(x)
        return self.classifier(x.transpose(1, 2)).squeeze(-1).abs().float()


class CausalUpsample(CausalCLConv1d):
    """Upstream's ``CausalConv1dUpsample``: repeat each frame ``factor`` times, then a causal
    conv (a Conv1d weight, (out, in, k), not a transposed conv's)."""

    def __init__(self, in_channels: int, out_channels: int, kernel: int, factor: int) -> None:
        super().__init__(in_channels, out_channels, kernel)
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.interpolate(x, scale_factor=(1.0, self.factor), mode="nearest"))


def _causal_resblock(block: ResBlock) -> ResBlock:
    """The causal twin of a built resblock: same channels, kernel and dilations."""
    conv = block.convs1[0]
    assert isinstance(conv, CLConv1d)
    dilations = tuple(int(c.dilation[0]) for c in block.convs1 if isinstance(c, CLConv1d))
    return ResBlock(conv.in_channels, conv.kernel_size[0], dilations, causal=True)


class CausalHiFT(HiFTGenerator):
    """CosyVoice3's vocoder for inference on CPU (float32, batch 1; the F0 predictor float64).

    The shared HiFT, its convolutions swapped for their causal twins (same keys and shapes as
    upstream's ``CausalHiFTGenerator``, weight norm folded). Not tiled in time: a stream cuts
    long inputs into pieces (:class:`CausalHiftStream`).
    """

    phase_upsampling = "nearest"
    f0_predictor: CausalF0Predictor
    conv_post: CausalCLConv1d

    def __init__(self, args: CausalHiFTArgs) -> None:
        super().__init__(args)
        self.look_right = args.conv_pre_look_right
        self.f0_predictor = CausalF0Predictor(args.f0_in_channels, args.f0_cond_channels)
        # Unpadded: the caller appends the look-ahead (real frames, or zeros on the last chunk).
        self.conv_pre = CLConv1d(
            args.in_channels, args.base_channels, self.look_right + 1, padding=0
        )
        self.ups = nn.ModuleList(
            CausalUpsample(up.in_channels, up.out_channels, k, u)
            for up, u, k in zip(
                self.ups, args.upsample_rates, args.upsample_kernel_sizes, strict=True
            )
            if isinstance(up, nn.ConvTranspose1d)
        )
        downs = []
        for i, down in enumerate(self.source_downs):
            assert isinstance(down, CLConv1d)
            rate = math.prod(args.upsample_rates[i + 1 :])
            if rate == 1:
                downs.append(down)  # kernel 1: causal as it is
            else:
                downs.append(
                    CausalCLConv1d(
                        down.in_channels, down.out_channels, 2 * rate, stride=rate, left=rate - 1
                    )
                )
        self.source_downs = nn.ModuleList(downs)
        self.source_resblocks = nn.ModuleList(
            _causal_resblock(b) for b in self.source_resblocks if isinstance(b, ResBlock)
        )
        self.resblocks = nn.ModuleList(
            _causal_resblock(b) for b in self.resblocks if isinstance(b, ResBlock)
        )
        post = self.conv_post
        self.conv_post = CausalCLConv1d(post.in_channels, post.out_channels, post.kernel_size[0])
        self.tile_frames = sys.maxsize  # not tiled: a stream bounds the length
        self.eval()

    # --- the official calls on a whole mel ---------------------------------------------------

    def predict_f0(self, mel: Tensor, finalize: bool = True) -> Tensor:
        """(1, 80, T) mel → (1, T) F0 in Hz, or (1, T − 3) when not ``finalize``."""
        return self.f0_predictor(mel, finalize=finalize)

    def decode(self, mel: Tensor, source: Tensor, *, finalize: bool) -> Tensor:
        """Mel (1, 80, T) + its source (1, 1, 480·T) → waveform (1, 480·T) (``finalize``: the
        last frames' look-ahead is zeros) or (1, 480·(T − 5)) (the last 4 frames are only
        look-ahead; the frame before them is left out, its end still depends on later frames)."""
        x = F.pad(mel, (0, self.look_right)) if finalize else mel
        wave = self.istft(self.decode_spec(x, source))
        return wave if finalize else wave[:, : -self.upp]

    @torch.inference_mode()
    def inference(
        self,
        mel: Tensor,
        cache_source: Tensor | None = None,
        *,
        noise: HiftNoise | None = None,
        generator: torch.Generator | None = None,
        finalize: bool = True,
    ) -> tuple[Tensor, Tensor]:
        """Upstream's ``CausalHiFTGenerator.inference`` on a mel (1, 80, T) from the utterance's
        start → (wave, source). ``finalize``: wave (1, 480·T); otherwise the audio that later
        frames cannot change, (1, 480·(T − 8)), and the source of the first T − 3 frames.

        ``noise``: the source's draws (phase (1, 9, 1); uniform table (1, 9, 480·frames)),
        else uniform from ``generator``. There is no cached source: stream with
        :class:`CausalHiftStream`.
        """
        if cache_source is not None and cache_source.numel() > 0:
            raise ValueError("the causal vocoder takes no cached source; use CausalHiftStream")
        self.check_mel(mel, finalize=finalize)
        f0 = self.predict_f0(mel, finalize=finalize)
        if noise is None:
            noise = UniformSourceNoise(generator).draws(self.n_harm, f0.shape[-1] * self.upp)
        source, _ = self.make_source(f0, noise=noise)
        return self.decode(mel[..., : f0.shape[-1]], source, finalize=finalize), source

    def check_mel(self, mel: Tensor, *, finalize: bool) -> None:
        """ValueError unless ``mel`` is (1, 80, T) with enough frames for the call."""
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.args.in_channels:
            want = f"(1, {self.args.in_channels}, T)"
            raise ValueError(f"expected mel {want}, got {tuple(mel.shape)}")
        least = 1 if finalize else self.settle_frames
        if mel.shape[-1] < least:
            raise ValueError(f"HiFT needs at least {least} mel frames here")

    # --- what a stream needs -----------------------------------------------------------------

    @property
    def settle_frames(self) -> int:
        """Later frames whose mel must be known before a frame's audio is final (8)."""
        return F0_LOOKAHEAD + self.look_right + 1

    def left_context_frames(self) -> int:
        """Mel frames before a stretch of audio that the filter reads to make it: a window that
        starts that much earlier gives the stretch as a pass over the whole utterance does.

        Walked back from the waveform: the iSTFT's overlap, conv_post and the one-frame pad;
        per stage its widest resblock (the source branch's included) and the source
        downsampling's extra frame, then the upsampling conv, in the stage's input frames.
        """
        reach = self.n_fft // self.hop + self.conv_post.left + 1
        n_up = len(self.ups)
        for i in reversed(range(n_up)):
            blocks = [*self.resblocks[i * self.n_kernels : (i + 1) * self.n_kernels]]
            blocks.append(self.source_resblocks[i])
            reach += max(int(b.reach) for b in blocks if isinstance(b, ResBlock)) + 1
            up = self.ups[i]
            assert isinstance(up, CausalUpsample)
            reach = -(-(reach + up.left) // up.factor)
        return reach + 1


def build_causal_hift(args: CausalHiFTArgs, device: torch.device | str = "meta") -> CausalHiFT:
    """The vocoder with uninitialised (``meta``: absent) weights, to be assigned."""
    with torch.device(device):
        return CausalHiFT(args)


def load_causal_hift(
    state: Mapping[str, Tensor], args: CausalHiFTArgs, source: str = "hift.pt"
) -> CausalHiFT:
    """Fold weight norm (either layout), build on ``meta``, check strictly and assign.

    The F0 predictor's weights are folded again in float64: upstream runs it in float64 with
    its weight norm applied there, and a float32 fold moves F0 by up to ≈ 3e-5 Hz.
    """
    hift = assign_hift(build_causal_hift(args), state, source)
    prefix = "f0_predictor."
    f0_state = {k[len(prefix) :]: v.double() for k, v in state.items() if k.startswith(prefix)}
    hift.f0_predictor.load_state_dict(normalize_hift_state_dict(f0_state), strict=True)
    return hift


# --- the source's noise ------------------------------------------------------------------------


class SourceNoise(Protocol):
    """The causal source's draws: an initial phase per harmonic, once per utterance, and a
    uniform table read in order, one row of harmonics per sample."""

    def initial_phase(self, harmonics: int) -> Tensor:
        """(1, H, 1) in [0, 1), the fundamental's 0 (at 480 samples a frame it has no effect:
        the phase is read at each frame's middle)."""
        ...

    def table(self, harmonics: int, n_samples: int) -> Tensor:
        """The next ``n_samples`` rows of the table, (1, H, n) in [0, 1)."""
        ...


@dataclass
class UniformSourceNoise:
    """Draws from one ``torch.Generator`` (a seed makes them reproducible; None: torch's)."""

    generator: torch.Generator | None = None

    def initial_phase(self, harmonics: int) -> Tensor:
        u = torch.rand((1, harmonics, 1), generator=self.generator)
        u[:, 0] = 0.0
        return u

    def table(self, harmonics: int, n_samples: int) -> Tensor:
        # Time-major, as upstream's table (1, L, H).
        return torch.rand((1, n_samples, harmonics), generator=self.generator).transpose(1, 2)

    def draws(self, harmonics: int, n_samples: int) -> HiftNoise:
        """One whole utterance's draws."""
        phase = self.initial_phase(harmonics)
        return HiftNoise(phase_uniform=phase, sine_noise=self.table(harmonics, n_samples))


# --- streaming ---------------------------------------------------------------------------------


class CausalHiftStream:
    """One utterance's mel → audio, chunk by chunk, each frame's audio made once.

    :meth:`push` returns the audio of every frame whose 8 later frames are known (all that is
    left on ``finalize``): the samples the official runtime's streamed chunks hold, which are
    those of one call on the whole mel. Kept between pushes: the mel of the last frames (the
    filter's left context, the F0 predictor's 8 frames back, the look-ahead), the source of the
    context frames, the source's running phase and how far its noise was read.
    """

    def __init__(self, hift: CausalHiFT, noise: SourceNoise) -> None:
        self.hift, self.noise = hift, noise
        self.context = hift.left_context_frames()
        self.initial_phase = noise.initial_phase(hift.n_harm)
        self.phase = PhaseCarry()
        self.mel = torch.zeros(1, hift.args.in_channels, 0)
        self.mel_start = 0  # utterance frame of self.mel's first
        self.source = torch.zeros(1, 1, 0)
        self.source_start = 0  # utterance frame of self.source's first sample's frame
        self.sourced = 0  # frames whose source is made
        self.emitted = 0  # frames whose audio was returned
        self.finished = False

    @property
    def frames(self) -> int:
        """Mel frames received."""
        return self.mel_start + self.mel.shape[-1]

    @torch.inference_mode()
    def push(self, mel: Tensor, *, finalize: bool = False) -> Tensor:
        """Audio (1, 480·n) for the next mel frames (1, 80, f); ``finalize`` on the last."""
        if self.finished:
            raise RuntimeError("the stream was finalized")
        if mel.dim() != 3 or mel.shape[:2] != self.mel.shape[:2]:
            raise ValueError(f"expected mel (1, {self.mel.shape[1]}, f), got {tuple(mel.shape)}")
        self.mel = torch.cat([self.mel, mel.to(torch.float32)], dim=2)
        total = self.frames
        self._make_source(total if finalize else total - F0_LOOKAHEAD, finalize=finalize)
        done = total if finalize else total - self.hift.settle_frames
        pieces = []
        while self.emitted < done:
            end = min(done, self.emitted + STREAM_PIECE_FRAMES)
            if finalize and done - end < self.hift.settle_frames - F0_LOOKAHEAD:
                end = done  # too close to the end for a piece with real look-ahead
            pieces.append(self._vocode(end, last=finalize and end == total))
            self.emitted = end
        self.finished = finalize
        self._forget()
        return torch.cat(pieces, dim=1) if pieces else torch.zeros(1, 0)

    def _make_source(self, end: int, *, finalize: bool) -> None:
        """F0 and source of frames [sourced, end) (the F0 reads 8 frames back, 3 ahead)."""
        if end <= self.sourced:
            return
        lo = max(self.mel_start, self.sourced - self.hift.f0_predictor.reach)
        hi = end if finalize else end + F0_LOOKAHEAD
        window = self.mel[..., lo - self.mel_start : hi - self.mel_start]
        f0 = self.hift.predict_f0(window, finalize=finalize)[:, self.sourced - lo :]
        n = f0.shape[-1] * self.hift.upp
        noise = HiftNoise(
            phase_uniform=self.initial_phase, sine_noise=self.noise.table(self.hift.n_harm, n)
        )
        source, _ = self.hift.make_source(f0, noise=noise, phase=self.phase)
        self.source = torch.cat([self.source, source], dim=2)
        self.sourced = end

    def _vocode(self, end: int, *, last: bool) -> Tensor:
        """Audio of frames [emitted, end), from a window starting ``context`` frames earlier.
        ``last``: end is the utterance's end (zeros for the look-ahead); otherwise the window
        reaches 5 frames past ``end`` (4 of look-ahead, 1 whose audio the iSTFT blends)."""
        upp = self.hift.upp
        lo = max(self.mel_start, self.source_start, self.emitted - self.context)
        hi = end if last else end + self.hift.settle_frames - F0_LOOKAHEAD
        mel = self.mel[..., lo - self.mel_start : hi - self.mel_start]
        source = self.source[..., (lo - self.source_start) * upp : (hi - self.source_start) * upp]
        wave = self.hift.decode(mel, source, finalize=last)
        return wave[:, (self.emitted - lo) * upp : (end - lo) * upp]

    def _forget(self) -> None:
        """Drop the mel and source no later call reads."""
        keep_source = max(self.source_start, self.emitted - self.context)
        f0_from = self.sourced - self.hift.f0_predictor.reach
        keep_mel = max(self.mel_start, min(keep_source, f0_from))
        upp = self.hift.upp
        self.source = self.source[..., (keep_source - self.source_start) * upp :]
        self.source_start = keep_source
        self.mel = self.mel[..., keep_mel - self.mel_start :]
        self.mel_start = keep_mel
