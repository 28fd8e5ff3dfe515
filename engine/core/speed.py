"""Speaking speed: the flow's mel resampled in time before the vocoder.

The official CosyVoice models change the speed this way, without streaming only: the mel
linearly interpolated to ``frames / speed`` frames. Here output frame ``i`` reads the input at
``x = (i + 0.5) · speed − 0.5`` (at least 0), mixing frames ``⌊x⌋`` and ``⌊x⌋ + 1``, and there
are ``⌊frames / speed⌋`` of them: torch's ``interpolate(mode="linear", scale_factor=1 / speed)``
with its float32 positions. Upstream interpolates to that many frames instead, which spreads
the rounding of ``frames / speed`` over the utterance: a read position differs by less than
``speed`` frames (12 ms at 22050 Hz), at the end. A fixed step is what streaming needs: a
frame's position does not depend on how long the utterance will be.

:class:`MelStretcher` resamples chunk by chunk while streaming: it keeps the frames the next
output frame still reads across chunks, so the stretched chunks put together are the whole mel
stretched (:func:`stretch_mel`), with no edge effect at a chunk's seam.
"""

from __future__ import annotations

import torch
from torch import Tensor


def stretch_mel(mel: Tensor, speed: float) -> Tensor:
    """A whole mel (1, C, frames) resampled to ``⌊frames / speed⌋`` frames."""
    if speed == 1.0:
        return mel
    return MelStretcher(speed).push(mel, finalize=True)


class MelStretcher:
    """:func:`stretch_mel` over a mel pushed in chunks; each output frame is released as soon
    as the input frames it reads have arrived.

    ``min_first``: hold the first output until it has that many frames (or the mel ends), so a
    vocoder that carries frames of context from its first chunk to the next gets enough.
    """

    def __init__(self, speed: float, *, min_first: int = 0) -> None:
        self.speed = float(speed)
        self._per_input = 1.0 / self.speed  # output frames per input frame, as torch's factor
        # torch turns the factor back into input frames per output frame, in float32 maths.
        self._step = torch.tensor(1.0 / self._per_input, dtype=torch.float32)
        self.min_first = min_first
        self._frames: Tensor | None = None  # input frames from index _start on, still needed
        self._start = 0
        self._received = 0  # input frames so far
        self._emitted = 0  # output frames so far
        self._held: list[Tensor] = []  # output not yet released (min_first)
        self._held_frames = 0

    def push(self, mel: Tensor, *, finalize: bool = False) -> Tensor:
        """Stretched frames (1, C, n) that ``mel`` (1, C, f) makes computable; on ``finalize``
        all the rest."""
        frames = mel if self._frames is None else torch.cat([self._frames, mel], dim=2)
        self._frames = frames
        self._received += mel.shape[2]
        out = self._stretch(frames, finalize)
        return self._release(out, finalize)

    def _positions(self, first: int, end: int) -> tuple[Tensor, Tensor]:
        """Output frames ``first``..``end - 1``: their read positions and ⌊positions⌋."""
        index = torch.arange(first, end, dtype=torch.float32)
        source = (self._step * (index + 0.5) - 0.5).clamp(min=0.0)
        return source, source.to(torch.int64)

    def _stretch(self, frames: Tensor, finalize: bool) -> Tensor:
        received = self._received
        # Frames past ⌊received / speed⌋ may not exist in the whole mel's stretch.
        end = int(received * self._per_input)
        source, left = self._positions(self._emitted, max(end, self._emitted))
        if finalize:
            left = left.clamp(max=received - 1)
        else:  # the right neighbour must have arrived
            ready = int((left + 1 <= received - 1).sum())
            source, left = source[:ready], left[:ready]
        right = torch.where(left < received - 1, left + 1, left)
        weight = (source - left).clamp(0.0, 1.0).to(frames.dtype)
        local_left, local_right = left - self._start, right - self._start
        out = frames[:, :, local_left] * (1 - weight) + frames[:, :, local_right] * weight
        self._emitted += left.numel()
        self._drop_read(frames)
        return out

    def _drop_read(self, frames: Tensor) -> None:
        """Keep only the input frames the next output frame reads (the last one at least)."""
        _, left = self._positions(self._emitted, self._emitted + 1)
        keep_from = min(int(left[0]), self._received - 1)
        if keep_from > self._start:
            self._frames = frames[:, :, keep_from - self._start :]
            self._start = keep_from

    def _release(self, out: Tensor, finalize: bool) -> Tensor:
        if self.min_first <= 0:
            return out
        self._held.append(out)
        self._held_frames += out.shape[2]
        if self._held_frames < self.min_first and not finalize:
            return out[:, :, :0]
        released = torch.cat(self._held, dim=2)
        self._held, self._held_frames, self.min_first = [], 0, 0
        return released
