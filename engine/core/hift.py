"""HiFT vocoder (``hift.pt``): mel (80 bins) → waveform, for CosyVoice v1 and v2.

Neural source-filter + iSTFT generator: an F0 predictor and a harmonic sine source feed a HiFiGAN-
style upsampler whose output is an 18-channel (magnitude, phase) spectrum for a tiny iSTFT
(n_fft 16, hop 4). The config decides the rest: v1 runs at 22.05 kHz with 256 samples a frame
(upsampling 8·8), v2 at 24 kHz with 480 (8·5·3). The sine source follows the rate as upstream
does: at 22.05 kHz each sample's phase is the running sum of its own increments; at other rates
the phase is summed at the frame rate and interpolated back to the samples.

CosyVoice3's causal vocoder (``engine.cosyvoice3.hift``) builds on this one: its convolutions
pad on the left only (:class:`CausalCLConv1d`, ``ResBlock(causal=True)``), its phase is held per
frame (:attr:`HiFTGenerator.phase_upsampling`) and a stream carries the phase sum across calls
(:class:`PhaseCarry`).

Convolutions are plain: weight norm is folded at load time by
:func:`engine.core.weight_norm.normalize_hift_state_dict`, and attribute names mirror the folded
keys so ``load_state_dict(..., strict=True)`` works directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.core.hift_int8 import Int8Conv
from engine.core.hparams import HiFTArgs
from engine.core.snake import Snake

_PER_SAMPLE_PHASE_RATE = 22050
# float32 constants exactly as the reference computes them (python doubles rounded to float32).
_TWO_PI_F32 = torch.tensor(2 * math.pi, dtype=torch.float32)
_PI_F32 = torch.tensor(math.pi, dtype=torch.float32)


# 4096 last-stage frames = 64 mel frames ≈ 0.74 s of audio: 2 MB per 128-channel activation.
# Larger tiles are no faster on streamed chunks and raise the peak memory.
DEFAULT_TILE_FRAMES = 4096
# Samples per float64 running-sum tile of the harmonic source (≈ 3 s; 9 harmonics: 4.7 MB a
# tile): a streamed chunk is one tile, longer passes stay at that size.
_PHASE_TILE = 65536


def _cumulative_phase(incr: Tensor) -> Tensor:
    """Fractional part of the running sum of ``incr`` (1, H, L) along time, float32.

    Accumulated in float64 and rounded per sample, which is what torch's CPU float32 cumsum does
    (the reference). Run in time tiles, each seeded with the previous tile's last float64 sum, so
    the result is the same to the bit while the float64 copies stay small.
    """
    out = torch.empty_like(incr, dtype=torch.float32)
    carry = None
    for lo in range(0, incr.shape[-1], _PHASE_TILE):
        sums = incr[..., lo : lo + _PHASE_TILE].to(torch.float64, copy=True)  # summed in place
        if carry is not None:
            sums[..., :1] += carry  # carry + x: the sum the one-pass cumsum reaches here
        sums.cumsum_(-1)
        out[..., lo : lo + _PHASE_TILE] = sums
        carry = sums[..., -1:].clone()  # not a view: the tile's buffer can go
    return out.remainder_(1)


@dataclass
class PhaseCarry:
    """A stream's running sum of per-frame phase increments (cycles), carried across calls.

    The frame-rate source sums the increments from the utterance's first frame; a source made
    chunk by chunk seeds each chunk's sum with the previous chunk's last float64 sum, which is
    what one float32 cumsum over the whole (accumulated in float64 on the CPU) reaches there.
    """

    cycles: Tensor | None = None  # (1, H, 1) float64, the sum up to the last frame made

    def advance(self, per_frame: Tensor) -> Tensor:
        """The running sums (float32) of ``per_frame`` (1, H, T), continuing the carried one."""
        sums = per_frame.to(torch.float64, copy=True)
        if self.cycles is not None:
            sums[..., :1] += self.cycles
        sums.cumsum_(-1)
        self.cycles = sums[..., -1:].clone()
        return sums.float()


@dataclass(frozen=True)
class HiftNoise:
    """Injected random draws for one call (parity tests).

    phase_uniform: (1, H, 1) values in [0, 1): the harmonics' initial phases (22.05 kHz: mapped
        to [-π, π); other rates: in cycles, added to the first sample's increment).
    sine_noise: (1, H, L) standard-normal draws, L = samples per frame · T.
    """

    phase_uniform: Tensor
    sine_noise: Tensor


class _ChannelsLast:
    """Mixin: run a 1-D conv as a 2-D conv on (1, C, 1, L) channels-last tensors.

    oneDNN's NHWC kernels are much faster than the NCW path for these shapes (measured ~1.8x on
    the dilated k11 convs at 128 channels). The weight itself is stored in the layout those
    kernels read, so their 4-D weight is a free view rather than a second copy of the weights
    (≈ 70 MB for CosyVoice's HiFT).
    """

    weight: Tensor
    padding: str | tuple[int, ...]

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.materialize_derived()  # load_state_dict (copy) keeps the layout made here

    def materialize_derived(self) -> None:
        """Re-lay the weight out channels-last (after an assigning load, which replaced it)."""
        w = self.weight
        if not w.is_meta:
            relaid = self.weight4d().detach()
            if relaid.data_ptr() != w.data_ptr():
                self.weight = nn.Parameter(relaid.squeeze(2), requires_grad=w.requires_grad)

    def weight4d(self) -> Tensor:
        # A view when the weight is stored channels-last (always, unless a caller swapped it
        # after load: then a correct copy per call).
        return self.weight.unsqueeze(2).contiguous(memory_format=torch.channels_last)

    def time_padding(self) -> int:
        """The padding along time (these convs are always built with a number, not 'same')."""
        return cast(int, self.padding[0])


class CLConv1d(_ChannelsLast, nn.Conv1d):
    """Conv1d whose forward takes and returns (1, C, 1, L) channels-last tensors."""

    def forward(self, x: Tensor) -> Tensor:
        return F.conv2d(
            x,
            self.weight4d(),
            self.bias,
            stride=(1, self.stride[0]),
            padding=(0, self.time_padding()),
            dilation=(1, self.dilation[0]),
        )


class CausalCLConv1d(CLConv1d):
    """A CLConv1d padded on the left only: output t reads inputs up to t (stride 1) or the
    strided window ending ``stride − 1`` past it (``left`` = stride − 1, as upstream's causal
    downsampling). ``left`` defaults to the kernel's reach, (k − 1) · dilation."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        *,
        stride: int = 1,
        dilation: int = 1,
        left: int | None = None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride=stride, dilation=dilation, padding=0
        )
        self.left = (kernel_size - 1) * dilation if left is None else left

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.pad(x, (self.left, 0)))  # keeps the channels-last layout


