"""Fit decoded frames to a bucket: resize to cover it, keeping the aspect ratio, then crop (centered
unless the `crop` processor placed the box elsewhere).

Never stretch: a stretched clip teaches the model wrong shapes. The decoder usually delivers frames
already at the covering size (FFmpeg scales while converting to RGB, see decode.py), so fitting is
a crop. Frames of any other size are resized here with torch (antialiased bilinear), a few frames
at a time, so a 720p clip does not need its whole float copy in memory at once.

Fitted frames stay uint8 (`fit_pixels`) until the encoder needs them: a quarter of float32's bytes
between the decode workers and the encoder, and in the per-bucket buffers. `to_model_range` makes
the model's input from them at the last moment.

The `decode` processor is this step in the chain: it decodes the sample's frames (from `start`, at
buckets.fps) scaled to cover its bucket, and cuts the crop box. A sample with a control video gets
its frames the same way (`decode_control`): the frames shown at the clip's own timestamps, scaled to
the clip's covering size and cut at the clip's box, so the two line up pixel for pixel (a control
video of another resolution but the same aspect is scaled to match; another aspect is rejected).
A family that trains audio (model.audio) gets the clip's sound over the same frames' time span
(`decode_sound`, sound.py): the sample's `sound_request` asks for it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from vt.shared.buckets import Bucket, crop_box, resize_for_crop
from vt.shared.chain import DecodeOptions

from .decode import Clip, VideoInfo
from .errors import SampleError
from .sample import Processor, Sample
from .sample_frames import _EPS, sample_times
from .sound import decode_sound

_CHUNK = 8  # frames resized per step: bounds peak memory, costs nothing in speed
_ASPECT_SLACK = 0.02  # a control video's aspect may differ this much (relative) from the clip's: rounded sizes


def _check(frames: np.ndarray, bucket: Bucket) -> None:
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be (F, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    if frames.shape[0] != bucket.frames:
        raise ValueError(f"bucket {bucket.name} needs {bucket.frames} frames, got {frames.shape[0]}")


def fit_pixels(frames: np.ndarray, bucket: Bucket, box: tuple[int, int] | None = None) -> torch.Tensor:
    """(F, H, W, 3) uint8 frames -> (3, F, bucket.height, bucket.width) uint8, covered and cropped at
    `box` (top, left in the covering size; default: centered)."""
    _check(frames, bucket)
    height, width = frames.shape[1:3]
    size = resize_for_crop(height, width, bucket)
    top, left = box if box is not None else crop_box(*size, bucket)
    if not (0 <= top <= size[0] - bucket.height and 0 <= left <= size[1] - bucket.width):
        raise ValueError(f"crop box {box} does not fit {bucket.name} in a {size[0]}x{size[1]} frame")
    if size == (height, width):  # the decoder already scaled: crop, then one copy into channel-first
        crop = frames[:, top : top + bucket.height, left : left + bucket.width]
        return torch.from_numpy(np.ascontiguousarray(crop.transpose(3, 0, 1, 2)))
    out = torch.empty(3, bucket.frames, bucket.height, bucket.width, dtype=torch.uint8)
    for first in range(0, bucket.frames, _CHUNK):
        chunk = torch.from_numpy(np.ascontiguousarray(frames[first : first + _CHUNK]))
        chunk = chunk.permute(0, 3, 1, 2).float()  # (f, 3, H, W)
        chunk = F.interpolate(chunk, size=size, mode="bilinear", antialias=True, align_corners=False)
        chunk = chunk[:, :, top : top + bucket.height, left : left + bucket.width]
        out[:, first : first + chunk.shape[0]] = chunk.round_().clamp_(0, 255).permute(1, 0, 2, 3)
    return out


def to_model_range(pixels: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float32 in [-1, 1] (0 -> -1, 255 -> 1), the range video VAEs take."""
    if pixels.dtype != torch.uint8:
        raise ValueError(f"pixels must be uint8, got {pixels.dtype}")
    return pixels.float().div_(127.5).sub_(1.0)


def fit_to_bucket(frames: np.ndarray, bucket: Bucket) -> torch.Tensor:
    """(F, H, W, 3) uint8 frames -> (3, F, bucket.height, bucket.width) float32 in [-1, 1]."""
    return to_model_range(fit_pixels(frames, bucket))


class Decode(Processor):
    Options = DecodeOptions

    def __call__(self, sample: Sample):
        info, bucket = sample.info, sample.bucket
        assert bucket is not None, "decode runs after sample_frames (vt.shared.chain.resolve_chain orders them)"
        size = resize_for_crop(info.height, info.width, bucket)
        times = sample_times(info, sample.fps, bucket.frames, sample.start)
        pixels = fit_pixels(sample.clip.frames_at(times, size=size), bucket, sample.box)
        control = None if sample.control is None else decode_control(sample, times, size)
        sound = (
            None
            if sample.sound_request is None
            else decode_sound(
                sample.clip.data,
                sample.clip.origin_seconds + sample.start,
                bucket.frames / sample.fps,
                sample.sound_request,
            )
        )
        yield replace(sample, pixels=pixels, control_pixels=control, sound=sound)


def decode_control(sample: Sample, times: list[float], size: tuple[int, int]) -> torch.Tensor:
    """The sample's control video at the clip's frame `times`, scaled to the clip's covering `size` and cut
    at its box: (3, F, H, W) uint8 aligned with `pixels`. Its problems are rejects named `control_<reason>`
    (`control_too_short`: it ends before the sampled frames do; `control_aspect`: another picture shape)."""
    clip, info, bucket = sample.control, sample.info, sample.bucket
    end = times[-1] + 1 / sample.fps
    if times[-1] >= clip.info.duration - _EPS:  # no control frame on screen at the last time (sample_times' rule)
        raise SampleError(
            "control_too_short",
            f"the control video lasts {clip.info.duration:.3f}s; the sampled "
            f"frames run from {times[0]:g}s to {end:.3f}s",
        )
    try:
        check_control(clip.info, info)
        frames = clip.frames_at(times, size=size)
    except SampleError as err:
        raise control_error(err) from None
    return fit_pixels(frames, bucket, sample.box)


def check_control(control: VideoInfo, clip: VideoInfo) -> None:
    """SampleError("control_aspect") unless the control video has the clip's displayed aspect ratio."""
    ratio = (control.width / control.height) / (clip.width / clip.height)
    if abs(ratio - 1) > _ASPECT_SLACK:
        raise SampleError(
            "control_aspect",
            f"the control video is {control.width}x{control.height} (width x "
            f"height), the clip {clip.width}x{clip.height}: another aspect ratio, so "
            "their pixels cannot line up",
        )


def control_error(err: SampleError) -> SampleError:
    """A problem of the control video, not of the clip: its reason prefixed `control_` (once)."""
    if err.reason.startswith("control_"):
        return err
    return SampleError(f"control_{err.reason}", f"the control video: {err.detail}")


def open_control(video: bytes) -> Clip:
    """The control video opened for decoding; its problems (corrupt, empty, no video stream) are rejects
    named `control_<reason>`."""
    try:
        return Clip(video)
    except SampleError as err:
        raise control_error(err) from None
