"""The rolling shard window: the one contract between vt-precompute (producers) and vt-train.

By role, each module holding one part of the protocol (docs/window.md explains it whole):

    layout.py    where every file lives (paths, seqs) and the window's errors
    ledger.py    the small shared records both sides read: registrations, consumer.json, commit records
    writer.py    the producer: lease, registration, backpressure, the two-step commit, progress
    reader.py    the trainer: the fixed order, checked shard reads, the consumer's positions
    cleaning.py  eviction below the watermark, orphan data, killed writers' temp files, by owning role
    state.py     the whole window at a glance (`vt-precompute inspect`)

Why it is safe at every crash point:
- A reader trusts only commit records; data without one is invisible. Records are created
  exclusively and name their data file, whose name carries the writer's lease generation and
  sha256, so two writers of one seq never overwrite or delete each other's bytes, and any other
  data file of a committed seq is an orphan that may be deleted at any time.
- Eviction deletes the records first, then the data: a crash in between leaves orphan data below
  the watermark, never a record without data. Everything below the watermark is known to be
  committed, so the bookkeeping (`next_seq`, the order) needs no record for it.
- A writer killed mid-write leaves only a temp file (or an uncompleted S3 upload) that no reader
  lists; the role that owns the folder removes it (cleaning.py), and `inspect` shows it meanwhile.

`Window` is both sides in one object, cheap to construct and holding no lock: a producer process uses
its writer methods, the trainer its reader methods.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Iterator

from vt.shared.errors import UserError

from .. import lease
from ..lease import ProducerFenced
from ..shard_rows import ShardLayout
from ..shards import CommitRecord
from ..storage import Storage
from . import cleaning, ledger
from .layout import (
    CONSUMER,
    ProducerConflict,
    ShardCorruptError,
    WindowTimeout,
    commit_path,
    data_path,
    empty_caption_path,
    eval_window_uri,
    producer_path,
    seq_of,
    validation_key,
    validation_path,
)
from .reader import Reader
from .state import window_state
from .writer import Writer

__all__ = [
    "CONSUMER",
    "ProducerConflict",
    "ProducerFenced",
    "ShardCorruptError",
    "Window",
    "WindowTimeout",
    "commit_path",
    "data_path",
    "empty_caption_path",
    "eval_window_uri",
    "producer_path",
    "seq_of",
    "validation_key",
    "validation_path",
]


class Window:
    """Producer and consumer side of one shard window (`writer`, `reader`)."""

    def __init__(
        self,
        uri: str,
        size: int | str = 8,
        poll_seconds: float = 0.2,
        timeout_seconds: float = 1800.0,
        storage: Storage | None = None,
    ):
        if size != "keep" and not (isinstance(size, int) and not isinstance(size, bool) and size >= 1):
            raise UserError(f'window.size must be a positive integer or "keep", got {size!r}')
        if poll_seconds <= 0 or timeout_seconds <= 0:
            raise UserError("window.poll_seconds and window.timeout_seconds must be positive")
        self.storage = storage or Storage(uri)
        self.uri = uri
        self.size = size
        self.keep = size == "keep"
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        self.writer = Writer(self.storage, size, poll_seconds, timeout_seconds)
        self.reader = Reader(self.storage, poll_seconds, timeout_seconds)
        self._evictions: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    def __repr__(self) -> str:
        return f"Window({self.uri!r}, size={self.size!r})"

    # -- both sides ------------------------------------------------------------------------------
    def world_size(self) -> int | None:
        return ledger.world_size(self.storage)

    def next_seq(self, rank: int, consumer: dict | None = None) -> int:
        return ledger.next_seq(self.storage, rank, consumer)

    def record(self, rank: int, seq: int) -> CommitRecord | None:
        return ledger.record(self.storage, rank, seq)

    def state(self) -> dict:
        return window_state(self.storage)

    def evict(self, rank: int | None = None) -> list[str]:
        """Shards below the watermark, deleted (never with size="keep"); see cleaning.evict."""
        return [] if self.keep else cleaning.evict(self.storage, rank)

    def evict_read(self, background: bool = False) -> list[str] | None:
        """The trainer's eviction (its rank 0, after a checkpoint): `evict` from the order its reader holds; returns
        the paths deleted. `background`: planned here, the deletes made on a thread of their own, one eviction
        after the other (`wait_evictions`), so a checkpoint never waits on them; returns the planned paths (None
        for the first, which lists the folders there)."""
        if self.keep:
            return []
        if not background:
            return self.reader.evict()
        plan = self.reader.evict_plan()
        if self._evictions is None:
            self._evictions = ThreadPoolExecutor(1, thread_name_prefix="vt-window-evict")
        task = (
            cleaning.evict
            if plan is None
            else partial(cleaning.delete_records_then_data, records=plan[0], data=plan[1])
        )
        self._pending.append(self._evictions.submit(task, self.storage))
        return None if plan is None else [*plan[0], *plan[1]]

    def wait_evictions(self) -> None:
        """Until the background evictions are done; raises the first one's error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    # -- producer side (writer.py) ---------------------------------------------------------------
    def acquire(self, rank: int) -> int:
        return self.writer.acquire(rank)

    def register_producer(self, rank: int, world_size: int, fingerprint: str | None = None) -> bool:
        return self.writer.register_producer(rank, world_size, fingerprint)

    def wait_for_room(self, rank: int) -> tuple[int, int]:
        return self.writer.wait_for_room(rank)

    def room(self, rank: int) -> tuple[int, int]:
        return self.writer.room(rank)

    def hold(self, rank: int, generation: int) -> None:
        self.writer.hold(rank, generation)

    def lanes(self, wanted: int, raw_shards: int | None = None) -> int:
        """The window's lane count: fixed by its first producer (`wanted`), the same for every later one."""
        return ledger.fix_lanes(self.storage, wanted, raw_shards)

    def prepare(
        self, rank: int, seq: int, epoch: int, data: bytes, bucket: str, keys: list[str], fingerprint: str
    ) -> CommitRecord:
        return self.writer.prepare(rank, seq, epoch, data, bucket, keys, fingerprint)

    def publish(self, record: CommitRecord, data: bytes) -> CommitRecord:
        return self.writer.publish(record, data)

    def commit(
        self, rank: int, seq: int, epoch: int, data: bytes, bucket: str, keys: list[str], fingerprint: str
    ) -> CommitRecord:
        """prepare + publish: the shard is visible when this returns."""
        return self.writer.publish(self.writer.prepare(rank, seq, epoch, data, bucket, keys, fingerprint), data)

    def write_progress(self, rank: int, payload: dict) -> None:
        self.writer.write_progress(rank, payload)

    def read_progress(self, rank: int) -> list[tuple[int, dict]]:
        """(generation, payload) of every stored resume state of `rank`, newest generation first."""
        return lease.read_progress(self.storage, rank)

    def put_empty_caption(self, fingerprint: str, data: bytes) -> bool:
        return self.writer.put_empty_caption(fingerprint, data)

    def put_validation(self, fingerprint: str, key: str, data: bytes) -> bool:
        return self.writer.put_validation(fingerprint, key, data)

    def finish_producer(self, rank: int, num_shards: int) -> None:
        self.writer.finish_producer(rank, num_shards)

    def clean_orphans(self, rank: int, beyond: int | None = None) -> list[str]:
        return self.writer.clean_orphans(rank, beyond)

    # -- consumer side (reader.py) ---------------------------------------------------------------
    def order(self, start: int = 0) -> Iterator[tuple[int, CommitRecord]]:
        return self.reader.order(start)

    def record_at(self, position: int, block: bool = True) -> CommitRecord | None:
        return self.reader.record_at(position, block)

    def read_shard(self, record: CommitRecord) -> bytes:
        return self.reader.read_shard(record)

    def read_header(self, record: CommitRecord) -> ShardLayout:
        return self.reader.read_header(record)

    def read_rows(self, record: CommitRecord, layout: ShardLayout, rows: list[int]) -> dict:
        return self.reader.read_rows(record, layout, rows)

    def shard_meta(self, record: CommitRecord) -> dict:
        return self.reader.shard_meta(record)

    def validation(self, fingerprint: str, key: str) -> bytes | None:
        return self.reader.validation(fingerprint, key)

    def empty_caption(self, fingerprint: str) -> bytes:
        return self.reader.empty_caption(fingerprint)

    def publish_read(self, position: int) -> None:
        self.reader.publish_read(position)

    def note_read(self, position: int) -> None:
        self.reader.note_read(position)

    def flush_read(self, force: bool = False) -> None:
        self.reader.flush_read(force)

    def publish_watermark(self, position: int) -> None:
        self.reader.publish_watermark(position)

    def clean_consumer_debris(self) -> list[str]:
        """The trainer's rank 0 at start: temp files of an earlier trainer killed inside a consumer.json write."""
        return cleaning.clean_consumer_debris(self.storage)
