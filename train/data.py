"""Window reader: latent shards in the window's fixed order -> one-bucket global batches, this rank's rows.

Shards arrive one bucket each. The reader appends every shard's samples to its bucket's pending list
and plans a batch as soon as a bucket holds its batch size (`train.batch_size`, or with `token_budget.tokens_per_batch`
as many samples as fit the token budget: train/parts/token_budget.py), so a batch never mixes shapes and never needs
padding. At the end of an epoch each bucket's remainder goes out as a smaller batch:
every sample is trained on exactly once per epoch.

Planning needs only the commit records (bucket, keys, epoch), never the data: every rank plans the
same global batches from the same records, and then reads only the rows of its data-parallel slice
(`load`, by byte range: shared/shard_rows.py), so a job of D data-parallel ranks reads each sample
once, not D times. Ranks of one cp or tp group have the same slice and each read it (the choice is
in docs/scale.md). A rank whose slice is empty reads the batch's first row as its weight-0 stand-in.

The cursor (pass, next position, pending sample references) is the whole state: each plan carries the
cursor as it is after that batch, so a trainer reading ahead checkpoints the state of the batch it
trained last, not of the one it read last. A resume re-reads the pending samples from their shards and
continues exactly. The lowest position a cursor still references is the safe eviction watermark.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from vt.shared.caption_table import drawn_caption
from vt.shared.errors import UserError
from vt.shared.shard_rows import ShardLayout
from vt.shared.shards import CommitRecord, decode_shard
from vt.shared.window import Reader
from vt.shared.window.reader import NotYet
from vt.train.parallel.batching import slice_bounds


@dataclass
class Batch:
    """One global batch: its keys, and the tensors of the rows this rank read, from row `first` on."""

    bucket: str
    epoch: int
    keys: list[str]  # every sample of the global batch
    tensors: dict[str, torch.Tensor]  # stacked along dim 0, float32: rows first, first + 1, ... of the batch
    first: int = 0  # the batch row of the tensors' row 0
    state: dict | None = None  # the reader's cursor after this batch (a checkpoint taken after training it)
    captions: dict[str, int] = field(default_factory=dict)  # key -> which of its several captions it has (read rows)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class Plan:
    """A global batch before its data is read: which samples, and which of them this rank reads."""

    bucket: str
    epoch: int
    refs: list[tuple[int, int]]  # (position, row) of every sample, in batch order
    keys: list[str]
    records: dict[int, CommitRecord]  # position -> record of every shard the batch takes samples from
    start: int  # this rank's rows of the batch: [start, stop); a stand-in row 0 when empty
    stop: int
    state: dict
    # About the bytes one rank reads of it (the batch's share of its shards' sizes over the data-parallel
    # ranks): the read-ahead's budget unit, the same on every rank, so all ranks look ahead alike
    nbytes: int = 0

    @property
    def rows(self) -> list[tuple[int, int]]:
        """(position, row) this rank reads, in batch order."""
        return self.refs[self.start : self.stop] if self.stop > self.start else self.refs[:1]


@dataclass
class Cursor:
    pass_index: int = 0
    position: int = 0  # next position in the window's order to read
    epoch: int = -1  # data epoch of the samples in `pending`
    pending: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # bucket -> [(position, row)]

    def state_dict(self) -> dict:
        return {
            "pass_index": self.pass_index,
            "position": self.position,
            "epoch": self.epoch,
            "pending": {b: [list(ref) for ref in refs] for b, refs in self.pending.items()},
        }

    @classmethod
    def from_state(cls, state: dict) -> "Cursor":
        pending = {b: [tuple(ref) for ref in refs] for b, refs in state["pending"].items()}
        return cls(state["pass_index"], state["position"], state["epoch"], pending)


def watermark(state: dict) -> int:
    """The lowest position a resume from cursor `state` could need."""
    refs = [ref[0] for refs in state["pending"].values() for ref in refs]
    return min(refs + [state["position"]])


class StaleShardError(UserError, RuntimeError):
    """A shard was made with settings other than the trainer's config."""


