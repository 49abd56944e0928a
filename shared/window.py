"""The rolling shard window: the one contract between vt-precompute (producers) and vt-train.

Layout under the window URI (local folder or s3://bucket/prefix):

    data/p<rank>/<seq:08d>.safetensors   shard data, written first (atomically)
    commits/p<rank>/<seq:08d>.json       commit record, created exclusively once the data is complete
    producers/p<rank>.json               {"rank", "world_size", "done", "num_shards"}
    consumer.json                        {"read": {rank: seq}, "watermark": {rank: seq}, + positions}

Why it is safe at every crash point:
- A reader trusts only commit records. Data without a record (a producer killed between the two
  writes) is invisible; `clean_orphans` deletes it when that producer restarts at `next_seq`.
- Eviction deletes the record first, then the data, so a crash mid-eviction leaves at worst an
  orphan data file, never a visible record whose data is gone. Evicted seqs are below the
  watermark, and everything below the watermark is known to have been committed, so the
  bookkeeping (`next_seq`, the order) needs no record for them.

The fixed order: position i -> (rank, seq), round-robin over ranks by seq, rank-major within a
round: (p0,0),(p1,0),(p0,1),(p1,1)... A slot (rank, seq) is skipped once that producer is done
with fewer than seq+1 shards; otherwise the reader waits for its record. So the order depends only
on what was committed, never on timing, and each rank's share of any prefix of the order is
known. That is why consumer positions are stored per producer (the next unread / unevicted seq):
backpressure and eviction are then per-producer comparisons of seqs, and a restart of either side
recomputes everything from storage alone.

Backpressure: producer `rank` waits while its committed-unread shards reach its share
max(1, size // world_size), so storage holds at most `size` unread shards (world_size if that is
larger) plus one being written per producer. `size="keep"` never evicts and never waits.
One trainer process (rank 0) writes consumer.json; producers only read it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Iterator

from .shards import CommitRecord, read_shard_metadata
from .storage import Storage

log = logging.getLogger("vt.window")

CONSUMER = "consumer.json"


class WindowTimeout(TimeoutError):
    """A producer or reader waited longer than window.timeout_seconds for the other side."""


class ShardCorruptError(ValueError):
    """A committed shard's data does not match its commit record (size or sha256)."""


def data_path(rank: int, seq: int) -> str:
    return f"data/p{rank}/{seq:08d}.safetensors"


def commit_path(rank: int, seq: int) -> str:
    return f"commits/p{rank}/{seq:08d}.json"


def producer_path(rank: int) -> str:
    return f"producers/p{rank}.json"


def _seqs(paths: list[str]) -> set[int]:
    return {int(p.rsplit("/", 1)[-1].split(".", 1)[0]) for p in paths}


class _NotYet(Exception):
    """A slot of the order cannot be resolved yet: neither its record nor a done marker exists."""


