"""The chain that runs: precompute.processors resolved (vt.shared.chain) into processor objects.

`build_chain(entries)` validates and completes the configured list, and builds each step from its
options: a built-in from BUILTINS, a user class by its import path. `Chain.prepare(raw, buckets,
fps)` opens the clip once, runs every step over the sample (a step may yield several samples or
none) and returns the prepared samples. A Chain pickles, so it runs in the decode workers.
"""

from __future__ import annotations

from dataclasses import dataclass

from vt.shared.buckets import Bucket
from vt.shared.chain import load_user_class, resolve_chain

from ..sources import RawSample
from .caption import Caption
from .crop import Crop
from .decode import Clip
from .errors import SampleError
from .fit_bucket import Decode
from .prepared import PreparedSample
from .sample import Sample
from .sample_frames import SampleFrames

BUILTINS = {"sample_frames": SampleFrames, "crop": Crop, "caption": Caption, "decode": Decode}


@dataclass
class Chain:
    """Processors in the order they run, with the resolved steps' names (for messages)."""

    processors: list
    names: list[str]

    def _reads_json(self) -> bool:
        return any(isinstance(p, Caption) and p.options.field for p in self.processors)

    def prepare(self, raw: RawSample, buckets: list[Bucket], fps: float) -> list[PreparedSample]:
        """The samples the chain makes of one raw sample; SampleError if it cannot be used."""
        # A .json without "caption" / "text" is fine when a caption step reads another field of it.
        if raw.error and not (raw.error == "missing_caption" and raw.meta is not None and self._reads_json()):
            raise SampleError(raw.error, raw.detail or f"sample {raw.key!r} in {raw.shard}")
        if not buckets:
            raise ValueError("no buckets given; set buckets.sizes, e.g. ['9x64x96']")
        with Clip(raw.video) as clip:
            samples = [Sample(key=raw.sample_id, caption=raw.caption or "", clip=clip, fps=fps, buckets=buckets,
                              meta=raw.meta or {})]
            for processor in self.processors:
                samples = [out for sample in samples for out in processor(sample)]
        if not samples:
            raise SampleError("no_samples", f"the processor chain ({' -> '.join(self.names)}) made no sample of it")
        return [_prepared(sample, raw) for sample in _unique(samples)]


def _unique(samples: list[Sample]) -> list[Sample]:
    keys = [s.key for s in samples]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the processor chain made samples with the same key {sorted(keys)}; a processor that "
                         "yields several samples must give each its own key (Sample.derive)")
    return samples


def _prepared(sample: Sample, raw: RawSample) -> PreparedSample:
    bucket, pixels = sample.bucket, sample.pixels
    expected = (3, bucket.frames, bucket.height, bucket.width)
    if pixels is None or tuple(pixels.shape) != expected or pixels.dtype.is_floating_point:
        raise ValueError(f"sample {sample.key!r} left the chain with pixels {None if pixels is None else pixels.shape}"
                         f", not uint8 {expected}; a processor after decode must keep the bucket's shape")
    if not sample.caption:
        raise SampleError(raw.error or "missing_caption", raw.detail or "the sample has no caption")
    return PreparedSample(key=sample.key, caption=sample.caption, bucket=bucket, pixels=pixels)


def build_chain(entries: list[dict]) -> Chain:
    """precompute.processors -> the Chain that runs (validated, core steps added; see vt.shared.chain)."""
    steps = resolve_chain(entries)
    processors = [(BUILTINS.get(step.name) or load_user_class(step.name))(step.options) for step in steps]
    return Chain(processors, [step.name for step in steps])
