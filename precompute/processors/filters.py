"""Filters: processors that pass a sample on unchanged or reject it with a reason (rejects.jsonl).

`filter_size` reads the clip's probe (`too_short`, `too_small`) and may run anywhere; the others read the
decoded `pixels` (3, F, H, W) uint8 and run after `decode`: `filter_black` (`black_frames`), `filter_frozen`
(`frozen_frames`), `filter_motion` (`too_little_motion`, `too_much_motion`). Motion is the mean absolute
difference between consecutive frames at buckets.fps, in 0-255 pixel levels. A one-frame sample (an image)
has no motion: the frame filters pass it. Thresholds are the processors' options (vt.shared.chain).
"""

from __future__ import annotations

import torch

from vt.shared.chain import FilterBlackOptions, FilterFrozenOptions, FilterMotionOptions, FilterSizeOptions

from .errors import SampleError
from .sample import Processor, Sample

_LUMA = torch.tensor([0.299, 0.587, 0.114])  # BT.601 weights of R, G, B


def frame_changes(pixels: torch.Tensor) -> torch.Tensor:
    """(F - 1,) mean absolute difference (0-255) between each frame and the one before it."""
    frames = pixels.float()
    return (frames[:, 1:] - frames[:, :-1]).abs().mean(dim=(0, 2, 3))


def frame_luma(pixels: torch.Tensor) -> torch.Tensor:
    """(F,) mean luma (0-255) of each frame."""
    return torch.einsum("c,cf->f", _LUMA, pixels.float().mean(dim=(2, 3)))


def _pixels(sample: Sample, name: str) -> torch.Tensor:
    if sample.pixels is None:
        raise ValueError(f"{name} reads the decoded pixels; list it after {{name = 'decode'}}")
    return sample.pixels


class FilterSize(Processor):
    Options = FilterSizeOptions

    def __call__(self, sample: Sample):
        info, o = sample.info, self.options
        if info.duration < o.min_seconds:
            raise SampleError("too_short", f"{info.duration:.2f}s < filter_size.min_seconds {o.min_seconds:g}")
        if info.height < o.min_height or info.width < o.min_width:
            raise SampleError(
                "too_small", f"{info.width}x{info.height} is under filter_size's {o.min_width}x{o.min_height}"
            )
        yield sample


class FilterMotion(Processor):
    Options = FilterMotionOptions

    def __call__(self, sample: Sample):
        changes = frame_changes(_pixels(sample, "filter_motion"))
        if changes.numel():
            motion, o = float(changes.mean()), self.options
            if motion < o.min_motion:
                raise SampleError("too_little_motion", f"mean frame difference {motion:.2f} < {o.min_motion:g}")
            if o.max_motion and motion > o.max_motion:
                raise SampleError("too_much_motion", f"mean frame difference {motion:.2f} > {o.max_motion:g}")
        yield sample


class FilterBlack(Processor):
    Options = FilterBlackOptions

    def __call__(self, sample: Sample):
        luma, o = frame_luma(_pixels(sample, "filter_black")), self.options
        black = float((luma <= o.luma).float().mean())
        if black > o.max_fraction:
            raise SampleError(
                "black_frames", f"{black:.0%} of frames have mean luma <= {o.luma:g} (at most {o.max_fraction:.0%})"
            )
        yield sample


class FilterFrozen(Processor):
    Options = FilterFrozenOptions

    def __call__(self, sample: Sample):
        changes, o = frame_changes(_pixels(sample, "filter_frozen")), self.options
        if changes.numel():
            frozen = float((changes <= o.tolerance).float().mean())
            if frozen > o.max_fraction:
                raise SampleError(
                    "frozen_frames",
                    f"{frozen:.0%} of frames repeat the one before (difference <= {o.tolerance:g}; "
                    f"at most {o.max_fraction:.0%})",
                )
        yield sample
