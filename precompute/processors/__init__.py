"""Stage 1 processors: raw sample -> frames fitted to a bucket, ready for the model's encoders.

prepare_sample is the part of the pipeline that needs no model: probe, choose a bucket, pick
timestamps, decode only those frames, fit. It is a pure function of its arguments and returns
plain tensors, so the service can run it in worker processes. Anything wrong with the sample
comes out as SampleError (reason counted in the report); nothing else escapes for bad data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vt.shared.buckets import Bucket, choose_bucket

from ..sources import RawSample
from .decode import VideoInfo, decode_at, probe
from .errors import SampleError
from .fit_bucket import fit_to_bucket
from .sample_frames import sample_times, usable_frames

__all__ = [
    "PreparedSample", "SampleError", "VideoInfo", "decode_at", "fit_to_bucket", "prepare_sample",
    "probe", "sample_times", "usable_frames",
]


@dataclass
class PreparedSample:
    """A sample fitted to its bucket: video is (3, F, H, W) float32 in [-1, 1]."""

    key: str
    caption: str
    bucket: Bucket
    video: torch.Tensor


def prepare_sample(raw: RawSample, buckets: list[Bucket], fps: float) -> PreparedSample:
    """Probe, choose the nearest bucket, sample at `fps` from the start, decode, fit."""
    if raw.error:
        raise SampleError(raw.error, f"sample {raw.key!r} in {raw.shard}")
    if not buckets:
        raise ValueError("no buckets given; set buckets.sizes, e.g. ['9x64x96']")
    info = probe(raw.video)
    available = usable_frames(info, fps)
    bucket = choose_bucket(buckets, available, info.height, info.width)
    if bucket is None:
        shortest = min(b.frames for b in buckets)
        raise SampleError(
            "too_short",
            f"{raw.key!r} lasts {info.duration:.2f}s = {available} frames at {fps:g} fps; "
            f"the smallest bucket needs {shortest}",
        )
    frames = decode_at(raw.video, sample_times(info, fps, bucket.frames), info)
    return PreparedSample(key=raw.key, caption=raw.caption, bucket=bucket, video=fit_to_bucket(frames, bucket))