class Window:
    """Producer and consumer side of one shard window; cheap to construct, holds no lock."""

    def __init__(self, uri: str, size: int | str = 8, poll_seconds: float = 0.2,
                 timeout_seconds: float = 1800.0):
        if size != "keep" and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise ValueError(f"window.size must be a positive integer or \"keep\", got {size!r}")
        if poll_seconds <= 0 or timeout_seconds <= 0:
            raise ValueError("window.poll_seconds and window.timeout_seconds must be positive")
        self.storage = Storage(uri)
        self.uri = uri
        self.size = size
        self.keep = size == "keep"
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        self._expected: dict[int, int] = {}  # rank -> seq this process commits next

    def __repr__(self) -> str:
        return f"Window({self.uri!r}, size={self.size!r})"

    # -- shared bookkeeping ----------------------------------------------------------------------
    def _producers(self) -> dict[int, dict]:
        out = {}
        for rel in self.storage.list("producers"):
            info = json.loads(self.storage.read(rel))
            out[int(info["rank"])] = info
        return out

    def _producer(self, rank: int) -> dict | None:
        try:
            return json.loads(self.storage.read(producer_path(rank)))
        except FileNotFoundError:
            return None

    def world_size(self) -> int | None:
        """The producers' world size from their registrations (None before any registered)."""
        sizes = {info["world_size"] for info in self._producers().values()}
        if len(sizes) > 1:
            raise RuntimeError(f"producers of {self.uri} registered different world sizes {sorted(sizes)}; "
                               "all ranks of one vt-precompute run must agree; use a fresh window")
        return sizes.pop() if sizes else None

    def _consumer(self) -> dict:
        try:
            state = json.loads(self.storage.read(CONSUMER))
        except FileNotFoundError:
            state = {}
        return {"read": {int(k): v for k, v in state.get("read", {}).items()},
                "watermark": {int(k): v for k, v in state.get("watermark", {}).items()},
                "read_position": state.get("read_position", 0),
                "watermark_position": state.get("watermark_position", 0)}

    def next_seq(self, rank: int, consumer: dict | None = None) -> int:
        """First seq of `rank` with no commit record: where a restarted producer resumes.

        Seqs below this rank's watermark were committed even if eviction removed their records.
        """
        consumer = consumer if consumer is not None else self._consumer()
        committed = _seqs(self.storage.list(f"commits/p{rank}"))
        seq = consumer["watermark"].get(rank, 0)
        while seq in committed:
            seq += 1
        return seq

    # -- producer side ---------------------------------------------------------------------------
    def register_producer(self, rank: int, world_size: int) -> None:
        """Announce producer `rank` of `world_size`; the reader's order needs the world size."""
        if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            raise ValueError(f"producer rank {rank} / world size {world_size}: need 0 <= rank < world_size")
        known = self.world_size()
        if known is not None and known != world_size:
            raise ValueError(f"{self.uri} was written by {known} producers; the fixed order depends on "
                             f"that, so run vt-precompute with world size {known} or use a fresh window")
        current = self._producer(rank)
        if current is not None and current.get("done"):
            log.info("producer %d of %s is already done with %d shards", rank, self.uri, current["num_shards"])
            return
        info = {"rank": rank, "world_size": world_size, "done": False, "num_shards": None}
        self.storage.put_atomic(producer_path(rank), json.dumps(info).encode())

    def wait_for_room(self, rank: int) -> None:
        """Block while this producer's committed-unread shards fill its share of the window.

        Evicts this rank's shards below the watermark while waiting (the trainer may be gone).
        """
        if self.keep:
            return
        info = self._producer(rank)
        if info is None:
            raise RuntimeError(f"producer {rank} is not registered in {self.uri}; call register_producer first")
        share = max(1, self.size // info["world_size"])
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            consumer = self._consumer()
            unread = self.next_seq(rank, consumer) - consumer["read"].get(rank, 0)
            if unread < share:
                return
            self.evict(rank)
            if time.monotonic() > deadline:
                raise WindowTimeout(
                    f"producer {rank}: {unread} committed shards in {self.uri} are unread (its share of "
                    f"window.size={self.size} is {share}) after {self.timeout_seconds:.0f}s; is vt-train "
                    "running and reading this window? Raise window.timeout_seconds or use size='keep'")
            time.sleep(self.poll_seconds)

    def commit(self, rank: int, seq: int, epoch: int, data: bytes, bucket: str, keys: list[str],
               fingerprint: str) -> CommitRecord:
        """Write the shard data fully, then create its commit record exclusively (visible from then)."""
        expected = self._expected.get(rank)
        if expected is None:
            info = self._producer(rank)
            if info is not None and info.get("done"):
                raise RuntimeError(f"producer {rank} of {self.uri} already finished with "
                                   f"{info['num_shards']} shards; use a fresh window for a new run")
            expected = self.next_seq(rank)
        if seq != expected:
            raise ValueError(f"producer {rank} must commit seq {expected} next, got {seq}: seqs are "
                             "contiguous so the reader never waits on a gap; a restarted producer "
                             "resumes at Window.next_seq(rank)")
        read_shard_metadata(data)  # refuse bytes that are not a shard before they become visible
        record = CommitRecord(producer=rank, seq=seq, epoch=epoch, bucket=bucket, keys=list(keys),
                              data=data_path(rank, seq), nbytes=len(data),
                              sha256=hashlib.sha256(data).hexdigest(), fingerprint=fingerprint)
        self.storage.put_atomic(record.data, data)
        if not self.storage.create_exclusive(commit_path(rank, seq), record.to_json()):
            raise RuntimeError(f"commit record {commit_path(rank, seq)} already exists in {self.uri}: "
                               f"two producers are writing as rank {rank}; give each a distinct rank")
        self._expected[rank] = seq + 1
        return record

    def finish_producer(self, rank: int, num_shards: int) -> None:
        """Done marker: this rank's shards are seqs 0..num_shards-1; the reader stops waiting on it."""
        info = self._producer(rank)
        if info is None:
            raise RuntimeError(f"producer {rank} is not registered in {self.uri}; call register_producer first")
        committed = self.next_seq(rank)
        if committed != num_shards:
            raise ValueError(f"producer {rank} says it wrote {num_shards} shards but {self.uri} has "
                             f"seqs 0..{committed - 1} committed; finish with num_shards={committed}")
        info.update(done=True, num_shards=num_shards)
        self.storage.put_atomic(producer_path(rank), json.dumps(info).encode())

    def clean_orphans(self, rank: int) -> list[str]:
        """Delete data files of `rank` that have no commit record. Only while that rank is not writing."""
        committed = _seqs(self.storage.list(f"commits/p{rank}"))
        orphans = [rel for rel in self.storage.list(f"data/p{rank}") if _seqs([rel]).pop() not in committed]
        for rel in orphans:
            self.storage.delete(rel)
        if orphans:
            log.info("removed %d orphan data files of producer %d from %s", len(orphans), rank, self.uri)
        return orphans

    # -- consumer side ---------------------------------------------------------------------------
    def _slots(self, block: bool) -> Iterator[tuple[int, int, int]]:
        """(position, rank, seq) of the fixed order. block=False raises _NotYet instead of waiting."""
        world = self._wait(self.world_size, block, "a producer registration")
        committed = {k: 0 for k in range(world)}  # all seqs below are committed (monotonic)
        done: dict[int, int] = {}  # rank -> num_shards once its done marker is seen

        def resolve(rank: int, seq: int) -> bool | None:
            if rank in done and seq >= done[rank]:
                return False
            if seq < committed[rank]:
                return True
            info = self._producer(rank)  # done marker first: commits never follow it
            if info is not None and info.get("done"):
                done[rank] = info["num_shards"]
            committed[rank] = self.next_seq(rank)
            if rank in done and seq >= done[rank]:
                return False
            return True if seq < committed[rank] else None

        position, seq = 0, 0
        while not (len(done) == world and seq >= max(done.values())):
            for rank in range(world):
                what = f"producer {rank} shard {seq} ({commit_path(rank, seq)}) or its done marker"
                if self._wait(lambda: resolve(rank, seq), block, what):
                    yield position, rank, seq
                    position += 1
            seq += 1

    def _wait(self, probe, block: bool, what: str):
        """Poll `probe()` until it is not None; WindowTimeout after timeout_seconds."""
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            value = probe()
            if value is not None:
                return value
            if not block:
                raise _NotYet(what)
            if time.monotonic() > deadline:
                raise WindowTimeout(f"waited {self.timeout_seconds:.0f}s in {self.uri} for {what}; "
                                    "is vt-precompute running for that rank?")
            time.sleep(self.poll_seconds)

    def order(self, start: int = 0) -> Iterator[tuple[int, CommitRecord]]:
        """(position, record) in the fixed order from `start`; ends when every producer is done."""
        for position, rank, seq in self._slots(block=True):
            if position < start:
                continue
            try:
                record = CommitRecord.from_json(self.storage.read(commit_path(rank, seq)))
            except FileNotFoundError:
                raise RuntimeError(
                    f"position {position} (producer {rank} shard {seq}) was evicted from {self.uri}: "
                    "the watermark is past it. Resume from the newest checkpoint, or use "
                    "window.size='keep' to read a window more than once") from None
            yield position, record

    def record(self, rank: int, seq: int) -> CommitRecord | None:
        """The commit record of (rank, seq), or None if it is not committed (or was evicted)."""
        try:
            return CommitRecord.from_json(self.storage.read(commit_path(rank, seq)))
        except FileNotFoundError:
            return None

    def read_shard(self, record: CommitRecord) -> bytes:
        """The data bytes of a committed shard, checked against the record's size and sha256."""
        try:
            data = self.storage.read(record.data)
        except FileNotFoundError:
            raise ShardCorruptError(f"{record.data} is missing from {self.uri} although it is committed: "
                                    "evicted while being read, or deleted by hand") from None
        if len(data) != record.nbytes:
            raise ShardCorruptError(f"{record.data} in {self.uri} is {len(data)} bytes but its commit "
                                    f"record says {record.nbytes}: changed or truncated after commit; "
                                    "re-run vt-precompute into a fresh window")
        digest = hashlib.sha256(data).hexdigest()
        if digest != record.sha256:
            raise ShardCorruptError(f"{record.data} in {self.uri} has sha256 {digest[:12]}... but its "
                                    f"commit record says {record.sha256[:12]}...: changed after commit; "
                                    "re-run vt-precompute into a fresh window")
        return data

    def _seqs_at(self, position: int) -> dict[int, int]:
        """Per producer, how many of its shards lie below `position` in the fixed order."""
        if position < 0:
            raise ValueError(f"positions start at 0, got {position}")
        if position == 0:
            return {}
        counts: dict[int, int] = {}
        try:
            for pos, rank, seq in self._slots(block=False):
                counts[rank] = seq + 1
                if pos + 1 == position:
                    return counts
        except _NotYet:
            pass
        raise ValueError(f"position {position} is past the shards committed to {self.uri} so far; "
                         "publish only positions the reader has reached")

    def _write_consumer(self, consumer: dict) -> None:
        self.storage.put_atomic(CONSUMER, json.dumps(consumer, sort_keys=True).encode())

    def publish_read(self, position: int) -> None:
        """Positions < `position` have been read (drives backpressure). Single writer: trainer rank 0."""
        consumer = self._consumer()
        consumer.update(read=self._seqs_at(position), read_position=position)
        self._write_consumer(consumer)

    def publish_watermark(self, position: int) -> None:
        """After a checkpoint: positions < `position` may be evicted. Never moves back."""
        consumer = self._consumer()
        if position <= consumer["watermark_position"]:
            return
        consumer.update(watermark=self._seqs_at(position), watermark_position=position)
        self._write_consumer(consumer)

    def evict(self, rank: int | None = None) -> list[str]:
        """Delete shards below the watermark (all ranks, or one): record first, then data."""
        if self.keep:
            return []
        watermark = self._consumer()["watermark"]
        deleted = []
        for k in sorted(watermark if rank is None else [rank]):
            floor = watermark.get(k, 0)
            records = [r for r in self.storage.list(f"commits/p{k}") if _seqs([r]).pop() < floor]
            for rel in records:
                self.storage.delete(rel)
                deleted.append(rel)
            data = [r for r in self.storage.list(f"data/p{k}") if _seqs([r]).pop() < floor]
            for rel in data:  # after all records: a crash in between leaves orphans, not dangling records
                self.storage.delete(rel)
                deleted.append(rel)
        if deleted:
            log.debug("evicted %d files below the watermark from %s", len(deleted), self.uri)
        return deleted

    def state(self) -> dict:
        """Producers, committed, read, watermark, evicted count and bytes, for reports and inspect."""
        consumer = self._consumer()
        records = self.storage.list("commits")
        producers = {}
        for rank, info in sorted(self._producers().items()):
            committed = self.next_seq(rank, consumer)
            read = consumer["read"].get(rank, 0)
            producers[rank] = {"world_size": info["world_size"], "done": bool(info.get("done")),
                               "num_shards": info.get("num_shards"), "committed": committed,
                               "read": read, "unread": max(0, committed - read),
                               "watermark": consumer["watermark"].get(rank, 0)}
        present_below = sum(1 for rel in records
                            if _seqs([rel]).pop() < consumer["watermark"].get(int(rel.split("/")[1][1:]), 0))
        return {"uri": self.uri, "size": self.size, "world_size": self.world_size(),
                "producers": producers,
                "committed": sum(p["committed"] for p in producers.values()),
                "unread": sum(p["unread"] for p in producers.values()),
                "present": len(records),
                "read": consumer["read_position"], "watermark": consumer["watermark_position"],
                "evicted": sum(consumer["watermark"].values()) - present_below,
                "bytes": sum(self.storage.sizes("data").values())}
