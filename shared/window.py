"""The rolling shard window: the one contract between vt-precompute (producers) and vt-train.

Layout under the window URI (local folder or s3://bucket/prefix), explained in docs/architecture.md:

    data/p<rank>/<seq:08d>-g<gen>-<sha16>.safetensors  shard data, written first (atomically)
    commits/p<rank>/<seq:08d>.json       commit record, created exclusively once the data is complete
    producers/p<rank>.json               {"rank", "world_size", "size", "done", "num_shards", "fingerprint"}
    leases/p<rank>/<gen:08d>.json        one per producer start; the newest owns the rank (lease.py)
    progress/p<rank>/<gen:08d>.json      the producer's resume state, written before each commit
    consumer.json                        {"read": {rank: seq}, "watermark": {rank: seq}, + positions}
    text/validation-<fingerprint>/<key>.safetensors  a validation prompt's (or i2v image's) conditions as the
                                         family pipeline takes them: the trainer loads no text encoder
    text/empty-<fingerprint>.safetensors the empty caption's text conditions, once per window (caption
                                         dropout); the first producer's copy stays, never evicted

Why it is safe at every crash point:
- A reader trusts only commit records; data without one is invisible. Records are created
  exclusively and name their data file, whose name carries the writer's lease generation and
  sha256, so two writers of one seq never overwrite or delete each other's bytes, and any other
  data file of a committed seq is an orphan that may be deleted at any time.
- A re-run commit that finds its record already there with the same samples counts as done.
- Eviction deletes the records first, then the data: a crash in between leaves orphan data below
  the watermark, never a record without data. Everything below the watermark is known to be
  committed, so the bookkeeping (`next_seq`, the order) needs no record for it.

The fixed order: position i -> (rank, seq), round-robin over ranks by seq, rank-major within a
round: (p0,0),(p1,0),(p0,1),(p1,1)... A slot is skipped once its producer is done with fewer
shards; otherwise the reader waits for its record. So the order depends only on what was
committed, never on timing, and each rank's share of any prefix is known: consumer positions are
stored per producer (next unread / unevicted seq), backpressure and eviction compare seqs per
producer, and a restart of either side recomputes everything from storage alone.

Backpressure: producer `rank` waits while its committed-unread shards reach its share
max(1, size // world_size). `size="keep"` never evicts and never waits. One trainer process
(rank 0) writes consumer.json; producers only read it.

Fault points (vt.shared.faults): window.commit.after_data, window.commit.after_record,
window.evict.mid (records deleted, data not yet), window.publish_read, window.publish_watermark.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from typing import Iterator

from . import lease
from .faults import fault_point
from .lease import ProducerFenced
from .shards import CommitRecord, read_shard_metadata
from .storage import Storage

__all__ = ["CONSUMER", "ProducerConflict", "ProducerFenced", "ShardCorruptError", "Window", "WindowTimeout",
           "commit_path", "data_path", "empty_caption_path", "producer_path", "seq_of", "validation_key",
           "validation_path"]

log = logging.getLogger("vt.window")

CONSUMER = "consumer.json"
_SEQ = re.compile(r"(\d+)")


class WindowTimeout(TimeoutError):
    """A producer or reader waited longer than window.timeout_seconds for the other side."""


class ShardCorruptError(ValueError):
    """A committed shard's data does not match its commit record (size or sha256)."""


class ProducerConflict(RuntimeError):
    """A commit record for this seq already exists with other content: two producers of one rank."""


def data_path(rank: int, seq: int, sha256: str, generation: int = 0) -> str:
    """Named by seq, writer generation and content: two writers never share a name, so neither can
    overwrite or delete the other's bytes."""
    return f"data/p{rank}/{seq:08d}-g{generation}-{sha256[:16]}.safetensors"


def commit_path(rank: int, seq: int) -> str:
    return f"commits/p{rank}/{seq:08d}.json"


def empty_caption_path(fingerprint: str) -> str:
    return f"text/empty-{fingerprint}.safetensors"


def validation_path(fingerprint: str, key: str) -> str:
    """A validation prompt's (or i2v image's) encoded conditions for shards of `fingerprint`; `key` names
    the content (`validation_key`)."""
    return f"text/validation-{fingerprint}/{key}.safetensors"


def validation_key(kind: str, content: bytes) -> str:
    """"prompt-<sha256 of the text>" or "image-<sha256 of the file>", shortened: the same input, the same key."""
    return f"{kind}-{hashlib.sha256(content).hexdigest()[:16]}"


def producer_path(rank: int) -> str:
    return f"producers/p{rank}.json"


