"""One reader of the window's order: rank 0 resolves it, every other trainer rank receives it.

Resolving the fixed order (shared/window/reader.py) lists commits/ and producers/, reads registrations
and commit records, and polls while the next shard is not committed yet. If every rank did that, a job
of D ranks would make D times the listing requests (the requests object storage limits per prefix)
for an answer that is the same on every rank. Here rank 0 alone walks `Window.order` and broadcasts
each (position, commit record) it yields; the other ranks make no listing request and read no commit
record or registration: they read only the data (shards, captions) the records name. Backpressure
(`publish_read`) and eviction stay with rank 0, which holds the resolved order they need.

Lock-step: every rank iterates the same global batches (train/data.py), so the walks of the order
happen in the same sequence on every rank, and each item is one broadcast matched on every rank. A
walk abandoned after one item (a resume re-reading a pending shard) is one broadcast everywhere too.
While rank 0 waits for a shard it broadcasts a heartbeat each poll, so the others wait in a stream
of small collectives, never in one collective longer than the process group's timeout; when rank 0
stops with an error (a window timeout, an evicted position), the others raise the same message.
"""

from __future__ import annotations

from collections.abc import Iterator

from vt.shared.shards import CommitRecord
from vt.shared.window import Window, WindowTimeout

__all__ = ["OrderFromRankZero"]

# Messages rank 0 broadcasts: ("record", position, record json), ("wait",), ("end",), ("error", kind, text)
ERRORS = {"WindowTimeout": WindowTimeout}


class OrderFromRankZero:
    """`order(start)` with Window.order's contract, resolved on rank 0 and broadcast (identity in one process)."""

    def __init__(self, window: Window, world):
        self.window = window
        self.world = world
        self.distributed = world.mesh is not None
        if self.distributed and world.is_main:
            window.reader.on_poll = lambda: world.broadcast_object(("wait",))

    def __call__(self, start: int = 0) -> Iterator[tuple[int, CommitRecord]]:
        if not self.distributed:
            return self.window.order(start)
        return self._resolve(start) if self.world.is_main else self._receive()

    def _resolve(self, start: int) -> Iterator[tuple[int, CommitRecord]]:
        order = self.window.order(start)
        while True:
            try:
                position, record = next(order)
            except StopIteration:
                self.world.broadcast_object(("end",))
                return
            except Exception as err:
                self.world.broadcast_object(("error", type(err).__name__, str(err)))
                raise
            self.world.broadcast_object(("record", position, record.to_json()))
            yield position, record

    def _receive(self) -> Iterator[tuple[int, CommitRecord]]:
        while True:
            message = self.world.broadcast_object(None)
            kind = message[0]
            if kind == "record":
                yield message[1], CommitRecord.from_json(message[2])
            elif kind == "end":
                return
            elif kind == "error":
                raise ERRORS.get(message[1], RuntimeError)(f"rank 0, the reader of the window's order: {message[2]}")
            # "wait": rank 0 is still polling for the next shard
