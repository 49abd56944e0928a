"""The trainer's side of a window: the fixed order, checked shard reads, and the consumer's positions.

The fixed order: position i -> (rank, seq), round-robin over ranks by seq, rank-major within a
round: (p0,0),(p1,0),(p0,1),(p1,1)... A slot is skipped once its producer is done with fewer
shards; otherwise the reader waits for its record. So the order depends only on what was
committed, never on timing, and each rank's share of any prefix is known: consumer positions are
stored per producer (next unread / unevicted seq), backpressure and eviction compare seqs per
producer, and a restart of either side recomputes everything from storage alone.

One trainer process (rank 0) writes consumer.json (`publish_read`, `publish_watermark`); producers
only read it. Fault points: window.publish_read, window.publish_watermark.
"""

from __future__ import annotations

import hashlib
import time
from typing import Iterator

from ..faults import fault_point
from ..shards import CommitRecord
from ..storage import Storage
from . import ledger
from .layout import ShardCorruptError, WindowTimeout, commit_path, empty_caption_path, validation_path


class NotYet(Exception):
    """A slot of the order cannot be resolved yet: neither its record nor a done marker exists."""


class Reader:
    """Walks the fixed order; remembers every slot resolved so far (a resolved slot never changes)."""

    def __init__(self, storage: Storage, poll_seconds: float, timeout_seconds: float):
        self.storage = storage
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        # (rank, seq) of every position resolved so far: walks of the order (publish_read per shard,
        # order(start) on resume) replay it instead of starting over
        self.resolved: list[tuple[int, int]] = []
        # Called before each sleep while waiting for the next slot: the trainer's rank 0, the one reader
        # of the order, tells the other ranks it is still waiting (train/parallel/order.py)
        self.on_poll = None

    def slots(self, block: bool) -> Iterator[tuple[int, int, int]]:
        """(position, rank, seq) of the fixed order. block=False raises NotYet instead of waiting."""
        position = 0
        while position < len(self.resolved):
            rank, seq = self.resolved[position]
            yield position, rank, seq
            position += 1
        world = self.wait(lambda: ledger.world_size(self.storage), block, "a producer registration")
        committed = {k: 0 for k in range(world)}  # all seqs below are committed (monotonic)
        done: dict[int, int] = {}  # rank -> num_shards once its done marker is seen

        def resolve(rank: int, seq: int) -> bool | None:
            if rank in done and seq >= done[rank]:
                return False
            if seq < committed[rank]:
                return True
            info = ledger.producer(self.storage, rank)  # done marker first: commits never follow it
            if info is not None and info.get("done"):
                done[rank] = info["num_shards"]
            committed[rank] = ledger.next_seq(self.storage, rank)
            if rank in done and seq >= done[rank]:
                return False
            return True if seq < committed[rank] else None

        # Resolve on from the slot after the last known one.
        first_seq, first_rank = (self.resolved[-1][1], self.resolved[-1][0] + 1) if self.resolved else (0, 0)
        seq = first_seq
        while not (len(done) == world and seq >= max(done.values())):
            for rank in range(first_rank if seq == first_seq else 0, world):
                what = f"producer {rank} shard {seq} ({commit_path(rank, seq)}) or its done marker"
                if self.wait(lambda: resolve(rank, seq), block, what):
                    if position == len(self.resolved):
                        self.resolved.append((rank, seq))
                    yield position, rank, seq
                    position += 1
            seq += 1

    def wait(self, probe, block: bool, what: str):
        """Poll `probe()` until it is not None; WindowTimeout after timeout_seconds."""
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            value = probe()
            if value is not None:
                return value
            if not block:
                raise NotYet(what)
            if time.monotonic() > deadline:
                raise WindowTimeout(f"waited {self.timeout_seconds:.0f}s in {self.storage.uri} for {what}; "
                                    "is vt-precompute running for that rank?")
            if self.on_poll is not None:
                self.on_poll()
            time.sleep(self.poll_seconds)

    def order(self, start: int = 0) -> Iterator[tuple[int, CommitRecord]]:
        """(position, record) in the fixed order from `start`; ends when every producer is done."""
        for position, rank, seq in self.slots(block=True):
            if position < start:
                continue
            try:
                record = CommitRecord.from_json(self.storage.read(commit_path(rank, seq)))
            except FileNotFoundError:
                raise RuntimeError(
                    f"position {position} (producer {rank} shard {seq}) was evicted from {self.storage.uri}: "
                    "the watermark is past it. Resume from the newest checkpoint, or use "
                    "window.size='keep' to read a window more than once") from None
            yield position, record

    def read_shard(self, record: CommitRecord) -> bytes:
        """The data bytes of a committed shard, checked against the record's size and sha256."""
        uri = self.storage.uri
        try:
            data = self.storage.read(record.data)
        except FileNotFoundError:
            raise ShardCorruptError(f"{record.data} is missing from {uri} although it is committed: "
                                    "evicted while being read, or deleted by hand") from None
        if len(data) != record.nbytes:
            raise ShardCorruptError(f"{record.data} in {uri} is {len(data)} bytes but its commit "
                                    f"record says {record.nbytes}: changed or truncated after commit; "
                                    "re-run vt-precompute into a fresh window")
        digest = hashlib.sha256(data).hexdigest()
        if digest != record.sha256:
            raise ShardCorruptError(f"{record.data} in {uri} has sha256 {digest[:12]}... but its "
                                    f"commit record says {record.sha256[:12]}...: changed after commit; "
                                    "re-run vt-precompute into a fresh window")
        return data

    def validation(self, fingerprint: str, key: str) -> bytes | None:
        """The stored conditions of validation input `key`, None if there are none."""
        try:
            return self.storage.read(validation_path(fingerprint, key))
        except FileNotFoundError:
            return None

    def empty_caption(self, fingerprint: str) -> bytes:
        """The stored empty caption of shards made with `fingerprint`."""
        try:
            return self.storage.read(empty_caption_path(fingerprint))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.storage.uri} holds no empty caption for shards {fingerprint}: it was made before caption "
                "dropout existed; re-run vt-precompute into a fresh window, or set train.caption_dropout = 0") from None

    def seqs_at(self, position: int) -> dict[int, int]:
        """Per producer, how many of its shards lie below `position` in the fixed order."""
        if position < 0:
            raise ValueError(f"positions start at 0, got {position}")
        if position == 0:
            return {}
        counts: dict[int, int] = {}
        try:
            for pos, rank, seq in self.slots(block=False):
                counts[rank] = seq + 1
                if pos + 1 == position:
                    return counts
        except NotYet:
            pass
        raise ValueError(f"position {position} is past the shards committed to {self.storage.uri} so far; "
                         "publish only positions the reader has reached")

    def publish_read(self, position: int) -> None:
        """Positions < `position` have been read (drives backpressure). Single writer: trainer rank 0."""
        positions = ledger.consumer(self.storage)
        positions.update(read=self.seqs_at(position), read_position=position)
        ledger.write_consumer(self.storage, positions)
        fault_point("window.publish_read")

    def publish_watermark(self, position: int) -> None:
        """After a checkpoint: positions < `position` may be evicted. Never moves back."""
        positions = ledger.consumer(self.storage)
        if position <= positions["watermark_position"]:
            return
        positions.update(watermark=self.seqs_at(position), watermark_position=position)
        ledger.write_consumer(self.storage, positions)
        fault_point("window.publish_watermark")