class BatchReader:
    """Plans global batches; `passes` > 1 re-reads a kept window (precompute once, many epochs).

    `order(position, block)` gives the record at a position of the window's fixed order (None past its
    end; NotYet when `block` is False and it is not committed yet): the window's own, or in a distributed
    trainer rank 0's, broadcast (train/parallel/order.py). Iterating the reader yields loaded batches
    (this rank's rows); `plans()` and `load` are the two halves a read-ahead runs apart (read_ahead.py).
    """

    def __init__(
        self,
        window: Reader,
        batch_size: int | Callable[[str], int],
        passes: int = 1,
        check_record: Callable[[CommitRecord, Callable[[CommitRecord], dict]], None] | None = None,
        on_read: Callable[[int], None] | None = None,
        order: Callable[..., CommitRecord | None] | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
    ):
        if not callable(batch_size) and batch_size < 1:
            raise UserError("train.batch_size must be at least 1")
        self.window = window
        self.batch_size = batch_size if callable(batch_size) else (lambda bucket: batch_size)  # bucket -> samples
        self.passes = passes
        self.check_record = check_record
        self.on_read = on_read or window.publish_read
        self.order = order or window.record_at
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.seed = seed  # a sample with several captions trains on drawn_caption(seed, epoch, key)'s
        self.block = True  # False: plans() yields None instead of waiting for a shard not committed yet
        self.cursor = Cursor()
        self._records: dict[int, CommitRecord] = {}  # position -> record, while a pending sample refers to it
        self._shards = _ShardCache(window)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.cursor = Cursor.from_state(state)
        self._records.clear()

    # -- planning ------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Loaded batches, one after the other (no read-ahead)."""
        for plan in self.plans():
            yield self.load(plan)

    def plans(self) -> Iterator[Plan | None]:
        """Batch plans in an order that depends on the data alone: a resumed cursor continues exactly.

        The rule: every full batch pending goes out before anything more is read. A shard larger
        than the batch leaves several full batches after it is planned; a checkpoint taken between
        them stores a cursor that still holds some, and those come first after a resume, before the
        next shard (maybe of another bucket) is planned. With `block` False, None stands for "the next
        shard is not committed yet"; the generator asks again when resumed.
        """
        cursor = self.cursor
        while cursor.pass_index < self.passes:
            yield from self._full_batches()  # a resumed cursor's
            while True:
                try:
                    record = self.order(cursor.position, self.block)
                except NotYet:
                    yield None
                    continue
                if record is None:
                    break
                position = cursor.position
                epoch = cursor.pass_index + record.epoch
                if epoch != cursor.epoch:
                    yield from self._flush()
                    cursor.epoch = epoch
                self._add(position, record)
                cursor.pending.setdefault(record.bucket, []).extend((position, row) for row in range(len(record.keys)))
                cursor.position = position + 1
                self.on_read(cursor.position)
                yield from self._full_batches()
            yield from self._flush()
            cursor.pass_index += 1
            cursor.position = 0

    def _full_batches(self) -> Iterator[Plan]:
        """Every full batch pending, by bucket name (only the bucket read last can hold one)."""
        for bucket in sorted(self.cursor.pending):
            while len(self.cursor.pending.get(bucket, ())) >= self.batch_size(bucket):
                yield self._take(bucket, self.batch_size(bucket))

    def _flush(self) -> Iterator[Plan]:
        """The end of an epoch: full batches first, then each bucket's remainder as a smaller batch."""
        yield from self._full_batches()
        for bucket in sorted(self.cursor.pending):
            while self.cursor.pending.get(bucket):
                yield self._take(bucket, min(self.batch_size(bucket), len(self.cursor.pending[bucket])))

    def _take(self, bucket: str, n: int) -> Plan:
        refs = self.cursor.pending[bucket][:n]
        for position in {pos for pos, _ in refs} - set(self._records):  # pending from before a resume
            self._add(position, self.order(position, True))
        records = {pos: self._records[pos] for pos, _ in refs}
        keys = [records[pos].keys[row] for pos, row in refs]
        remaining = self.cursor.pending[bucket][n:]
        if remaining:
            self.cursor.pending[bucket] = remaining
        else:
            del self.cursor.pending[bucket]
        live = {pos for refs_ in self.cursor.pending.values() for pos, _ in refs_}
        for pos in [p for p in self._records if p not in live]:
            del self._records[pos]
        start, stop = slice_bounds(n, self.dp_rank, self.dp_size)
        share = sum(records[pos].nbytes // len(records[pos].keys) for pos, _ in refs)
        return Plan(
            bucket,
            self.cursor.epoch,
            refs,
            keys,
            records,
            start,
            stop,
            self.cursor.state_dict(),
            nbytes=-(-share // self.dp_size),
        )

    def _add(self, position: int, record: CommitRecord) -> None:
        if self.check_record is not None:  # given a way to read the shard's meta through the header cache
            self.check_record(record, self._shards.meta)
        self._records[position] = record

    # -- reading -------------------------------------------------------------------------------------
    def _pick(self, plan: Plan, position: int, chosen: dict[str, int]):
        """Which of a sample's several captions it trains on in the plan's epoch: a keyed draw of (seed, epoch, key),
        the same in every layout and resume (caption dropout then applies to the batch as to any); noted in `chosen`."""
        keys = plan.records[position].keys

        def pick(row: int, captions: list[int]) -> int:
            chosen[keys[row]] = drawn_caption(self.seed, plan.epoch, keys[row], len(captions))
            return captions[chosen[keys[row]]]

        return pick

    def load(self, plan: Plan, pin: bool = False) -> Batch:
        """This rank's rows of `plan` from the window: only those rows' bytes (safe to call from a thread)."""
        rows = plan.rows
        by_shard: dict[int, list[int]] = {}
        for position, row in rows:
            by_shard.setdefault(position, []).append(row)
        chosen: dict[str, int] = {}  # which caption each read sample with several has, for log.samples
        read = {
            position: self._shards.rows(plan.records[position], shard_rows, self._pick(plan, position, chosen))
            for position, shard_rows in by_shard.items()
        }
        picked: dict[int, int] = {position: 0 for position in by_shard}
        per_row = []
        for position, _ in rows:
            per_row.append({name: t[picked[position]] for name, t in read[position].items()})
            picked[position] += 1
        tensors = {name: torch.stack([r[name] for r in per_row]).float() for name in per_row[0]}
        if pin:
            tensors = {name: t.pin_memory() for name, t in tensors.items()}
        first = plan.start if plan.stop > plan.start else 0
        return Batch(plan.bucket, plan.epoch, plan.keys, tensors, first, plan.state, chosen)


class _ShardCache:
    """Reads rows of committed shards: each header once (a few recent ones kept), then the rows' byte ranges.

    A shard committed without row digests (an older vt) is read whole and checked against its record,
    and kept decoded while it is among the `keep_whole` most recent of those (a whole shard can be large).
    Thread-safe: a read-ahead's threads share it."""

    def __init__(self, window: Reader, keep: int = 64, keep_whole: int = 4):
        self.window = window
        self.keep = keep
        self.keep_whole = keep_whole
        self._lock = threading.Lock()
        self._recent: OrderedDict[str, ShardLayout | tuple[dict, list]] = OrderedDict()

    def rows(self, record: CommitRecord, rows: list[int], pick=None) -> dict[str, torch.Tensor]:
        known = self._get(record)
        if known is None:
            known = self.window.read_header(record) if record.header_bytes else self._whole(record)
            self._put(record, known)
        if isinstance(known, ShardLayout):
            return self.window.read_rows(record, known, rows, pick)
        tensors, _ = known
        return {name: t[rows] for name, t in tensors.items()}

    def meta(self, record: CommitRecord) -> dict:
        """The shard's `meta` (provenance ...): from its header, cached for the rows read after it."""
        known = self._get(record)
        if known is None and record.header_bytes:
            known = self.window.read_header(record)
            self._put(record, known)
        return known.meta if isinstance(known, ShardLayout) else self.window.shard_meta(record)

    def _whole(self, record: CommitRecord) -> tuple[dict, list]:
        tensors, keys, _ = decode_shard(self.window.read_shard(record))
        return tensors, keys

    def _get(self, record: CommitRecord):
        with self._lock:
            known = self._recent.get(record.data)
            if known is not None:
                self._recent.move_to_end(record.data)
            return known

    def _put(self, record: CommitRecord, known) -> None:
        with self._lock:
            self._recent[record.data] = known
            while len(self._recent) > self.keep:
                self._recent.popitem(last=False)
            whole = [path for path, entry in self._recent.items() if not isinstance(entry, ShardLayout)]
            for path in whole[: -self.keep_whole]:
                del self._recent[path]