def seq_of(rel: str) -> int:
    """The seq in a data or record path ("data/p0/00000003-ab...safetensors" -> 3)."""
    return int(_SEQ.match(rel.rsplit("/", 1)[-1]).group(1))


def _seqs(paths: list[str]) -> set[int]:
    return {seq_of(p) for p in paths}


def _identity(record: CommitRecord) -> tuple:
    """What makes two commits of one seq the same shard: its samples, bucket, epoch and settings.

    Not the bytes: safetensors writes its metadata in hash-map order, so re-encoding the same
    tensors can give another sha256.
    """
    return record.producer, record.seq, record.epoch, record.bucket, tuple(record.keys), record.fingerprint


class _NotYet(Exception):
    """A slot of the order cannot be resolved yet: neither its record nor a done marker exists."""


class Window:
    """Producer and consumer side of one shard window; cheap to construct, holds no lock."""

    def __init__(self, uri: str, size: int | str = 8, poll_seconds: float = 0.2,
                 timeout_seconds: float = 1800.0, storage: Storage | None = None):
        if size != "keep" and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise ValueError(f"window.size must be a positive integer or \"keep\", got {size!r}")
        if poll_seconds <= 0 or timeout_seconds <= 0:
            raise ValueError("window.poll_seconds and window.timeout_seconds must be positive")
        self.storage = storage or Storage(uri)
        self.uri = uri
        self.size = size
        self.keep = size == "keep"
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        self._expected: dict[int, int] = {}  # rank -> seq this process commits next
        self._generation: dict[int, int] = {}  # rank -> lease generation this process holds
        self._leftovers: dict[int, dict[int, list[str]]] = {}  # rank -> seq -> uncommitted data found at start
        # (rank, seq) of every position resolved so far: a resolved slot never changes, so walks of the
        # order (publish_read per shard, order(start) on resume) replay it instead of starting over
        self._resolved: list[tuple[int, int]] = []

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
    def acquire(self, rank: int) -> int:
        """Take over producer `rank` (a new lease generation); an older producer of it stops at its next commit."""
        self._generation[rank] = lease.acquire(self.storage, rank)
        self._expected.pop(rank, None)
        return self._generation[rank]

    def _check_lease(self, rank: int) -> None:
        if rank in self._generation:
            lease.check(self.storage, rank, self._generation[rank])

    def register_producer(self, rank: int, world_size: int, fingerprint: str | None = None) -> bool:
        """Announce producer `rank` of `world_size` (the reader's order needs it) and its window size
        (for `state()`; each start rewrites it, so a restart with another size shows).

        Returns False if this rank already finished (its done marker is there): nothing left to do.
        """
        if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            raise ValueError(f"producer rank {rank} / world size {world_size}: need 0 <= rank < world_size")
        known = self.world_size()
        if known is not None and known != world_size:
            raise ValueError(f"{self.uri} was written by {known} producers; the fixed order depends on "
                             f"that, so run vt-precompute with world size {known} or use a fresh window")
        current = self._producer(rank)
        if current is not None and current.get("done"):
            log.info("producer %d of %s is already done with %d shards", rank, self.uri, current["num_shards"])
            return False
        if current is not None and current.get("fingerprint") not in (None, fingerprint) and self.next_seq(rank):
            raise ValueError(f"{self.uri} holds shards of producer {rank} made with other settings (fingerprint "
                             f"{current['fingerprint']}, now {fingerprint}): a restart must continue with the same "
                             "config, model and vt version. Restore them, or precompute into a fresh window.uri")
        self._check_lease(rank)
        info = {"rank": rank, "world_size": world_size, "size": self.size, "done": False, "num_shards": None,
                "fingerprint": fingerprint, "generation": self._generation.get(rank)}
        self.storage.put_atomic(producer_path(rank), json.dumps(info).encode())
        return True

    def wait_for_room(self, rank: int) -> tuple[int, int]:
        """Block while this producer's committed-unread shards fill its share of the window.

        Evicts this rank's shards below the watermark while waiting (the trainer may be gone).
        Returns (unread, share) at the moment there was room: the producer's window fill.
        """
        if self.keep:
            return 0, 0
        info = self._producer(rank)
        if info is None:
            raise RuntimeError(f"producer {rank} is not registered in {self.uri}; call register_producer first")
        share = max(1, self.size // info["world_size"])
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            consumer = self._consumer()
            unread = self.next_seq(rank, consumer) - consumer["read"].get(rank, 0)
            if unread < share:
                return unread, share
            self.evict(rank)
            if time.monotonic() > deadline:
                raise WindowTimeout(
                    f"producer {rank}: {unread} committed shards in {self.uri} are unread (its share of "
                    f"window.size={self.size} is {share}) after {self.timeout_seconds:.0f}s; is vt-train "
                    "running and reading this window? Raise window.timeout_seconds or use size='keep'")
            time.sleep(self.poll_seconds)

    def prepare(self, rank: int, seq: int, epoch: int, data: bytes, bucket: str, keys: list[str],
                fingerprint: str) -> CommitRecord:
        """The commit record `data` will get as shard `seq` of `rank`; checks lease, order and format."""
        self._check_lease(rank)
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
        sha256 = hashlib.sha256(data).hexdigest()
        return CommitRecord(producer=rank, seq=seq, epoch=epoch, bucket=bucket, keys=list(keys),
                            data=data_path(rank, seq, sha256, self._generation.get(rank, 0)),
                            nbytes=len(data), sha256=sha256,
                            fingerprint=fingerprint)

    def publish(self, record: CommitRecord, data: bytes) -> CommitRecord:
        """Write the shard data fully, then create its commit record exclusively (visible from then)."""
        rank, seq = record.producer, record.seq
        self.storage.put_atomic(record.data, data)
        fault_point("window.commit.after_data")
        try:
            self._check_lease(rank)
        except ProducerFenced:
            existing = self.record(rank, seq)
            if existing is None or existing.data != record.data:
                self.storage.delete(record.data)  # nobody will ever name these bytes
            raise
        if not self.storage.create_exclusive(commit_path(rank, seq), record.to_json()):
            existing = self.record(rank, seq)
            if existing is None or _identity(existing) != _identity(record):
                if existing is None or existing.data != record.data:
                    self.storage.delete(record.data)  # ours is the orphan: the record names other bytes
                raise ProducerConflict(
                    f"commit record {commit_path(rank, seq)} already exists in {self.uri} with other "
                    f"content: two producers are writing as rank {rank}. Run exactly one producer per "
                    "rank (torchrun gives each its own RANK), then restart this one: it resumes after "
                    "the shards already committed")
            if existing.data != record.data:
                self.storage.delete(record.data)  # same samples, other bytes (safetensors header order)
            log.info("shard %d of producer %d was already committed with the same samples", seq, rank)
            record = existing
        fault_point("window.commit.after_record")
        self._expected[rank] = seq + 1
        for rel in self._leftovers.get(rank, {}).pop(seq, []):
            if rel != record.data:
                self.storage.delete(rel)  # an earlier run's uncommitted bytes for this seq
        return record

    def commit(self, rank: int, seq: int, epoch: int, data: bytes, bucket: str, keys: list[str],
               fingerprint: str) -> CommitRecord:
        """prepare + publish: the shard is visible when this returns."""
        return self.publish(self.prepare(rank, seq, epoch, data, bucket, keys, fingerprint), data)

    def write_progress(self, rank: int, payload: dict) -> None:
        """Store this producer's resume state (under its lease generation); see precompute/resume.py."""
        if rank not in self._generation:
            raise RuntimeError(f"producer {rank} holds no lease in {self.uri}; call acquire({rank}) first")
        lease.write_progress(self.storage, rank, self._generation[rank], payload)

    def read_progress(self, rank: int) -> list[tuple[int, dict]]:
        """(generation, payload) of every stored resume state of `rank`, newest generation first."""
        return lease.read_progress(self.storage, rank)

    def put_empty_caption(self, fingerprint: str, data: bytes) -> bool:
        """Store the empty caption's shard-format text conditions for shards of `fingerprint`, once per
        window: every producer offers its copy before its first commit and the first one stays."""
        return self.storage.create_exclusive(empty_caption_path(fingerprint), data)

    def put_validation(self, fingerprint: str, key: str, data: bytes) -> bool:
        """Store one validation input's conditions (safetensors) for shards of `fingerprint`, once: the
        first writer's copy stays (every producer offers them before its first commit)."""
        return self.storage.create_exclusive(validation_path(fingerprint, key), data)

    def validation(self, fingerprint: str, key: str) -> bytes | None:
        """The stored conditions of validation input `key` (see put_validation), None if there are none."""
        try:
            return self.storage.read(validation_path(fingerprint, key))
        except FileNotFoundError:
            return None

    def empty_caption(self, fingerprint: str) -> bytes:
        """The stored empty caption of shards made with `fingerprint` (see put_empty_caption)."""
        try:
            return self.storage.read(empty_caption_path(fingerprint))
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{self.uri} holds no empty caption for shards {fingerprint}: it was made before caption "
                "dropout existed; re-run vt-precompute into a fresh window, or set train.caption_dropout = 0") from None

    def finish_producer(self, rank: int, num_shards: int) -> None:
        """Done marker: this rank's shards are seqs 0..num_shards-1; the reader stops waiting on it."""
        info = self._producer(rank)
        if info is None:
            raise RuntimeError(f"producer {rank} is not registered in {self.uri}; call register_producer first")
        committed = self.next_seq(rank)
        if committed != num_shards:
            raise ValueError(f"producer {rank} says it wrote {num_shards} shards but {self.uri} has "
                             f"seqs 0..{committed - 1} committed; finish with num_shards={committed}")
        self._check_lease(rank)
        self.clean_orphans(rank, beyond=num_shards)
        info.update(done=True, num_shards=num_shards)
        self.storage.put_atomic(producer_path(rank), json.dumps(info).encode())

    def clean_orphans(self, rank: int, beyond: int | None = None) -> list[str]:
        """Delete `rank`'s data that no record can ever name; run by that rank's producer.

        Safe even beside a live writer: other data files of a committed seq than the one its record
        names, data below the watermark whose record is gone (a killed eviction), temp files of dead
        writers and stale multipart uploads. Data of a seq not committed yet may be a live writer's
        next shard: it is kept, and deleted when that seq is committed (or, with `beyond`, when no
        seq from there on will be). Reads a record only for a seq with more than one data file.
        """
        removed = self.storage.clean_incomplete(f"data/p{rank}") + self.storage.clean_incomplete(f"commits/p{rank}")
        floor = self._consumer()["watermark"].get(rank, 0)
        committed = _seqs(self.storage.list(f"commits/p{rank}"))
        files: dict[int, list[str]] = {}
        for rel in self.storage.list(f"data/p{rank}"):
            files.setdefault(seq_of(rel), []).append(rel)
        leftovers: dict[int, list[str]] = {}
        for seq, rels in sorted(files.items()):
            if seq in committed:
                record = self.record(rank, seq) if len(rels) > 1 else None
                doomed = [rel for rel in rels if record is not None and rel != record.data]
            elif seq < floor or (beyond is not None and seq >= beyond):
                doomed = rels
            else:
                leftovers[seq], doomed = rels, []
            for rel in doomed:
                self.storage.delete(rel)
                removed.append(rel)
        self._leftovers[rank] = leftovers
        if removed:
            log.info("removed %d orphan files of producer %d from %s", len(removed), rank, self.uri)
        return removed

    # -- consumer side ---------------------------------------------------------------------------
    def _slots(self, block: bool) -> Iterator[tuple[int, int, int]]:
        """(position, rank, seq) of the fixed order. block=False raises _NotYet instead of waiting."""
        position = 0
        while position < len(self._resolved):
            rank, seq = self._resolved[position]
            yield position, rank, seq
            position += 1
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

        # Resolve on from the slot after the last known one.
        first_seq, first_rank = (self._resolved[-1][1], self._resolved[-1][0] + 1) if self._resolved else (0, 0)
        seq = first_seq
        while not (len(done) == world and seq >= max(done.values())):
            for rank in range(first_rank if seq == first_seq else 0, world):
                what = f"producer {rank} shard {seq} ({commit_path(rank, seq)}) or its done marker"
                if self._wait(lambda: resolve(rank, seq), block, what):
                    if position == len(self._resolved):
                        self._resolved.append((rank, seq))
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
        fault_point("window.publish_read")

    def publish_watermark(self, position: int) -> None:
        """After a checkpoint: positions < `position` may be evicted. Never moves back."""
        consumer = self._consumer()
        if position <= consumer["watermark_position"]:
            return
        consumer.update(watermark=self._seqs_at(position), watermark_position=position)
        self._write_consumer(consumer)
        fault_point("window.publish_watermark")

    def evict(self, rank: int | None = None) -> list[str]:
        """Delete shards below the watermark (all ranks, or one): records first, then data."""
        if self.keep:
            return []
        watermark = self._consumer()["watermark"]
        deleted = []
        for k in sorted(watermark if rank is None else [rank]):
            floor = watermark.get(k, 0)
            records = [r for r in self.storage.list(f"commits/p{k}") if seq_of(r) < floor]
            for rel in records:
                self.storage.delete(rel)
                deleted.append(rel)
            if records:
                fault_point("window.evict.mid")  # records gone, data still there: orphans, never dangling records
            data = [r for r in self.storage.list(f"data/p{k}") if seq_of(r) < floor]
            for rel in data:
                self.storage.delete(rel)
                deleted.append(rel)
        if deleted:
            log.debug("evicted %d files below the watermark from %s", len(deleted), self.uri)
        return deleted

    def state(self) -> dict:
        """Producers, committed, read, watermark, evicted, bytes, buckets, fingerprints, orphans
        (see window_state.py; reads every present record)."""
        from .window_state import window_state

        return window_state(self)