class CLConvTranspose1d(_ChannelsLast, nn.ConvTranspose1d):
    """ConvTranspose1d on (1, C, 1, L) channels-last tensors."""

    def forward(self, x: Tensor) -> Tensor:  # type: ignore[override]
        return F.conv_transpose2d(
            x,
            self.weight4d(),
            self.bias,
            stride=(1, self.stride[0]),
            padding=(0, self.time_padding()),
        )


def _to_cl(x: Tensor) -> Tensor:
    """(1, C, L) → (1, C, 1, L) channels-last."""
    return x.unsqueeze(2).contiguous(memory_format=torch.channels_last)


class ResBlock(nn.Module):
    """Three (Snake → dilated conv → Snake → conv) residual units sharing one kernel size.

    ``causal``: every conv pads on the left only (CosyVoice3), so an output reads no later input.
    """

    def __init__(
        self, channels: int, kernel: int, dilations: tuple[int, ...], *, causal: bool = False
    ) -> None:
        super().__init__()
        if causal:
            self.convs1 = nn.ModuleList(
                CausalCLConv1d(channels, channels, kernel, dilation=d) for d in dilations
            )
            self.convs2 = nn.ModuleList(
                CausalCLConv1d(channels, channels, kernel) for _ in dilations
            )
        else:
            self.convs1 = nn.ModuleList(
                CLConv1d(channels, channels, kernel, dilation=d, padding=(kernel * d - d) // 2)
                for d in dilations
            )
            self.convs2 = nn.ModuleList(
                CLConv1d(channels, channels, kernel, padding=(kernel - 1) // 2) for _ in dilations
            )
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)
        # Frames one output depends on, on each side (causal: on the left, twice as many).
        self.reach = sum((kernel - 1) // 2 * (d + 1) for d in dilations) * (2 if causal else 1)

    def forward(self, x: Tensor) -> Tensor:
        for c1, c2, a1, a2 in zip(
            self.convs1, self.convs2, self.activations1, self.activations2, strict=True
        ):
            # The conv output is fresh, so accumulate into it; x itself may be shared.
            x = _conv_of_snake(c2, a2, _conv_of_snake(c1, a1, x)).add_(x)
        return x


def _conv_of_snake(conv: nn.Module, snake: nn.Module, x: Tensor) -> Tensor:
    """conv(snake(x)); an int8 convolution takes the Snake into its activation's quantisation
    (:meth:`engine.core.hift_int8.Int8Conv.after_snake`)."""
    if isinstance(conv, Int8Conv):
        return conv.after_snake(cast(Snake, snake), x)
    return conv(snake(x))


class F0Predictor(nn.Module):
    """Five k3 convs with ELU, then a per-frame linear map; |·| gives F0 in Hz (no RNN)."""

    def __init__(self, in_channels: int, cond_channels: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(5):
            layers += [
                nn.Conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1),
                nn.ELU(),
            ]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: Tensor) -> Tensor:
        h = self.condnet(mel).transpose(1, 2)
        return self.classifier(h).squeeze(-1).abs()


class SourceModule(nn.Module):
    """Holds the harmonic merge layer (``m_source.l_linear``); the sine maths lives in HiFT."""

    def __init__(self, harmonics: int) -> None:
        super().__init__()
        self.l_linear = nn.Linear(harmonics, 1)


class HiFTGenerator(nn.Module):
    """CosyVoice HiFT vocoder for inference on CPU (float32, batch 1)."""

    window: Tensor  # the STFT window, a non-persistent buffer
    # How the per-frame phase returns to the samples at rates other than 22.05 kHz: linearly
    # (CosyVoice2) or held over the frame (CosyVoice3's causal source).
    phase_upsampling = "linear"

    def __init__(self, args: HiFTArgs) -> None:
        super().__init__()
        self.args = args
        # Upstream picks the sine generator by the sample rate: per-sample phase at v1's rate.
        self.per_sample_phase = args.sampling_rate == _PER_SAMPLE_PHASE_RATE
        self.n_harm = args.nb_harmonics + 1
        self.n_fft = args.istft_n_fft
        self.hop = args.istft_hop_len
        self.upp = math.prod(args.upsample_rates) * self.hop  # samples per mel frame
        self.n_kernels = len(args.resblock_kernel_sizes)
        # Longest stretch of stage output computed at once; bounds the activations' memory.
        self.tile_frames = DEFAULT_TILE_FRAMES
        n_bins = self.n_fft // 2 + 1
        ch = args.base_channels

        self.m_source = SourceModule(self.n_harm)
        self.f0_predictor = F0Predictor(args.f0_in_channels, args.f0_cond_channels)
        self.conv_pre = CLConv1d(args.in_channels, ch, 7, padding=3)
        self.ups = nn.ModuleList()
        for i, (u, k) in enumerate(
            zip(args.upsample_rates, args.upsample_kernel_sizes, strict=True)
        ):
            self.ups.append(
                CLConvTranspose1d(ch >> i, ch >> (i + 1), k, stride=u, padding=(k - u) // 2)
            )
        # The source spectrum enters every stage at that stage's frame rate: stage i is
        # downsampled by the product of the upsample rates of the later stages.
        self.source_downs = nn.ModuleList()
        self.source_resblocks = nn.ModuleList()
        n_up = len(args.upsample_rates)
        for i, (k, d) in enumerate(
            zip(args.source_resblock_kernel_sizes, args.source_resblock_dilation_sizes, strict=True)
        ):
            rate = math.prod(args.upsample_rates[i + 1 :])
            out_ch = ch >> (i + 1)
            if rate == 1:
                self.source_downs.append(CLConv1d(2 * n_bins, out_ch, 1))
            else:
                self.source_downs.append(
                    CLConv1d(2 * n_bins, out_ch, 2 * rate, stride=rate, padding=rate // 2)
                )
            self.source_resblocks.append(ResBlock(out_ch, k, tuple(d)))
        if len(self.source_downs) != n_up:
            raise ValueError("need one source resblock per upsample stage")
        self.resblocks = nn.ModuleList(
            ResBlock(ch >> (i + 1), k, tuple(d))
            for i in range(n_up)
            for k, d in zip(args.resblock_kernel_sizes, args.resblock_dilation_sizes, strict=True)
        )
        self.conv_post = CLConv1d(ch >> n_up, 2 * n_bins, 7, padding=3)
        window = torch.empty(self.n_fft)
        # On the meta device (fast loading) the window is rebuilt by materialize_derived().
        self.register_buffer("window", window if window.is_meta else self._hann(), persistent=False)
        # The filter's convolutions (everything between the source spectrum and the iSTFT) run
        # in this dtype; bfloat16 is an opt-in approximation (use_bfloat16).
        self.filter_dtype = torch.float32
        # Whether the residual blocks' convolutions run int8 (use_int8).
        self.quantized = False
        self.eval()

    def _filter_modules(self) -> list[nn.Module]:
        return [
            self.conv_pre,
            self.ups,
            self.source_downs,
            self.source_resblocks,
            self.resblocks,
            self.conv_post,
        ]

    def use_bfloat16(self) -> None:
        """Run the filter's convolutions in bfloat16 (an approximation; irreversible).

        On a CPU with AVX-512 BF16 they run about twice as fast and their weights take half the
        memory; the F0 predictor, the harmonic source, the STFT and the iSTFT stay float32.
        Measured on the full-size model with random weights: waveform relative L2 ≈ 0.008.
        """
        for module in self._filter_modules():
            module.to(torch.bfloat16)  # keeps each weight's channels-last strides
        self.filter_dtype = torch.bfloat16

    def use_int8(self) -> None:
        """Run the residual blocks' convolutions on int8 kernels (an approximation; irreversible).

        Where the CPU has no native bfloat16 (AVX2), about 1.4 times as fast as float32; the
        rest of the vocoder stays float32 (engine.core.hift_int8).
        """
        for block in [*self.source_resblocks, *self.resblocks]:
            for convs in (block.convs1, block.convs2):
                for i, conv in enumerate(convs):
                    if isinstance(conv, CLConv1d):  # on meta: placeholders the load fills
                        convs[i] = Int8Conv(conv)
        self.quantized = True

    def _hann(self) -> Tensor:
        # Periodic Hann, computed in float64 and rounded like scipy's window cast to float32.
        return torch.hann_window(self.n_fft, periodic=True, dtype=torch.float64).float()

    def materialize_derived(self) -> None:
        """Rebuild the STFT window after the weights were assigned to a meta-built model."""
        if self.window.is_meta:
            self.window = self._hann()

    # --- source ------------------------------------------------------------------------------

    def predict_f0(self, mel: Tensor) -> Tensor:
        """(1, 80, T) mel → (1, T) F0 in Hz."""
        return self.f0_predictor(mel)

    def make_source(
        self,
        f0: Tensor,
        *,
        noise: HiftNoise | None = None,
        generator: torch.Generator | None = None,
        phase: PhaseCarry | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(1, T) F0 → (source (1, 1, L), uv (1, 1, L)), L = samples per frame · T.

        Follows the reference float32 recipe to the bit where it matters: per-harmonic increments
        f0·k/sr in float32, then the phase (:meth:`_sample_rate_sines` or
        :meth:`_frame_rate_sines`), the noise and the harmonic merge. ``phase``: the frame-rate
        phase continues from (and advances) a stream's carried sum.
        """
        a = self.args
        f_up = f0.repeat_interleave(self.upp, dim=-1).unsqueeze(1)  # (1, 1, L)
        k = torch.arange(1, self.n_harm + 1, dtype=f0.dtype).view(1, -1, 1)
        # Multiply then divide, as the reference. The (1, H, L) buffers are reused in place from
        # here on (same operations, same values): an 8-second pass used to hold ≈ 60 MB of them.
        incr = torch.mul(f_up, k).div_(a.sampling_rate)
        u, sine_noise = self._source_draws(tuple(incr.shape), noise, generator)
        if self.per_sample_phase:
            sine = self._sample_rate_sines(incr, u)
        else:
            sine = self._frame_rate_sines(incr, u, phase)
        del incr
        sine = sine.mul_(a.nsf_alpha)
        uv = (f_up > a.nsf_voiced_threshold).to(torch.float32)
        # Left-to-right ((1-uv)·α)/3 as in the reference; α/3 first can differ by an ulp.
        noise_amp = uv * a.nsf_sigma + (1 - uv) * a.nsf_alpha / 3
        sine = sine.mul_(uv).add_(noise_amp * sine_noise)  # sine_noise may be the caller's
        merged = torch.tanh(self.m_source.l_linear(sine.transpose(1, 2)))  # (1, L, 1)
        return merged.transpose(1, 2), uv

    def _source_draws(
        self,
        shape: tuple[int, ...],
        noise: HiftNoise | None,
        generator: torch.Generator | None,
    ) -> tuple[Tensor, Tensor]:
        """The initial-phase uniforms (1, H, 1) and the sine noise of ``shape`` (1, H, L)."""
        if noise is None:
            u = torch.rand((1, self.n_harm, 1), generator=generator)
            return u, torch.randn(shape, generator=generator)
        u = noise.phase_uniform.to(torch.float32)
        sine_noise = noise.sine_noise.to(torch.float32)
        if u.shape != (1, self.n_harm, 1) or tuple(sine_noise.shape) != shape:
            raise ValueError(
                f"HiftNoise shapes {tuple(u.shape)}, {tuple(sine_noise.shape)} do not fit "
                f"{(1, self.n_harm, 1)}, {shape}"
            )
        return u, sine_noise

    @staticmethod
    def _sample_rate_sines(incr: Tensor, u: Tensor) -> Tensor:
        """sin(2π · running sum of the increments + initial phase), summed per sample.

        The sum is accumulated in float64 and rounded per sample (what torch's CPU float32
        cumsum does), the modulo taken after it, then sin in float32. ``incr`` is consumed.
        """
        theta = _cumulative_phase(incr)
        phase = -_PI_F32 + u * (_PI_F32 - -_PI_F32)
        phase[:, 0] = 0.0  # the fundamental starts at phase 0
        return theta.mul_(_TWO_PI_F32).add_(phase).sin_()

    def _frame_rate_sines(self, incr: Tensor, u: Tensor, carry: PhaseCarry | None) -> Tensor:
        """The phase summed at the frame rate and interpolated back to the samples.

        The increments (mod 1, the first sample's shifted by the initial phase in cycles) are
        linearly resampled to one per frame, summed, scaled to radians, and linearly resampled
        back (:attr:`phase_upsampling`), as upstream's generator for rates other than 22.05 kHz.
        ``incr`` is consumed.
        """
        rad = incr.remainder_(1)
        start = u[:, :, 0].clone()
        start[:, 0] = 0.0  # the fundamental starts at phase 0
        rad[:, :, 0] += start
        per_frame = F.interpolate(rad, scale_factor=1 / self.upp, mode="linear")  # (1, H, T)
        cycles = torch.cumsum(per_frame, dim=-1) if carry is None else carry.advance(per_frame)
        phase = cycles * 2 * math.pi
        return F.interpolate(
            phase * self.upp, scale_factor=float(self.upp), mode=self.phase_upsampling
        ).sin_()

    # --- spectral helpers --------------------------------------------------------------------

    def stft(self, s: Tensor) -> tuple[Tensor, Tensor]:
        """(1, 1, L) → real, imag (1, n_fft/2+1, L/hop + 1); centred, reflect-padded."""
        spec = torch.stft(
            s.squeeze(1),
            self.n_fft,
            self.hop,
            self.n_fft,
            window=self.window,
            center=True,
            pad_mode="reflect",
            return_complex=True,
        )
        return spec.real, spec.imag

    def istft(self, spec: Tensor) -> Tensor:
        """conv_post output (1, 18, F) → clamped waveform (1, hop·(F−1))."""
        n_bins = self.n_fft // 2 + 1
        mag = torch.exp(spec[:, :n_bins]).clamp(max=1e2)
        # sin() of the raw phase channel is what the trained model expects; not a no-op.
        phase = torch.sin(spec[:, n_bins:])
        wave = torch.istft(
            torch.complex(mag * torch.cos(phase), mag * torch.sin(phase)),
            self.n_fft,
            self.hop,
            self.n_fft,
            window=self.window,
            center=True,
        )
        return wave.clamp(-self.args.audio_limit, self.args.audio_limit)

    # --- filter ------------------------------------------------------------------------------

    def decode_spec(self, mel: Tensor, source: Tensor) -> Tensor:
        """Mel (1, 80, T) + source (1, 1, upp·T) → conv_post output (1, 18, upp·T'/hop + 1), T'
        the frames conv_pre keeps (T, or T less a causal conv_pre's look-ahead)."""
        real, imag = self.stft(source)
        x = self.conv_pre(_to_cl(mel.to(self.filter_dtype)))
        # A causal conv_pre keeps fewer frames than it is given (its look-ahead): the source
        # spectrum is cut to the frames the stages read (no-op for a centred conv_pre).
        frames = x.shape[-1] * self.upp // self.hop + 1
        s_stft = _to_cl(
            torch.cat([real[..., :frames], imag[..., :frames]], dim=1).to(self.filter_dtype)
        )
        for i in range(len(self.ups)):
            x = self._stage_in_tiles(i, x, s_stft)
        return x.squeeze(2).float()

    def _stage_in_tiles(self, i: int, x: Tensor, s_stft: Tensor) -> Tensor:
        """Stage ``i`` over the whole input, run in time tiles of at most ``tile_frames`` outputs.

        Why: a whole 8-second chunk at the last stage's rate is ≈ 26 MB per 128-channel
        activation, with several alive at once. Each tile computes a slice of the input widened
        by the stage's reach (``_halo_in``) and keeps its exact middle, so the result is the
        untiled one up to float rounding while only one tile's activations are alive.
        """
        n_in = x.shape[-1]
        u = self.args.upsample_rates[i]
        last = i == len(self.ups) - 1
        shift = 1 if last else 0  # the last stage's one-frame left pad
        n_tiles = -(-(n_in * u) // self.tile_frames)
        if n_tiles <= 1:
            return self._stage(i, x, s_stft, pad_left=last)
        step = -(-n_in // n_tiles)
        halo = self._halo_in(i)
        rate = math.prod(self.args.upsample_rates[i + 1 :])  # source frames per stage output
        pieces = []
        for c in range(0, n_in, step):
            d = min(n_in, c + step)
            lo, hi = max(0, c - halo), min(n_in, d + halo)
            offset = lo * u + (shift if lo else 0)  # first stage output this slice computes
            # The source frames of those outputs; one more frame (real data, the STFT's last
            # frame at the end) makes the strided source conv give exactly one per output.
            s = s_stft[..., offset * rate : hi * u * rate + 1]
            y = self._stage(i, x[..., lo:hi], s, pad_left=last and lo == 0)
            keep_lo, keep_hi = c * u + (shift if c else 0), d * u + shift
            pieces.append(y[..., keep_lo - offset : keep_hi - offset])
        return torch.cat(pieces, dim=-1).contiguous(memory_format=torch.channels_last)

    def _halo_in(self, i: int) -> int:
        """Input frames a tile of stage ``i`` reads beyond its ends so that its middle is exact."""
        up = cast(CLConvTranspose1d, self.ups[i])
        source_block = cast(ResBlock, self.source_resblocks[i])
        # Outputs a slice edge corrupts: the transposed conv's overlap, or the strided source
        # conv's one padded output plus the source resblock's reach; then the stage's resblocks
        # and, after the last stage, conv_post and the one-frame pad.
        edge = max(up.kernel_size[0] - up.time_padding(), 1 + source_block.reach)
        reach = edge + max(cast(ResBlock, block).reach for block in self._stage_blocks(i))
        if i == len(self.ups) - 1:
            reach += self.conv_post.time_padding() + 1
        return -(-reach // up.stride[0]) + 1

    def _stage_blocks(self, i: int) -> nn.ModuleList:
        """The resblocks of stage ``i`` (one per kernel size; their outputs are averaged)."""
        return self.resblocks[i * self.n_kernels : (i + 1) * self.n_kernels]

    def _stage(self, i: int, x: Tensor, s_stft: Tensor, *, pad_left: bool) -> Tensor:
        """One upsampling stage (the last one followed by conv_post) on aligned slices."""
        x = self.ups[i](F.leaky_relu(x, self.args.lrelu_slope))
        if pad_left:
            # Reflection pad (1, 0): one extra frame on the left (a copy of frame 1) so the
            # length matches the centred STFT (64T + 1).
            x = torch.cat([x[..., 1:2], x], dim=-1).contiguous(memory_format=torch.channels_last)
        x = x + self.source_resblocks[i](self.source_downs[i](s_stft))
        blocks = self._stage_blocks(i)
        acc = blocks[0](x)
        for block in blocks[1:]:
            acc.add_(block(x))
        x = acc.div_(self.n_kernels)
        if i == len(self.ups) - 1:
            x = F.leaky_relu(x)  # default slope 0.01 here, unlike inside the stages
            x = self.conv_post(x)
        return x

    @torch.inference_mode()
    def inference(
        self,
        mel: Tensor,
        cache_source: Tensor | None = None,
        *,
        noise: HiftNoise | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Mel (1, 80, T) → (wave (1, upp·T), source (1, 1, upp·T)), upp samples a frame.

        ``cache_source`` (1, 1, S), the tail of the previous chunk's source, overwrites the first
        S source samples so the excitation continues seamlessly across streaming chunks.
        """
        if mel.dim() != 3 or mel.shape[0] != 1 or mel.shape[1] != self.args.in_channels:
            want = f"(1, {self.args.in_channels}, T)"
            raise ValueError(f"expected mel {want}, got {tuple(mel.shape)}")
        if mel.shape[-1] < 1:
            raise ValueError("HiFT needs at least one mel frame")
        mel = mel.to(torch.float32)
        f0 = self.predict_f0(mel)
        source, _ = self.make_source(f0, noise=noise, generator=generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            n = min(cache_source.shape[-1], source.shape[-1])
            source[..., :n] = cache_source[..., :n]
        spec = self.decode_spec(mel, source)
        return self.istft(spec), source
