"""(frames, height, width) buckets: parse, choose the nearest for a clip, count tokens.

A clip goes to the bucket whose aspect ratio is nearest its own (in log space, so 2:1 and 1:2 are
equally far from 1:1), among buckets it has enough frames for; ties go to more frames, then more
pixels. The clip is then resized to cover the bucket and center-cropped: never stretched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vt.shared.errors import UserError


@dataclass(frozen=True, order=True)
class Bucket:
    frames: int
    height: int
    width: int

    @property
    def name(self) -> str:
        return f"{self.frames}x{self.height}x{self.width}"

    @property
    def aspect(self) -> float:
        return self.width / self.height

    @classmethod
    def parse(cls, text: str) -> "Bucket":
        parts = text.lower().split("x")
        if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"bucket {text!r} must look like FRAMESxHEIGHTxWIDTH, e.g. 9x64x96")
        return cls(*(int(p) for p in parts))


def parse_buckets(specs: list[str]) -> list[Bucket]:
    if not specs:
        raise UserError("buckets.sizes is empty; give at least one bucket, e.g. ['9x64x96']")
    buckets = sorted({Bucket.parse(s) for s in specs})
    return buckets


def buckets_for(buckets: list[Bucket], still: bool) -> list[Bucket]:
    """The buckets a sample may take: one-frame buckets (1xHxW) for a still image, the others for a clip."""
    return [b for b in buckets if (b.frames == 1) == still]


def choose_bucket(buckets: list[Bucket], frames: int, height: int, width: int) -> Bucket | None:
    """The bucket for a clip of `frames` usable frames at height x width, or None if too short."""
    fitting = [b for b in buckets if b.frames <= frames]
    if not fitting:
        return None
    aspect = math.log(width / height)
    return min(fitting, key=lambda b: (round(abs(math.log(b.aspect) - aspect), 6), -b.frames, -b.height * b.width))


def resize_for_crop(height: int, width: int, bucket: Bucket) -> tuple[int, int]:
    """The smallest (height, width) with the clip's aspect that covers the bucket (then center crop)."""
    scale = max(bucket.height / height, bucket.width / width)
    return max(bucket.height, round(height * scale)), max(bucket.width, round(width * scale))


def crop_box(height: int, width: int, bucket: Bucket) -> tuple[int, int]:
    """Top-left corner of the centered bucket-sized crop in a height x width frame."""
    return (height - bucket.height) // 2, (width - bucket.width) // 2
