"""Which timestamps to decode: `frames` instants spaced 1/fps apart, from the clip's start.

Sampling by time rather than by frame index is what lets a 25 fps, a 29.97 fps and a variable
frame rate source all give the same motion speed at the configured rate (buckets.fps).
A time t is usable when some frame is on screen at t, that is t < duration.
"""

from __future__ import annotations

import math

from .decode import VideoInfo
from .errors import SampleError

_EPS = 1e-6  # float slack, far below any frame interval


def _check_rate(fps: float) -> None:
    if not fps > 0:
        raise ValueError(f"sampling fps must be > 0, got {fps!r}; set buckets.fps, e.g. 8.0")


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
