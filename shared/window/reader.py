"""The trainer's side of a window: the fixed order, checked shard reads, and the consumer's positions.

The fixed order: position i -> (rank, seq), round-robin over ranks by seq, rank-major within a
round: (p0,0),(p1,0),(p0,1),(p1,1)... A slot is skipped once its producer is done with fewer
shards; otherwise the reader waits for its record. So the order depends only on what was
committed, never on timing, and each rank's share of any prefix is known: consumer positions are
stored per producer (next unread / unevicted seq), backpressure and eviction compare seqs per
producer, and a restart of either side recomputes everything from storage alone.

One trainer process (rank 0) writes consumer.json (`publish_read`, `publish_watermark`) and evicts below the
watermark (`evict_read`); producers only read it. Fault points: window.publish_read, window.publish_watermark.
"""

from __future__ import annotations

import hashlib
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Callable, Iterator

from ..faults import fault_point
from ..shard_rows import RowsCorrupt, ShardLayout
from ..shards import CommitRecord, read_shard_metadata
from ..storage import Storage
from . import cleaning, ledger
from .layout import WORKERS, ShardCorruptError, WindowTimeout, commit_path, empty_caption_path, validation_path

PREFETCH = 256  # commit records read ahead of the position asked for (a few KB each)
PREFETCH_THREADS = 64  # at most this many in flight: rank 0 keeps up with 64 / round trip records a second


class NotYet(Exception):
    """A slot of the order cannot be resolved yet: neither its record nor a done marker exists."""


