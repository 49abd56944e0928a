"""Stage 1 processors: raw sample -> frames fitted to a bucket, ready for the model's encoders.

prepare_sample is the part of the pipeline that needs no model: probe, choose a bucket, pick
timestamps, decode only those frames (scaled by FFmpeg straight to the size that covers the
bucket), crop. It is a pure function of its arguments and returns plain tensors, so the service
can run it in worker processes (set up by `worker_init`). Anything wrong with the sample comes out
as SampleError (reason counted in the report); nothing else escapes for bad data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vt.shared.buckets import Bucket, choose_bucket, resize_for_crop

from ..sources import RawSample
from .decode import Clip, VideoInfo, decode_at, probe
from .errors import SampleError
from .fit_bucket import fit_pixels, fit_to_bucket, to_model_range
from .sample_frames import sample_times, usable_frames

__all__ = [
    "Clip", "PreparedSample", "SampleError", "VideoInfo", "decode_at", "fit_pixels", "fit_to_bucket",
    "prepare_sample", "probe", "sample_times", "to_model_range", "usable_frames", "worker_init",
]


@dataclass
class PreparedSample:
    """A sample fitted to its bucket, as uint8 `pixels` (3, F, H, W).

    uint8 is a quarter of float32's bytes to send from a decode worker and to hold in a bucket's
    buffer until the shard is full; `video`, the encoder's input, is made from it when asked for.
    """

    key: str
    caption: str
    bucket: Bucket
    pixels: torch.Tensor

    @property
    def video(self) -> torch.Tensor:
        """(3, F, H, W) float32 in [-1, 1] (a new tensor each time)."""
        return to_model_range(self.pixels)


def prepare_sample(raw: RawSample, buckets: list[Bucket], fps: float) -> PreparedSample:
    """Probe, choose the nearest bucket, sample at `fps` from the start, decode, fit.

    The prepared sample's key is the raw sample's `sample_id` (raw shard name and key).
    """
    if raw.error:
        raise SampleError(raw.error, raw.detail or f"sample {raw.key!r} in {raw.shard}")
    if not buckets:
        raise ValueError("no buckets given; set buckets.sizes, e.g. ['9x64x96']")
    with Clip(raw.video) as clip:
        info = clip.info
        available = usable_frames(info, fps)
        bucket = choose_bucket(buckets, available, info.height, info.width)
        if bucket is None:
            shortest = min(b.frames for b in buckets)
            raise SampleError(
                "too_short",
                f"{raw.sample_id!r} lasts {info.duration:.2f}s = {available} frames at {fps:g} fps; "
                f"the smallest bucket needs {shortest}",
            )
        size = resize_for_crop(info.height, info.width, bucket)
        frames = clip.frames_at(sample_times(info, fps, bucket.frames), size=size)
    return PreparedSample(key=raw.sample_id, caption=raw.caption, bucket=bucket, pixels=fit_pixels(frames, bucket))


def worker_init() -> None:
    """Set up a decode worker process: one torch thread, quiet FFmpeg.

    Decoding is single-threaded per clip and the worker's torch work is a crop and a conversion,
    so more threads would only fight the encoder process (and the other workers) for cores.
    FFmpeg logs every damaged packet of a bad clip to stderr; the service counts those clips.
    """
    import av.logging

    torch.set_num_threads(1)
    av.logging.set_level(av.logging.PANIC)
