"""The chain that runs: precompute.processors resolved (vt.shared.chain) into processor objects.

`build_chain(entries)` validates and completes the configured list, and builds each step from its
options: a built-in or a user class alike, by the import path the step names (`Step.implementation`;
the built-ins' table is vt.shared.chain.BUILTINS). `Chain.prepare(raw, buckets, fps, policy, sound)` opens
the clip once, runs every step over the sample (a step may yield several samples or none) and returns
the prepared samples; an exception in a step goes through the error policy (policy.py) with the
step's name, which rejects bad data and stops the run for anything else. `sound` (a SoundRequest, for
a family that trains audio) makes `decode` also decode each sample's sound over its frames' time span.
A Chain pickles, so it runs in the decode workers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from vt.shared.buckets import Bucket
from vt.shared.chain import load_user_class, resolve_chain
from vt.shared.errors import UserError

from ..sources import RawSample
from .caption import Caption
from .caption_model import CaptionModel
from .decode import Clip
from .errors import SampleError
from .fit_bucket import open_control
from .policy import ErrorPolicy, bad_data_only
from .prepared import PreparedSample
from .sample import Sample
from .sound import SoundRequest


@contextmanager
def _step(name: str, key: str, policy: ErrorPolicy) -> Iterator[None]:
    """Any exception inside is judged by `policy` as step `name`'s on sample `key`."""
    try:
        yield
    except Exception as err:
        raise policy(err, name, key) from None


@dataclass
class Chain:
    """Processors in the order they run, with the resolved steps' names (for messages)."""

    processors: list
    names: list[str]
    window: str = ""  # the window's storage URI, handed to every sample (Sample.window)

    def _reads_json(self) -> bool:
        return any(isinstance(p, Caption) and p.options.field for p in self.processors)

    def _may_lack_caption(self, raw: RawSample) -> bool:
        """A raw sample without a caption is fine when a step takes it from elsewhere: a caption step from another
        .json field, or the model (caption_model)."""
        if raw.error not in ("missing_caption", "empty_caption"):
            return False
        if any(isinstance(p, CaptionModel) for p in self.processors):
            return True
        return raw.error == "missing_caption" and raw.meta is not None and self._reads_json()

    def prepare(
        self,
        raw: RawSample,
        buckets: list[Bucket],
        fps: float,
        policy: ErrorPolicy = bad_data_only,
        sound: SoundRequest | None = None,
        dropped: list[tuple[str, str, str]] | None = None,
    ) -> list[PreparedSample]:
        """The samples the chain makes of one raw sample; SampleError if it cannot be used (as
        `policy` judges a step's exception; bad_data_only raises ProcessorBug for a bug). `sound`: each
        sample also carries its sound (model.audio), decoded as the request says."""
        # A .json without "caption" / "text" is fine when a caption step reads another field of it.
        if raw.error and not self._may_lack_caption(raw):
            raise SampleError(raw.error, raw.detail or f"sample {raw.key!r} in {raw.shard}")
        if not buckets:
            raise UserError("no buckets given; set buckets.sizes, e.g. ['9x64x96']")
        key = raw.sample_id
        with ExitStack() as opened:
            with _step("decode", key, policy):  # opening probes the clip (and its control video): decode's work
                clip = opened.enter_context(Clip(raw.video))
                control = None if raw.control is None else opened.enter_context(open_control(raw.control))
            samples = [
                Sample(
                    key=key,
                    caption=raw.caption or "",
                    clip=clip,
                    fps=fps,
                    buckets=buckets,
                    meta=raw.meta or {},
                    control=control,
                    sound_request=sound,
                    window=self.window,
                )
            ]
            for name, processor in zip(self.names, self.processors):
                samples = _unique(_run_step(name, processor, samples, policy, dropped))
        if not samples:
            raise SampleError("no_samples", f"the processor chain ({' -> '.join(self.names)}) made no sample of it")
        with _step(self.names[-1], key, policy):  # the last step handed them out
            return [_prepared(sample, raw) for sample in samples]


def _run_step(name: str, processor, samples: list[Sample], policy: ErrorPolicy, dropped: list | None) -> list[Sample]:
    """One step over the samples in flight; a rejected one of several is dropped alone (into `dropped`)."""
    out, rejected = [], []
    for sample in samples:
        try:
            with _step(name, sample.key, policy):
                out.extend(processor(sample))
        except SampleError as err:
            if len(samples) == 1:
                raise
            rejected.append((sample.key, err))
    if rejected and not out:
        raise rejected[0][1]
    if dropped is not None:
        dropped.extend((key, err.reason, err.detail) for key, err in rejected)
    return out


def _unique(samples: list[Sample]) -> list[Sample]:
    keys = [s.key for s in samples]
    if len(set(keys)) != len(keys):
        raise UserError(
            f"the processor chain made samples with the same key {sorted(keys)}; a processor that "
            "yields several samples must give each its own key (Sample.derive)"
        )
    return samples


def _prepared(sample: Sample, raw: RawSample) -> PreparedSample:
    bucket = sample.bucket
    expected = (3, bucket.frames, bucket.height, bucket.width)
    for name in ("pixels", "control_pixels") if raw.control is not None else ("pixels",):
        pixels = getattr(sample, name)
        if pixels is None or tuple(pixels.shape) != expected or pixels.dtype.is_floating_point:
            raise ValueError(
                f"sample {sample.key!r} left the chain with {name} "
                f"{None if pixels is None else tuple(pixels.shape)}, not uint8 {expected}; a processor "
                "after decode must keep the bucket's shape"
            )
    request = sample.sound_request
    if request is not None:
        expected = (request.channels, request.samples(bucket.frames / sample.fps))
        if sample.sound is None or tuple(sample.sound.shape) != expected or sample.sound.dtype != torch.float32:
            found = None if sample.sound is None else f"{tuple(sample.sound.shape)} {sample.sound.dtype}"
            raise ValueError(
                f"sample {sample.key!r} left the chain with sound {found}, not float32 {expected} (the "
                "frames' time span at the family's rate); a processor after decode must keep it"
            )
    if not sample.caption and not sample.wants_caption:
        raise SampleError(raw.error or "missing_caption", raw.detail or "the sample has no caption")
    control = sample.control_pixels if raw.control is not None else None
    return PreparedSample(
        key=sample.key,
        caption=sample.caption,
        bucket=bucket,
        pixels=sample.pixels,
        control_pixels=control,
        sound=sample.sound if request is not None else None,
        clip=raw.clip,
        wants_caption=sample.wants_caption,
        extra_captions=sample.extra_captions,
    )


def build_chain(entries: list[dict], window: str = "") -> Chain:
    """precompute.processors -> the Chain that runs (validated, core steps added; see vt.shared.chain). `window`:
    the window's storage URI, where a processor such as dedup keeps its table."""
    steps = resolve_chain(entries)
    return Chain(
        [load_user_class(step.implementation)(step.options) for step in steps], [step.name for step in steps], window
    )
