"""Which timestamps to decode: `frames` instants spaced 1/fps apart, from a start time.

Sampling by time rather than by frame index is what lets a 25 fps, a 29.97 fps and a variable
frame rate source all give the same motion speed at the configured rate (buckets.fps).
A time t is usable when some frame is on screen at t, that is t < duration.

The `sample_frames` processor chooses the bucket (nearest aspect among those the clip has frames
for at buckets.fps) and where its frames start: at 0 ("start"), at a whole number of frame steps
drawn from (seed, sample key) ("random"), one sample per non-overlapping window ("all_windows",
keys `<key>#w0`, `<key>#w1`, ...), or `windows` samples whose starts are spread evenly over the clip
("uniform", same keys; a clip with room for fewer distinct starts gives fewer samples).
"""

from __future__ import annotations

import math
from dataclasses import replace

from vt.shared.buckets import choose_bucket
from vt.shared.chain import SampleFramesOptions
from vt.shared.errors import UserError

from .decode import VideoInfo
from .errors import SampleError
from .sample import Processor, Sample

_EPS = 1e-6  # float slack, far below any frame interval


def _check_rate(fps: float) -> None:
    if not fps > 0:
        raise UserError(f"sampling fps must be > 0, got {fps!r}; set buckets.fps, e.g. 8.0")


def usable_frames(info: VideoInfo, fps: float) -> int:
    """How many frames at `fps` fit in the clip from its start (times 0, 1/fps, ... < duration)."""
    _check_rate(fps)
    return max(0, math.ceil(info.duration * fps - _EPS))


def sample_times(info: VideoInfo, fps: float, frames: int, start: float = 0.0) -> list[float]:
    """`frames` times start, start + 1/fps, ...; SampleError("too_short") if the clip ends first."""
    _check_rate(fps)
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    if start < 0:
        raise ValueError(f"start must be >= 0 seconds, got {start}")
    times = [start + k / fps for k in range(frames)]
    if times[-1] >= info.duration - _EPS:
        raise SampleError(
            "too_short",
            f"{frames} frames at {fps:g} fps from {start:g}s need {times[-1] + 1 / fps:.3f}s; "
            f"the clip lasts {info.duration:.3f}s",
        )
    return times


class SampleFrames(Processor):
    Options = SampleFramesOptions

    def __call__(self, sample: Sample):
        info, fps = sample.info, sample.fps
        available = usable_frames(info, fps)
        bucket = choose_bucket(sample.buckets, available, info.height, info.width)
        if bucket is None:
            shortest = min(b.frames for b in sample.buckets)
            raise SampleError(
                "too_short",
                f"{sample.key!r} lasts {info.duration:.2f}s = {available} frames at "
                f"{fps:g} fps; the smallest bucket needs {shortest}",
            )
        mode = self.options.mode
        if mode == "start":
            yield replace(sample, bucket=bucket, start=0.0)
        elif mode == "random":
            yield replace(
                sample,
                bucket=bucket,
                start=sample.draw("sample_frames", self.options.seed, available - bucket.frames) / fps,
            )
        elif mode == "uniform":
            last = available - bucket.frames  # the latest start, in frame steps
            count = min(self.options.windows, last + 1)
            starts = [round(i * last / (count - 1)) if count > 1 else 0 for i in range(count)]
            for index, step in enumerate(starts):
                yield sample.derive(f"w{index}", bucket=bucket, start=step / fps)
        else:
            count = available // bucket.frames
            if self.options.max_windows:
                count = min(count, self.options.max_windows)
            for index in range(count):
                yield sample.derive(f"w{index}", bucket=bucket, start=index * bucket.frames / fps)
