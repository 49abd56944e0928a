"""One reader of the window's order: rank 0 resolves it, every other trainer rank receives it.

Resolving the fixed order (shared/window/reader.py) lists commits/ and producers/, reads registrations
and commit records, and polls while the next shard is not committed yet. If every rank did that, a job
of D ranks would make D times the listing requests (the requests object storage limits per prefix)
for an answer that is the same on every rank. Here rank 0 alone resolves each position the trainer
asks for (`Reader.record_at`) and broadcasts the commit record; the other ranks make no listing request and read no commit
record or registration: they read only the data (shards, captions) the records name. Backpressure
(`publish_read`) and eviction stay with rank 0, which holds the resolved order they need.

Lock-step: every rank plans the same global batches (train/data.py), so it asks for the same positions
in the same sequence, and each answer is one broadcast matched on every rank. A read-ahead asks without
waiting (block=False): rank 0 answers "not yet" for a shard not committed, and every rank stops looking
ahead at the same point. While rank 0 waits for a shard it broadcasts a heartbeat each poll, so the others wait in a stream
of small collectives, never in one collective longer than the process group's timeout; when rank 0
stops with an error (a window timeout, an evicted position), the others raise the same message.
"""

from __future__ import annotations

from vt.shared.shards import CommitRecord
from vt.shared.window import Reader, WindowTimeout
from vt.shared.window.reader import NotYet

__all__ = ["OrderFromRankZero"]

# Messages rank 0 broadcasts: ("record", record json), ("end",), ("notyet",), ("wait",), ("error", kind, text)
ERRORS = {"WindowTimeout": WindowTimeout}


class OrderFromRankZero:
    """`order(position, block)` with Reader.record_at's contract, resolved on rank 0 and broadcast (the window's
    own in one process)."""

    def __init__(self, window: Reader, world):
        self.window = window
        self.world = world
        self.distributed = world.mesh is not None
        if self.distributed and world.is_main:
            window.on_poll = lambda: world.broadcast_object(("wait",))

    def __call__(self, position: int, block: bool = True) -> CommitRecord | None:
        if not self.distributed:
            return self.window.record_at(position, block)
        return self._resolve(position, block) if self.world.is_main else self._receive()

    def _resolve(self, position: int, block: bool) -> CommitRecord | None:
        try:
            record = self.window.record_at(position, block)
        except NotYet:
            self.world.broadcast_object(("notyet",))
            raise
        except Exception as err:
            self.world.broadcast_object(("error", type(err).__name__, str(err)))
            raise
        self.world.broadcast_object(("end",) if record is None else ("record", record.to_json()))
        return record

    def _receive(self) -> CommitRecord | None:
        while True:
            message = self.world.broadcast_object(None)
            kind = message[0]
            if kind == "record":
                return CommitRecord.from_json(message[1])
            if kind == "end":
                return None
            if kind == "notyet":
                raise NotYet("rank 0 has not seen the next shard committed yet")
            if kind == "error":
                raise ERRORS.get(message[1], RuntimeError)(f"rank 0, the reader of the window's order: {message[2]}")
            # "wait": rank 0 is still polling for the next shard