class Reader(ledger.LedgerReads):
    """The consumer of one window (`open_reader`): walks the fixed order, remembering every slot resolved so far (a
    resolved slot never changes), reads shards, and publishes the consumer's positions. `keep`: a window that is
    never evicted (window.size = "keep")."""

    def __init__(self, storage: Storage, poll_seconds: float, timeout_seconds: float, keep: bool = True):
        self.storage = storage
        self.uri = storage.uri
        self.keep = keep
        self.poll_seconds = poll_seconds
        self.timeout_seconds = timeout_seconds
        # (rank, seq) of every position resolved so far: walks of the order (publish_read per shard,
        # order(start) on resume) replay it instead of starting over
        self.resolved: list[tuple[int, int]] = []
        self.ended = False  # every producer is done and every slot resolved
        # Called before each sleep while waiting for the next slot: the trainer's rank 0, the one reader
        # of the order, tells the other ranks it is still waiting (train/parallel/order.py)
        self.on_poll = None
        # What the walk knows of each producer, kept between calls: both only grow
        self._world: int | None = None
        self._committed: dict[int, int] = {}  # rank -> all seqs below are committed (monotonic)
        self._done: dict[int, int] = {}  # rank -> num_shards once its done marker is seen
        self._next = (0, 0)  # (seq, rank): the next candidate slot after the last resolved one
        self._counts: tuple[int, dict[int, int]] = (0, {})  # seqs_at's last answer, continued from
        # consumer.json as this process last wrote it: the trainer's rank 0 is its one writer, so once it has
        # written it, it keeps it instead of a GET before each per-shard write and each poll (a process that
        # only reads the window, or has not written yet, reads it each time: another process may write it)
        self._consumer: dict | None = None
        self._unpublished: int | None = None  # a read position noted (`note_read`), not written yet
        self._published_at = float("-inf")  # time.monotonic() of the last read position written
        # Eviction from the order held here (`evict`): the data file of each position this reader resolved a record
        # for, until evicted, and the position eviction has reached (None before this process first evicted)
        self._data: dict[int, str] = {}
        self._evicted_to: int | None = None
        # Commit records of the positions after the last one asked for, read ahead on threads of their own
        # (`_prefetch`): a record is immutable once created, so the walk waits on one round trip at most
        self._ahead: dict[int, Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._evictions: ThreadPoolExecutor | None = None  # `evict_read(background=True)`: one thread, in turn
        self._pending: list[Future] = []

    def __repr__(self) -> str:
        return f"Reader({self.uri!r})"

    def slot(self, position: int, block: bool) -> tuple[int, int] | None:
        """(rank, seq) at `position` of the fixed order; None past its end. block=False raises NotYet
        where the walk would have to wait for a commit."""
        while position >= len(self.resolved):
            if self.ended or not self._resolve_next(block):
                return None
        return self.resolved[position]

    def _resolve_next(self, block: bool) -> bool:
        """Resolve one more slot into `resolved`; False once the order has ended."""
        if self._world is None:
            self._world = self.wait(lambda: ledger.world_size(self.storage), block, "a producer registration")
            self._committed = {k: 0 for k in range(self._world)}
        while True:
            seq, rank = self._next
            if self._past_end(seq):
                self.ended = True
                return False
            what = f"producer {rank} shard {seq} ({commit_path(rank, seq)}) or its done marker"
            present = self.wait(lambda: self._slot_state(rank, seq), block, what, partial(self.producers_of, rank))
            self._step()
            if present:
                self.resolved.append((rank, seq))
                return True

    def _slot_state(self, rank: int, seq: int) -> bool | None:
        """True: (rank, seq) is committed; False: its producer finished with fewer shards; None: not yet.

        A slot not known committed costs one listing of `commits/`, which updates every producer's count at once
        (so on a window being written, one listing answers the slots of all the shards committed since the last);
        only a slot still missing then reads its producer's registration, for the done marker, and lists that
        producer's commits again after it (commits never follow the marker)."""
        done, committed = self._done, self._committed
        known = self._known(rank, seq)
        if known is not None:
            return known
        for other, count in ledger.next_seqs(self.storage, self.consumer()).items():
            committed[other] = max(committed.get(other, 0), count)
        if seq < committed[rank]:
            return True
        info = ledger.producer(self.storage, rank)
        if not (info is not None and info.get("done")):
            return None
        done[rank] = info["num_shards"]
        committed[rank] = max(committed[rank], ledger.next_seq(self.storage, rank, self.consumer()))
        if seq >= done[rank]:
            return False
        return True if seq < committed[rank] else None

    def wait(self, probe, block: bool, what: str, story: Callable[[], str] | None = None):
        """Poll `probe()` until it is not None; WindowTimeout after timeout_seconds (with `story()` told, if given)."""
        deadline = time.monotonic() + self.timeout_seconds
        while True:
            value = probe()
            if value is not None:
                return value
            if not block:
                raise NotYet(what)
            if time.monotonic() > deadline:
                told = f". {story()}" if story is not None else ""
                raise WindowTimeout(
                    f"waited {self.timeout_seconds:.0f}s in {self.storage.uri} for {what}; "
                    f"is vt-precompute running for that rank?{told}"
                )
            self.flush_read(force=True)  # a producer waiting for room waits on it: never both wait on each other
            if self.on_poll is not None:
                self.on_poll()
            time.sleep(self.poll_seconds)

    def producers_of(self, rank: int) -> str:
        """What the producers' records (workers/<name>.json) say of each that took lane `rank`: its name and status
        (running, done, or failed with the error that stopped it), for a wait on that lane that timed out."""
        told = [
            f"{record['producer']} {record.get('status', '?')}"
            for record in ledger.workers(self.storage)
            if rank in record.get("lanes", []) or rank in record.get("worked", [])
        ]
        if not told:
            return f"No producer has taken lane {rank} yet"
        return f"The producers that took lane {rank}, as {WORKERS}/ records them: " + "; ".join(told)

    def order(self, start: int = 0) -> Iterator[tuple[int, CommitRecord]]:
        """(position, record) in the fixed order from `start`; ends when every producer is done."""
        position = start
        while (record := self.record_at(position)) is not None:
            yield position, record
            position += 1

    def record_at(self, position: int, block: bool = True) -> CommitRecord | None:
        """The commit record at `position` of the fixed order; None past its end; with block=False,
        NotYet where it is not committed yet."""
        slot = self.slot(position, block)
        if slot is None:
            return None
        rank, seq = slot
        ahead = self._ahead.pop(position, None)
        try:
            record = CommitRecord.from_json(ahead.result() if ahead else self.storage.read(commit_path(rank, seq)))
        except FileNotFoundError:
            raise RuntimeError(
                f"position {position} (producer {rank} shard {seq}) was evicted from {self.storage.uri}: "
                "the watermark is past it. Resume from the newest checkpoint, or use "
                "window.size='keep' to read a window more than once"
            ) from None
        if self._evicted_to is None or position >= self._evicted_to:
            self._data[position] = record.data
        self._prefetch(position + 1)
        return record

    def _prefetch(self, start: int) -> None:
        """Read the commit records of positions [start, start + PREFETCH) on the pool's threads, as far as the order
        is known without asking storage (`_resolve_known`); forget those behind `start`."""
        for position in [p for p in self._ahead if p < start]:
            self._ahead.pop(position).cancel()
        self._resolve_known(start + PREFETCH)
        for position in range(start, min(start + PREFETCH, len(self.resolved))):
            if position not in self._ahead:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="vt-window-records")
                self._ahead[position] = self._pool.submit(self.storage.read, commit_path(*self.resolved[position]))

    def _resolve_known(self, limit: int) -> None:
        """Resolve slots into `resolved`, up to `limit` of them, while what the walk knows answers them (committed
        seqs, done markers): no storage request; the first slot it cannot answer is left to `_resolve_next`."""
        while len(self.resolved) < limit and self._world is not None and not self.ended:
            seq, rank = self._next
            present = None if self._past_end(seq) else self._known(rank, seq)
            if present is None:
                return
            self._step()
            if present:
                self.resolved.append((rank, seq))

    def _known(self, rank: int, seq: int) -> bool | None:
        """What the walk knows of slot (rank, seq), asking storage nothing: True committed, False past its producer's
        last shard, None not known yet."""
        if rank in self._done and seq >= self._done[rank]:
            return False
        return True if seq < self._committed[rank] else None

    def _past_end(self, seq: int) -> bool:
        """Every producer is done and `seq` is past the last shard of each: the order has ended."""
        return len(self._done) == self._world and seq >= max(self._done.values())

    def _step(self) -> None:
        """On to the next candidate slot: the next rank of this seq, or the first of the next seq."""
        seq, rank = self._next
        self._next = (seq, rank + 1) if rank + 1 < self._world else (seq + 1, 0)

    def read_shard(self, record: CommitRecord) -> bytes:
        """The data bytes of a committed shard, checked against the record's size and sha256."""
        uri = self.storage.uri
        try:
            data = self.storage.read(record.data)
        except FileNotFoundError:
            raise ShardCorruptError(
                f"{record.data} is missing from {uri} although it is committed: "
                "evicted while being read, or deleted by hand"
            ) from None
        if len(data) != record.nbytes:
            raise ShardCorruptError(
                f"{record.data} in {uri} is {len(data)} bytes but its commit "
                f"record says {record.nbytes}: changed or truncated after commit; "
                "re-run vt-precompute into a fresh window"
            )
        digest = hashlib.sha256(data).hexdigest()
        if digest != record.sha256:
            raise ShardCorruptError(
                f"{record.data} in {uri} has sha256 {digest[:12]}... but its "
                f"commit record says {record.sha256[:12]}...: changed after commit; "
                "re-run vt-precompute into a fresh window"
            )
        return data

    def read_header(self, record: CommitRecord) -> ShardLayout:
        """The layout of a shard committed with row digests, its header checked against the record."""
        header = self._ranges(record, [(0, record.header_bytes)])[0]
        digest = hashlib.sha256(header).hexdigest()
        if len(header) != record.header_bytes or digest != record.header_sha256:
            raise ShardCorruptError(
                f"{record.data} in {self.storage.uri}: its header ({len(header)} bytes, sha256 "
                f"{digest[:12]}...) is not the one its commit record pins; changed after "
                "commit: re-run vt-precompute into a fresh window"
            )
        return ShardLayout.parse(header)

    def read_rows(self, record: CommitRecord, layout: ShardLayout, rows: list[int], pick=None) -> dict:
        """name -> tensor of `rows` of a shard (shard_rows.py): only their bytes are read, each piece checked; `pick`
        chooses among a sample's several captions (ShardLayout.read_rows)."""
        try:
            return layout.read_rows(rows, lambda ranges: self._ranges(record, ranges), pick)
        except RowsCorrupt as err:
            raise ShardCorruptError(
                f"{record.data} in {self.storage.uri}: {err}; changed after commit: re-run "
                "vt-precompute into a fresh window"
            ) from None

    def _ranges(self, record: CommitRecord, ranges: list[tuple[int, int]]) -> list[bytes]:
        try:
            return self.storage.read_ranges(record.data, ranges)
        except FileNotFoundError:
            raise ShardCorruptError(
                f"{record.data} is missing from {self.storage.uri} although it is committed: "
                "evicted while being read, or deleted by hand"
            ) from None

    def shard_meta(self, record: CommitRecord) -> dict:
        """The `meta` a committed shard carries (provenance, ...): from its header alone where it can."""
        if record.header_bytes:
            return self.read_header(record).meta
        return json.loads(read_shard_metadata(self.read_shard(record))["meta"])

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
                "dropout existed; re-run vt-precompute into a fresh window, or set caption_dropout.rate = 0"
            ) from None

    def seqs_at(self, position: int) -> dict[int, int]:
        """Per producer, how many of its shards lie below `position` in the fixed order."""
        if position < 0:
            raise ValueError(f"positions start at 0, got {position}")
        if position == 0:
            return {}
        try:
            known = self.slot(position - 1, block=False) is not None
        except NotYet:
            known = False
        if not known:
            raise ValueError(
                f"position {position} is past the shards committed to {self.storage.uri} so far; "
                "publish only positions the reader has reached"
            )
        # Counted on from the last answer when the position moved forward (publish_read: one shard at a time)
        last, counts = self._counts if self._counts[0] <= position else (0, {})
        counts = dict(counts)
        for rank, seq in self.resolved[last:position]:
            counts[rank] = seq + 1
        self._counts = (position, counts)
        return dict(counts)

    def consumer(self) -> dict:
        """consumer.json's positions: as this process wrote them last, or read (see `_consumer`)."""
        return self._consumer if self._consumer is not None else ledger.consumer(self.storage)

    def publish_read(self, position: int) -> None:
        """Positions < `position` have been read (drives backpressure). Single writer: trainer rank 0."""
        positions = dict(self.consumer(), read=self.seqs_at(position), read_position=position)
        ledger.write_consumer(self.storage, positions)
        self._consumer = positions
        fault_point("window.publish_read")

    def note_read(self, position: int) -> None:
        """Like publish_read, written later: at `flush_read` (the trainer's rank 0 calls it once a step) or
        before this reader waits for a commit."""
        self._unpublished = position

    def flush_read(self, force: bool = False) -> None:
        """Write the read position noted last, if it moved: at most once per `poll_seconds` (a producer looks
        no more often; each write is an fsync'd file or a PUT), always with `force` (before a wait, at a
        checkpoint, at the end)."""
        if self._unpublished is None:
            return
        if not force and time.monotonic() - self._published_at < self.poll_seconds:
            return
        position, self._unpublished = self._unpublished, None
        self.publish_read(position)
        self._published_at = time.monotonic()

    def evict_read(self, background: bool = False) -> list[str] | None:
        """The trainer's eviction (its rank 0, after a checkpoint): the records, then the data, of the positions below
        the watermark (`evict_plan`, then the deletes); returns the paths deleted ([] with `keep`). `background`:
        planned here, the deletes made on a thread of their own, one eviction after the other (`wait_evictions`), so
        a checkpoint never waits on them; returns the planned paths (None for the first, which lists the folders)."""
        if self.keep:
            return []
        plan = self.evict_plan()
        task = (
            cleaning.evict
            if plan is None
            else partial(cleaning.delete_records_then_data, records=plan[0], data=plan[1])
        )
        if not background:
            return task(self.storage)
        if self._evictions is None:
            self._evictions = ThreadPoolExecutor(1, thread_name_prefix="vt-window-evict")
        self._pending.append(self._evictions.submit(task, self.storage))
        return None if plan is None else [*plan[0], *plan[1]]

    def wait_evictions(self) -> None:
        """Until the background evictions are done; raises the first one's error."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def clean_consumer_debris(self) -> list[str]:
        """The trainer's rank 0 at start: temp files of an earlier trainer killed inside a consumer.json write."""
        return cleaning.clean_consumer_debris(self.storage)

    def evict_plan(self) -> tuple[list[str], list[str]] | None:
        """What `evict_read` deletes, worked out from the order held here and marked as done: (records, data files) of
        the positions this reader resolved below the watermark since the last eviction, with no request, so the
        cost follows the shards consumed, not the number of producers; None the first time in a process, when
        what earlier trainers left can only be found by listing each producer's folders (cleaning.evict)."""
        watermark = self.consumer()["watermark_position"]
        plan = None
        if self._evicted_to is not None:
            span = range(self._evicted_to, watermark)
            plan = [commit_path(*self.resolved[p]) for p in span], [self._data[p] for p in span if p in self._data]
        self._evicted_to = max(watermark, self._evicted_to or 0)
        self._data = {position: rel for position, rel in self._data.items() if position >= self._evicted_to}
        return plan

    def publish_watermark(self, position: int) -> None:
        """After a checkpoint: positions < `position` may be evicted. Never moves back."""
        positions = self.consumer()
        if position <= positions["watermark_position"]:
            return
        positions = dict(positions, watermark=self.seqs_at(position), watermark_position=position)
        ledger.write_consumer(self.storage, positions)
        self._consumer = positions
        fault_point("window.publish_watermark")
