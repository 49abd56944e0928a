"""What flows through the processor chain: a `Sample`, and the `Processor` contract.

A processor is a small class built once from its typed options (`Options`, a subclass of
vt.shared.chain.ProcessorOptions) and called on each sample: `processor(sample) -> Iterable[Sample]`.
It yields the sample changed (`dataclasses.replace`), several samples (each with its own key, e.g.
`<key>#w<i>`), or none; a sample it cannot use raises SampleError(reason, detail), which rejects the
raw sample with that reason (counted in the report, listed in rejects.jsonl). The chain runs in
the decode worker processes, so a processor must pickle (plain attributes, no open files).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Iterable

import torch

from vt.shared.buckets import Bucket
from vt.shared.chain import ProcessorOptions
from vt.shared.runtime import keyed_generator

from .decode import Clip, ClipSpan, VideoInfo
from .sound import SoundRequest


@dataclass
class Sample:
    """One sample on its way through the chain; `clip` is the opened video, decoded by `decode`.

    Before `decode`: `bucket` and `start` are set by `sample_frames`, `box` by `crop`. After it:
    `pixels` (3, F, H, W) uint8 holds the bucket-sized frames. `meta` is the .json member ({} if none).
    `control` is the opened control video of a family that trains on one (None otherwise); `decode`
    turns it into `control_pixels`, the same shape as `pixels` and aligned with them frame for frame
    and pixel for pixel. A processor after `decode` that changes `pixels` (a flip, a colour change)
    decides what the same change means for `control_pixels`: a flip flips both, a colour change only
    the clip. `sound_request` is set when the family trains audio (model.audio); `decode` then also decodes
    `sound` (channels, samples) float32, the clip's sound over the frames' time span (sound.py). `clip` may be
    a span of the opened video (`ClipSpan`, made by split_scenes), which reads as a clip of its own.
    `wants_caption` (set by `caption_model`): the service captions it with the model before its text phase, so
    its `caption` may be empty here. `extra_captions`: more captions of it (the model's beside the given one);
    stage 1 encodes each once and the trainer draws one of `caption` and these per epoch.
    """

    key: str
    caption: str
    clip: Clip | ClipSpan
    fps: float  # buckets.fps
    buckets: list[Bucket]
    meta: dict = field(default_factory=dict)
    bucket: Bucket | None = None
    start: float = 0.0  # seconds from the clip's start of the first frame
    box: tuple[int, int] | None = None  # top-left of the crop in the frame scaled to cover the bucket
    pixels: torch.Tensor | None = None
    control: Clip | ClipSpan | None = None
    control_pixels: torch.Tensor | None = None
    sound_request: SoundRequest | None = None
    sound: torch.Tensor | None = None
    window: str = ""  # the window's storage URI, for a processor that keeps a table there (dedup); "" without one
    wants_caption: bool = False  # caption_model: the model captions it after the chain (captioner.py)
    extra_captions: tuple[str, ...] = ()  # other captions of it, each encoded once; the trainer draws one per epoch

    @property
    def info(self) -> VideoInfo:
        return self.clip.info

    def derive(self, suffix: str, **changes) -> "Sample":
        """A sample made from this one, keyed `<key>#<suffix>` so its commit is tracked on its own."""
        return replace(self, key=f"{self.key}#{suffix}", **changes)

    def draw(self, what: str, seed: int, high: int) -> int:
        """An integer in [0, high], the same for every run and process given (what, seed, key)."""
        return int(torch.randint(0, high + 1, (1,), generator=keyed_generator(what, seed, self.key)))


class Processor:
    """Convenience base for a processor: keeps `options`; subclasses set `Options` and `__call__`."""

    Options: ClassVar[type[ProcessorOptions]] = ProcessorOptions

    def __init__(self, options: ProcessorOptions):
        self.options = options

    def __call__(self, sample: Sample) -> Iterable[Sample]:
        raise NotImplementedError
