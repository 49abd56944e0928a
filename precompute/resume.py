"""The producer's resume state: which raw samples are already in committed shards, eviction or not.

Commit records cannot tell a restarted producer what it already produced: eviction deletes them.
So each producer keeps its own progress record in the window (one writer: the lease holder), and
writes it *before* each commit, holding two states: `before` (without the shard being committed)
and `after` (with it), plus the shard's seq and keys. On restart, the record of that seq decides:
present (or evicted, i.e. below the watermark) means the commit happened, so `after` holds;
absent means it did not, so `before` holds. Writing after the commit instead would leave a gap in
which the trainer could read, checkpoint and evict the shard while the producer is dead, and its
samples would be produced twice.

A state names this rank's raw shards by index in its own shard list (its digest is stored, so a
changed data.raw is refused): `complete` raw shards (every sample committed or rejected) are
skipped without being read; `partial` ones are re-read and only their committed samples are skipped.
Samples are named by their key in the shards (`RawSample.sample_id`: raw shard name and key), and a
key is committed at most once per raw shard (a repeat inside a tar is rejected as duplicate_key and
never counts as committed), so a key in `partial` names exactly one sample.
A raw shard is complete once it is read to the end and none of its accepted samples still waits in
a bucket buffer. Buffered samples are never committed by a dead process, so they are simply
decoded again. The state stays small: `complete` is stored as index ranges and only raw shards
with samples still in the buffers (a few per bucket) are partial.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field

from vt.shared.errors import UserError


class ResumeError(UserError, RuntimeError):
    """The window's progress record cannot be reconciled with its commits; the message says why."""


def shards_digest(shards: list[str]) -> str:
    """Identity of a rank's raw shard list: indices in a progress record refer to it."""
    return hashlib.sha256(json.dumps(shards).encode()).hexdigest()[:16]


def _to_ranges(indices: set[int]) -> list[list[int]]:
    ranges: list[list[int]] = []
    for i in sorted(indices):
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ranges


def _from_ranges(ranges: list[list[int]]) -> set[int]:
    return {i for first, last in ranges for i in range(first, last + 1)}


@dataclass
class StreamState:
    """Where a producer's stream stands in terms of committed samples (not of reading)."""

    epoch: int = 0
    complete: set[int] = field(default_factory=set)  # raw shard indices done in `epoch`
    partial: dict[int, set[str]] = field(default_factory=dict)  # raw index -> committed keys in `epoch`

    def to_json(self) -> dict:
        return {
            "epoch": self.epoch,
            "complete": _to_ranges(self.complete),
            "partial": {str(i): sorted(keys) for i, keys in sorted(self.partial.items())},
        }

    @classmethod
    def from_json(cls, obj: dict) -> "StreamState":
        return cls(
            obj["epoch"], _from_ranges(obj["complete"]), {int(i): set(keys) for i, keys in obj["partial"].items()}
        )

    def copy(self) -> "StreamState":
        return StreamState(self.epoch, set(self.complete), {i: set(k) for i, k in self.partial.items()})

    def committed(self, shard: int, key: str) -> bool:
        return shard in self.complete or key in self.partial.get(shard, ())

    def is_empty(self) -> bool:
        """True for a stream nothing was done in yet (first epoch, no raw shard handled)."""
        return self.epoch == 0 and not self.complete and not self.partial


class Tracker:
    """Follows the stream as the service runs it and answers "what is committed" at each commit."""

    def __init__(self, state: StreamState):
        self.state = state
        self.buffered: Counter = Counter()  # raw index -> accepted samples not committed yet
        self.read_to_end: set[int] = set()

    def start_epoch(self, epoch: int) -> None:
        if epoch != self.state.epoch:
            self.state = StreamState(epoch)
        self.buffered.clear()
        self.read_to_end.clear()

    def accepted(self, shard: int) -> None:
        self.buffered[shard] += 1

    def end_of_shard(self, shard: int) -> None:
        self.read_to_end.add(shard)
        self._maybe_complete(self.state, self.buffered, shard)

    def with_commit(self, samples: list[tuple[int, str]]) -> tuple[StreamState, Counter]:
        """(state, buffered) as they will be once the shard holding `samples` (raw index, key) is committed."""
        state, buffered = self.state.copy(), self.buffered.copy()
        for shard, key in samples:
            state.partial.setdefault(shard, set()).add(key)
            buffered[shard] -= 1
        for shard in {shard for shard, _ in samples}:
            self._maybe_complete(state, buffered, shard)
        return state, buffered

    def intent(self, seq: int, samples: list[tuple[int, str]], shards: str, generation: int) -> dict:
        """The progress record to store before committing shard `seq` (see the module docstring)."""
        after, _ = self.with_commit(samples)
        return {
            "seq": seq,
            "keys": sorted(key for _, key in samples),
            "shards": shards,
            "generation": generation,
            "before": self.state.to_json(),
            "after": after.to_json(),
        }

    def committed(self, samples: list[tuple[int, str]]) -> None:
        self.state, self.buffered = self.with_commit(samples)

    def _maybe_complete(self, state: StreamState, buffered: Counter, shard: int) -> None:
        if shard in self.read_to_end and buffered[shard] <= 0:
            state.complete.add(shard)
            state.partial.pop(shard, None)


def resume_state(window, rank: int, shards: str) -> tuple[StreamState, int]:
    """(state, next seq) for a restarted producer of `rank`, from its progress records and commits.

    The newest progress record normally decides. Only when two producers of one rank overlapped can
    the newest one describe a shard that another generation committed; then its keys do not match
    the record, and the newest consistent older generation is used instead.
    """
    next_seq = window.next_seq(rank)
    records = window.read_progress(rank)
    if not records:
        if next_seq:
            raise ResumeError(
                f"{window.uri} holds {next_seq} shards of producer {rank} but no progress record for it, "
                "so a restart cannot tell which samples they hold; it was written by an older vt or the "
                "progress/ folder was removed. Precompute into a fresh window (window.uri)"
            )
        return StreamState(), 0
    for _generation, intent in records:
        if intent["shards"] != shards:
            raise ResumeError(
                f"producer {rank}'s raw shard list changed since it wrote into {window.uri} (data.raw now "
                "lists other tars), so its progress no longer applies. Restore data.raw or precompute "
                "into a fresh window"
            )
        seq = intent["seq"]
        if seq == next_seq:  # written before a commit that never happened
            return StreamState.from_json(intent["before"]), next_seq
        if seq == next_seq - 1:
            record = window.record(rank, seq)
            if record is None or sorted(record.keys) == intent["keys"]:  # evicted, or the matching commit
                return StreamState.from_json(intent["after"]), next_seq
    raise ResumeError(
        f"producer {rank}'s progress records in {window.uri} do not match its commits (shard "
        f"{next_seq - 1} was committed by a producer whose progress is gone): two producers of one rank "
        "overlapped. Precompute into a fresh window"
    )
