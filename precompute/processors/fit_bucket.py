"""Fit decoded frames to a bucket: resize to cover it, keeping the aspect ratio, then center crop.

Never stretch: a stretched clip teaches the model wrong shapes. The resize is done with torch
(antialiased bilinear) a few frames at a time, so a 720p clip does not need its whole float copy
in memory at once.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from vt.shared.buckets import Bucket, crop_box, resize_for_crop

_CHUNK = 8  # frames resized per step: bounds peak memory, costs nothing in speed


def fit_to_bucket(frames: np.ndarray, bucket: Bucket) -> torch.Tensor:
    """(F, H, W, 3) uint8 frames -> (3, F, bucket.height, bucket.width) float32 in [-1, 1]."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be (F, H, W, 3) uint8, got {frames.shape} {frames.dtype}")
    if frames.shape[0] != bucket.frames:
        raise ValueError(f"bucket {bucket.name} needs {bucket.frames} frames, got {frames.shape[0]}")
    height, width = frames.shape[1:3]
    size = resize_for_crop(height, width, bucket)
    top, left = crop_box(*size, bucket)
    out = torch.empty(3, bucket.frames, bucket.height, bucket.width, dtype=torch.float32)
    for first in range(0, bucket.frames, _CHUNK):
        chunk = torch.from_numpy(np.ascontiguousarray(frames[first:first + _CHUNK]))
        chunk = chunk.permute(0, 3, 1, 2).float()  # (f, 3, H, W)
        if size != (height, width):
            chunk = F.interpolate(chunk, size=size, mode="bilinear", antialias=True, align_corners=False)
        chunk = chunk[:, :, top:top + bucket.height, left:left + bucket.width]
        out[:, first:first + chunk.shape[0]] = chunk.permute(1, 0, 2, 3)
    return out.div_(127.5).sub_(1.0).clamp_(-1.0, 1.0)
