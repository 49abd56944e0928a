"""Window reader: latent shards in the window's fixed order -> one-bucket global batches.

Shards arrive one bucket each. The reader appends every shard's samples to its bucket's pending list
and emits a batch as soon as a bucket holds `batch_size` samples, so a batch never mixes shapes and
never needs padding. At the end of an epoch each bucket's remainder goes out as a smaller batch:
every sample is trained on exactly once per epoch.

The cursor (pass, next position, pending sample references) is the whole state: a checkpoint stores
it, a resume re-reads the pending samples from their shards and continues exactly. The lowest
position the cursor still references is the safe eviction watermark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from vt.shared.shards import CommitRecord, decode_shard
from vt.shared.window import Window


@dataclass
class Batch:
    bucket: str
    epoch: int
    keys: list[str]
    tensors: dict[str, torch.Tensor]  # stacked along dim 0, float32

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class Cursor:
    pass_index: int = 0
    position: int = 0  # next position in the window's order to read
    epoch: int = -1  # data epoch of the samples in `pending`
    pending: dict[str, list[tuple[int, int]]] = field(default_factory=dict)  # bucket -> [(position, row)]

    def state_dict(self) -> dict:
        return {"pass_index": self.pass_index, "position": self.position, "epoch": self.epoch,
                "pending": {b: [list(ref) for ref in refs] for b, refs in self.pending.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "Cursor":
        pending = {b: [tuple(ref) for ref in refs] for b, refs in state["pending"].items()}
        return cls(state["pass_index"], state["position"], state["epoch"], pending)


class StaleShardError(RuntimeError):
    """A shard was made with settings other than the trainer's config."""


class BatchReader:
    """Iterates global batches; `passes` > 1 re-reads a kept window (precompute once, many epochs)."""

    def __init__(self, window: Window, batch_size: int, passes: int = 1,
                 check_record: Callable[[CommitRecord, bytes], None] | None = None,
                 on_read: Callable[[int], None] | None = None,
                 order: Callable[[int], Iterator[tuple[int, CommitRecord]]] | None = None):
        if batch_size < 1:
            raise ValueError("train.batch_size must be at least 1")
        self.window = window
        self.batch_size = batch_size
        self.passes = passes
        self.check_record = check_record
        self.on_read = on_read or window.publish_read
        # Where (position, record) come from: the window's own order, or in a distributed trainer rank 0's,
        # broadcast (train/parallel/order.py)
        self.order = order or window.order
        self.cursor = Cursor()
        self._shards: dict[int, tuple[dict[str, torch.Tensor], list[str]]] = {}

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.cursor.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.cursor = Cursor.from_state(state)
        self._shards.clear()

    def watermark(self) -> int:
        """The lowest position a resume from the current cursor could need."""
        refs = [pos for refs in self.cursor.pending.values() for pos, _ in refs]
        return min(refs + [self.cursor.position])

    # -- iteration -----------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        """Batches in an order that depends on the data alone: a resumed cursor continues exactly.

        The rule: every full batch pending goes out before anything more is read. A shard larger
        than the batch leaves several full batches after it is loaded; a checkpoint taken between
        them stores a cursor that still holds some, and those come first after a resume, before the
        next shard (maybe of another bucket) is read.
        """
        cursor = self.cursor
        while cursor.pass_index < self.passes:
            yield from self._full_batches()  # a resumed cursor's
            for position, record in self.order(cursor.position):
                epoch = cursor.pass_index + record.epoch
                if epoch != cursor.epoch:
                    yield from self._flush()
                    cursor.epoch = epoch
                self._load(position, record)
                cursor.pending.setdefault(record.bucket, []).extend((position, row) for row in range(len(record.keys)))
                cursor.position = position + 1
                self.on_read(cursor.position)
                yield from self._full_batches()
            yield from self._flush()
            cursor.pass_index += 1
            cursor.position = 0

    def _full_batches(self) -> Iterator[Batch]:
        """Every full batch pending, by bucket name (only the bucket read last can hold one)."""
        for bucket in sorted(self.cursor.pending):
            while len(self.cursor.pending.get(bucket, ())) >= self.batch_size:
                yield self._take(bucket, self.batch_size)

    def _flush(self) -> Iterator[Batch]:
        """The end of an epoch: full batches first, then each bucket's remainder as a smaller batch."""
        yield from self._full_batches()
        for bucket in sorted(self.cursor.pending):
            while self.cursor.pending.get(bucket):
                yield self._take(bucket, min(self.batch_size, len(self.cursor.pending[bucket])))

    def _take(self, bucket: str, n: int) -> Batch:
        refs = self.cursor.pending[bucket][:n]
        rows = [self._row(pos, row) for pos, row in refs]
        keys = [self._shards[pos][1][row] for pos, row in refs]
        tensors = {name: torch.stack([r[name] for r in rows]).float() for name in rows[0]}
        remaining = self.cursor.pending[bucket][n:]
        if remaining:
            self.cursor.pending[bucket] = remaining
        else:
            del self.cursor.pending[bucket]
        self._forget_unreferenced()
        return Batch(bucket=bucket, epoch=self.cursor.epoch, keys=keys, tensors=tensors)

    def _row(self, position: int, row: int) -> dict[str, torch.Tensor]:
        if position not in self._shards:  # a pending sample from before a resume
            _, record = next(iter(self.order(position)))
            self._load(position, record)
        tensors, _ = self._shards[position]
        return {name: t[row] for name, t in tensors.items()}

    def _load(self, position: int, record: CommitRecord) -> None:
        data = self.window.read_shard(record)
        if self.check_record is not None:
            self.check_record(record, data)
        tensors, keys, _ = decode_shard(data)
        self._shards[position] = (tensors, keys)

    def _forget_unreferenced(self) -> None:
        live = {pos for refs in self.cursor.pending.values() for pos, _ in refs}
        for pos in [p for p in self._shards if p not in live]:
            del self._shards[pos]
