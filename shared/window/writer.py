"""The producer's side of a window: its lease, registration, backpressure and the two-step commit.

A shard becomes visible in two steps: its data is written fully (`put_atomic`, under a name carrying
the writer's lease generation and sha256), then its commit record is created exclusively. A reader
trusts only records, so data without one is invisible; two writers of one seq never overwrite or
delete each other's bytes; a re-run commit that finds its record already there with the same samples
counts as done.

Backpressure: producer `rank` waits while its committed-unread shards reach its share
max(1, size // world_size), evicting below the watermark meanwhile. `size="keep"` never waits.

Fault points (vt.shared.faults): window.commit.after_data, window.commit.after_record.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time

from vt.shared.errors import UserError

from .. import lease
from ..faults import fault_point
from ..lease import ProducerFenced
from ..shard_rows import header_size
from ..shards import CommitRecord, read_shard_metadata
from ..storage import Storage
from . import cleaning, ledger
from .layout import (
    ProducerConflict,
    WindowTimeout,
    commit_path,
    data_path,
    done_path,
    empty_caption_path,
    producer_path,
    validation_path,
)

log = logging.getLogger("vt.window")


def _identity(record: CommitRecord) -> tuple:
    """What makes two commits of one seq the same shard: its samples, bucket, epoch and settings.

    Not the bytes: safetensors writes its metadata in hash-map order, so re-encoding the same
    tensors can give another sha256.
    """
    return record.producer, record.seq, record.epoch, record.bucket, tuple(record.keys), record.fingerprint


class Writer(ledger.LedgerReads):
    """One process's producer ranks of a window (`open_writer`): the seq each commits next, the lease generation it
    holds, and the uncommitted data found at its start."""

    def __init__(self, storage: Storage, size: int | str, poll_seconds: float, timeout_seconds: float):
        self.storage = storage
        self.uri = storage.uri
        self.size = size
        self.keep = size == "keep"
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        self.expected: dict[int, int] = {}  # rank -> seq this process commits next
        self.generation: dict[int, int] = {}  # rank -> lease generation this process holds
        self.leftovers: dict[int, dict[int, list[str]]] = {}  # rank -> seq -> uncommitted data found at start

    def __repr__(self) -> str:
        return f"Writer({self.uri!r}, size={self.size!r})"

    def lanes(self, wanted: int, raw_shards: int | None = None) -> int:
        """The window's lane count: fixed by its first producer (`wanted`), the same for every later one."""
        return ledger.fix_lanes(self.storage, wanted, raw_shards)

    def read_progress(self, rank: int) -> list[tuple[int, dict]]:
        """(generation, payload) of every stored resume state of `rank`, newest generation first."""
        return lease.read_progress(self.storage, rank)

    def evict(self, rank: int | None = None) -> list[str]:
        """Shards below the watermark, deleted (never with size="keep"); see cleaning.evict."""
        return [] if self.keep else cleaning.evict(self.storage, rank)

    def acquire(self, rank: int) -> int:
        """Take over producer `rank` (a new lease generation); an older producer of it stops at its next commit."""
        self.generation[rank] = lease.acquire(self.storage, rank)
        self.expected.pop(rank, None)
        return self.generation[rank]

    def hold(self, rank: int, generation: int) -> None:
        """Write as lane `rank` under a lease generation this process claimed (precompute/lanes.py)."""
        self.generation[rank] = generation
        self.expected.pop(rank, None)

    def check_lease(self, rank: int) -> None:
        if rank in self.generation:
            lease.check(self.storage, rank, self.generation[rank])

    def register_producer(self, rank: int, world_size: int, fingerprint: str | None = None) -> bool:
        """Announce producer `rank` of `world_size` (the reader's order needs it) and its window size
        (for `state()`; each start rewrites it, so a restart with another size shows).

        Returns False if this rank already finished (its done marker is there): nothing left to do.
        """
        uri = self.storage.uri
        if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
            raise UserError(f"producer rank {rank} / world size {world_size}: need 0 <= rank < world_size")
        known = ledger.world_size(self.storage)
        if known is not None and known != world_size:
            raise UserError(
                f"{uri} was written by {known} producers; the fixed order depends on "
                f"that, so run vt-precompute with world size {known} or use a fresh window"
            )
        current = ledger.producer(self.storage, rank)
        if current is not None and current.get("done"):
            log.info("producer %d of %s is already done with %d shards", rank, uri, current["num_shards"])
            self.storage.put_atomic(done_path(rank), b"")  # a window from before done/ markers: listed from now
            return False
        if (
            current is not None
            and current.get("fingerprint") not in (None, fingerprint)
            and ledger.next_seq(self.storage, rank)
        ):
            raise UserError(
                f"{uri} holds shards of producer {rank} made with other settings (fingerprint "
                f"{current['fingerprint']}, now {fingerprint}): a restart must continue with the same "
                "config, model and vt version. Restore them, or precompute into a fresh window.uri"
            )
        self.check_lease(rank)
        info = {
            "rank": rank,
            "world_size": world_size,
            "size": self.size,
            "done": False,
            "num_shards": None,
            "fingerprint": fingerprint,
            "generation": self.generation.get(rank),
        }
        self.storage.put_atomic(producer_path(rank), json.dumps(info).encode())
        return True

    def room(self, rank: int) -> tuple[int, int]:
        """(unread, share): this producer's committed-unread shards and its share of the window; room while
        unread < share. Evicts this rank's shards below the watermark when it is full (the trainer may be gone)."""
        if self.size == "keep":
            return 0, 0
        info = ledger.producer(self.storage, rank)
        if info is None:
            raise RuntimeError(f"producer {rank} is not registered in {self.storage.uri}; call register_producer first")
        share = max(1, self.size // info["world_size"])
        positions = ledger.consumer(self.storage)
        unread = ledger.next_seq(self.storage, rank, positions) - positions["read"].get(rank, 0)
        if unread >= share:
            cleaning.evict(self.storage, rank)
        return unread, share

    def wait_for_room(self, rank: int) -> tuple[int, int]:
        """Block while this producer's committed-unread shards fill its share of the window (`room`).

        Returns (unread, share) at the moment there was room: the producer's window fill.
        """
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            unread, share = self.room(rank)
            if unread < share or self.size == "keep":
                return unread, share
            if time.monotonic() > deadline:
                raise self.timeout(rank, unread, share)
            time.sleep(self.poll_seconds)

    def timeout(self, rank: int, unread: int, share: int) -> WindowTimeout:
        return WindowTimeout(
            f"producer {rank}: {unread} committed shards in {self.storage.uri} are unread (its share of "
            f"window.size={self.size} is {share}) after {self.timeout_seconds:.0f}s; is vt-train "
            "running and reading this window? Raise window.timeout_seconds or use size='keep'"
        )

    def prepare(
        self, rank: int, seq: int, epoch: int, data: bytes, bucket: str, keys: list[str], fingerprint: str
    ) -> CommitRecord:
        """The commit record `data` will get as shard `seq` of `rank`; checks lease, order and format."""
        self.check_lease(rank)
        expected = self.expected.get(rank)
        if expected is None:
            info = ledger.producer(self.storage, rank)
            if info is not None and info.get("done"):
                raise RuntimeError(
                    f"producer {rank} of {self.storage.uri} already finished with "
                    f"{info['num_shards']} shards; use a fresh window for a new run"
                )
            expected = ledger.next_seq(self.storage, rank)
        if seq != expected:
            raise UserError(
                f"producer {rank} must commit seq {expected} next, got {seq}: seqs are "
                "contiguous so the reader never waits on a gap; a restarted producer "
                "resumes at Window.next_seq(rank)"
            )
        metadata = read_shard_metadata(data)  # refuse bytes that are not a shard before they become visible
        sha256 = hashlib.sha256(data).hexdigest()
        header = header_size(data) if "row_sha256" in metadata else 0  # readable by rows (shard_rows.py)
        return CommitRecord(
            producer=rank,
            seq=seq,
            epoch=epoch,
            bucket=bucket,
            keys=list(keys),
            data=data_path(rank, seq, sha256, self.generation.get(rank, 0)),
            nbytes=len(data),
            sha256=sha256,
            fingerprint=fingerprint,
            header_bytes=header,
            header_sha256=hashlib.sha256(data[:header]).hexdigest() if header else "",
        )

    def commit(
        self, rank: int, seq: int, epoch: int, data: bytes, bucket: str, keys: list[str], fingerprint: str
    ) -> CommitRecord:
        """prepare + publish: the shard is visible when this returns."""
        return self.publish(self.prepare(rank, seq, epoch, data, bucket, keys, fingerprint), data)

    def publish(self, record: CommitRecord, data: bytes) -> CommitRecord:
        """Write the shard data fully, then create its commit record exclusively (visible from then)."""
        rank, seq = record.producer, record.seq
        self.storage.put_atomic(record.data, data)
        fault_point("window.commit.after_data")
        try:
            self.check_lease(rank)
        except ProducerFenced:
            existing = ledger.record(self.storage, rank, seq)
            if existing is None or existing.data != record.data:
                self.storage.delete(record.data)  # nobody will ever name these bytes
            raise
        if not self.storage.create_exclusive(commit_path(rank, seq), record.to_json()):
            existing = ledger.record(self.storage, rank, seq)
            if existing is None or _identity(existing) != _identity(record):
                if existing is None or existing.data != record.data:
                    self.storage.delete(record.data)  # ours is the orphan: the record names other bytes
                raise ProducerConflict(
                    f"commit record {commit_path(rank, seq)} already exists in {self.storage.uri} with other "
                    f"content: two producers are writing as rank {rank}. Run exactly one producer per "
                    "rank (torchrun gives each its own RANK), then restart this one: it resumes after "
                    "the shards already committed"
                )
            if existing.data != record.data:
                self.storage.delete(record.data)  # same samples, other bytes (safetensors header order)
            log.info("shard %d of producer %d was already committed with the same samples", seq, rank)
            record = existing
        fault_point("window.commit.after_record")
        self.expected[rank] = seq + 1
        for rel in self.leftovers.get(rank, {}).pop(seq, []):
            if rel != record.data:
                self.storage.delete(rel)  # an earlier run's uncommitted bytes for this seq
        return record

    def write_progress(self, rank: int, payload: dict) -> None:
        """Store this producer's resume state (under its lease generation); see precompute/resume.py."""
        if rank not in self.generation:
            raise RuntimeError(f"producer {rank} holds no lease in {self.storage.uri}; call acquire({rank}) first")
        lease.write_progress(self.storage, rank, self.generation[rank], payload)

    def put_once(self, rel: str, data: bytes) -> bool:
        """Store a file every producer offers (the empty caption, validation conditions): the first stays."""
        return self.storage.create_exclusive(rel, data)

    def put_empty_caption(self, fingerprint: str, data: bytes) -> bool:
        return self.put_once(empty_caption_path(fingerprint), data)

    def put_validation(self, fingerprint: str, key: str, data: bytes) -> bool:
        return self.put_once(validation_path(fingerprint, key), data)

    def has_validation(self, fingerprint: str, key: str) -> bool:
        """Whether validation input `key`'s conditions are stored already (a producer encodes only what is not)."""
        return self.storage.exists(validation_path(fingerprint, key))

    def finish_producer(self, rank: int, num_shards: int) -> None:
        """Done marker: this rank's shards are seqs 0..num_shards-1; the reader stops waiting on it."""
        info = ledger.producer(self.storage, rank)
        if info is None:
            raise RuntimeError(f"producer {rank} is not registered in {self.storage.uri}; call register_producer first")
        committed = ledger.next_seq(self.storage, rank)
        if committed != num_shards:
            raise ValueError(
                f"producer {rank} says it wrote {num_shards} shards but {self.storage.uri} has "
                f"seqs 0..{committed - 1} committed; finish with num_shards={committed}"
            )
        self.check_lease(rank)
        self.clean_orphans(rank, beyond=num_shards)
        info.update(done=True, num_shards=num_shards)
        self.storage.put_atomic(producer_path(rank), json.dumps(info).encode())
        self.storage.put_atomic(done_path(rank), b"")

    def clean_orphans(self, rank: int, beyond: int | None = None) -> list[str]:
        """cleaning.clean_orphans, keeping the uncommitted data it found for `publish` to settle."""
        removed, self.leftovers[rank] = cleaning.clean_orphans(self.storage, rank, beyond)
        return removed
