"""What a decode worker runs: a raw sample through the processor chain to its prepared samples or its
reason for rejection (`Prepare`), and the markers that travel with them (`ShardEnd`).

Kept apart from service.py so a spawned decode worker imports only the processors (torch, PyAV), not the
encoders' libraries (transformers, diffusers' models): a worker then starts in about the time torch takes
to import, while the service is still importing and loading the encoders.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from vt.precompute.processors import Chain, ErrorPolicy, PreparedSample, SampleError, SoundRequest
from vt.precompute.sources import RawSample
from vt.shared.buckets import Bucket, buckets_for

__all__ = ["Outcome", "Prepare", "ShardEnd", "prepare_timed"]


@dataclass
class Outcome:
    """What became of one raw sample: the `samples` the chain made of it, or `reason` and `detail`."""

    key: str  # the raw sample's key in shards and logs (RawSample.sample_id)
    shard: str  # the raw shard it came from
    position: int  # its ordinal in that shard
    samples: list[PreparedSample] | None  # several with a chain that splits clips (keys <key>#w<i>)
    reason: str | None
    detail: str
    seconds: float
    dropped: list[tuple[str, str, str]] = field(default_factory=list)  # (key, reason, detail) of parts rejected alone

    @classmethod
    def of(
        cls,
        raw: RawSample,
        samples: list[PreparedSample] | None,
        reason: str | None = None,
        detail: str = "",
        seconds: float = 0.0,
        dropped: list[tuple[str, str, str]] | None = None,
    ) -> "Outcome":
        return cls(raw.sample_id, raw.shard, raw.position, samples, reason, detail, seconds, dropped or [])


@dataclass(frozen=True)
class ShardEnd:
    """Follows the last sample of raw shard `index` through the pipeline: that shard is read to the end."""

    index: int


def prepare_timed(
    raw: RawSample,
    chain: Chain,
    buckets: list[Bucket],
    fps: float,
    policy: ErrorPolicy,
    sound: SoundRequest | None = None,
) -> Outcome:
    """Runs in a decode worker: a sample in, its prepared samples (with their sound when `sound` asks for
    it) or the reason it was rejected out.

    Only what `policy` judged bad data arrives here as SampleError; what it raises (ProcessorBug)
    goes back to the service through the pool and stops the run.
    """
    start = time.perf_counter()
    dropped: list[tuple[str, str, str]] = []
    try:
        samples = chain.prepare(raw, buckets, fps, policy, sound, dropped)
        return Outcome.of(raw, samples, seconds=time.perf_counter() - start, dropped=dropped)
    except SampleError as err:  # parts dropped before the last one went are listed too
        return Outcome.of(raw, None, err.reason, err.detail, time.perf_counter() - start, dropped)


class Prepare:
    """Picklable `prepare_timed` bound to the chain, bucket table, error policy and sound request; (raw index,
    sample) -> (raw index, Outcome)."""

    def __init__(
        self, chain: Chain, buckets: list[Bucket], fps: float, policy: ErrorPolicy, sound: SoundRequest | None = None
    ):
        self.chain, self.buckets, self.fps, self.policy, self.sound = chain, buckets, fps, policy, sound

    def __call__(self, item: tuple[int, RawSample] | ShardEnd) -> tuple[int, Outcome] | ShardEnd:
        if isinstance(item, ShardEnd):
            return item
        index, raw = item
        buckets = buckets_for(self.buckets, raw.still)  # a still image: one-frame buckets only
        if not buckets and raw.error is None:
            need = "a one-frame bucket (1xHxW)" if raw.still else "a bucket of more than one frame"
            kind = "an image" if raw.still else "a clip"
            return index, Outcome.of(raw, None, "no_bucket", f"{kind} needs {need} in buckets.sizes")
        return index, prepare_timed(raw, self.chain, buckets, self.fps, self.policy, self.sound)

    @staticmethod
    def crashed(item: tuple[int, RawSample] | ShardEnd) -> tuple[int, Outcome] | ShardEnd:
        """The outcome of a sample whose decode killed its worker process."""
        if isinstance(item, ShardEnd):
            return item
        index, raw = item
        return index, Outcome.of(
            raw, None, "decoder_crashed", "the decode worker process (or Ray actor) died on this clip"
        )
