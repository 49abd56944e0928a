"""The `crop` processor: where the bucket-sized crop sits in the frame scaled to cover the bucket.

"center" is the crop vt always made; "random" draws the top-left corner from (seed, sample key), so
a run and its resume, and every worker process, cut the same crop. The frame is never stretched
either way: only the part of the covering frame that is kept changes.
"""

from __future__ import annotations

from dataclasses import replace

from vt.shared.buckets import crop_box, resize_for_crop
from vt.shared.chain import CropOptions

from .sample import Processor, Sample


class Crop(Processor):
    Options = CropOptions

    def __call__(self, sample: Sample):
        bucket = sample.bucket
        assert bucket is not None, "crop runs after sample_frames (vt.shared.chain.resolve_chain orders them)"
        height, width = resize_for_crop(sample.info.height, sample.info.width, bucket)
        if self.options.mode == "center":
            box = crop_box(height, width, bucket)
        else:
            box = (
                sample.draw("crop.top", self.options.seed, height - bucket.height),
                sample.draw("crop.left", self.options.seed, width - bucket.width),
            )
        yield replace(sample, box=box)
