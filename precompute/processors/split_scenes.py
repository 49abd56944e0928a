"""The `split_scenes` processor: a long video cut into clips at its scene changes, each a sample of its own.

Detection is PySceneDetect's ContentDetector (`scenedetect`, installed with `pip install 'vt[scenes]'`), fed by
one forward decode of the video at a small size (`detect_width`): the only time the whole video is decoded.
A cut is the first frame of a new scene, at that frame's presentation time. Scenes shorter than `min_seconds`
are dropped; a scene longer than `max_seconds` is cut into the fewest equal pieces that fit. Each piece is a
sample keyed `<key>#s<n>` (n counts the kept pieces from 0) whose clip is that span of the opened video
(`Clip.span`): `sample_frames` then picks its bucket and frames inside the span, its window modes included
(`<key>#s0#w1`), and `decode` seeks to them. Listed before `sample_frames`. A still image (one-frame
buckets) passes unchanged.
"""

from __future__ import annotations

import math

import numpy as np

from vt.shared.chain import SplitScenesOptions
from vt.shared.errors import UserError

from .decode import Clip
from .errors import SampleError
from .sample import Processor, Sample


def _detector(threshold: float):
    try:
        from scenedetect import ContentDetector, FrameTimecode
    except ImportError:
        raise UserError(
            "the split_scenes processor needs PySceneDetect: pip install 'vt[scenes]' (scenedetect-headless)"
        ) from None
    # A cut may follow the previous one by a single frame: min_seconds is applied to the scenes afterwards.
    return ContentDetector(threshold=threshold, min_scene_len=1), FrameTimecode


def detect_cuts(clip: Clip, threshold: float, width: int) -> list[float]:
    """Times (seconds from the clip's start) of the first frame of each scene after the first."""
    detector, timecode = _detector(threshold)
    info = clip.info
    height = max(2, round(width * info.height / info.width / 2) * 2)
    times, cuts = [], []
    for index, (seconds, rgb) in enumerate(clip.scan((height, width))):
        times.append(seconds)
        found = detector.process_frame(timecode(index, info.fps), np.ascontiguousarray(rgb[..., ::-1]))
        cuts.extend(found)
    if times:
        cuts.extend(detector.post_process(timecode(len(times) - 1, info.fps)))
    frames = sorted({int(cut.frame_num) for cut in cuts if 0 < int(cut.frame_num) < len(times)})
    return [times[frame] for frame in frames]


def pieces(bounds: list[float], min_seconds: float, max_seconds: float) -> list[tuple[float, float]]:
    """Scenes between consecutive `bounds` -> the spans kept: at least `min_seconds`, longer ones cut into
    the fewest equal pieces of at most `max_seconds` (0: no maximum)."""
    spans = []
    for start, end in zip(bounds, bounds[1:]):
        length = end - start
        if length < min_seconds or length <= 0:
            continue
        count = max(1, math.ceil(length / max_seconds - 1e-9)) if max_seconds else 1
        spans.extend((start + i * length / count, start + (i + 1) * length / count) for i in range(count))
    return spans


class SplitScenes(Processor):
    Options = SplitScenesOptions

    def __call__(self, sample: Sample):
        if not isinstance(sample.clip, Clip):
            raise ValueError(f"split_scenes got {sample.key!r} already split; list it once, before sample_frames")
        if all(bucket.frames == 1 for bucket in sample.buckets):  # a still image: nothing to split
            yield sample
            return
        options = self.options
        cuts = detect_cuts(sample.clip, options.threshold, min(options.detect_width, sample.info.width))
        spans = pieces([0.0, *cuts, sample.info.duration], options.min_seconds, options.max_seconds)
        if not spans:
            raise SampleError(
                "no_scene",
                f"{sample.key!r} ({sample.info.duration:.2f}s, {len(cuts)} cuts) has no scene of at least "
                f"{options.min_seconds:g}s",
            )
        for index, (start, end) in enumerate(spans):
            yield sample.derive(
                f"s{index}", clip=sample.clip.span(start, end), control=_control_span(sample, start, end)
            )


def _control_span(sample: Sample, start: float, end: float):
    """The control video over the scene's span (decode checks that it lasts as long as the frames need)."""
    control = sample.control
    if control is None:
        return None
    if start >= control.info.duration:
        raise SampleError(
            "control_too_short",
            f"the control video ends at {control.info.duration:.3f}s, before a scene at {start:.3f}s",
        )
    return control.span(start, min(end, control.info.duration))
