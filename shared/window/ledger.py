"""The window's small shared records, read and written by both sides: producer registrations, the
consumer's positions (consumer.json), commit records and `next_seq`, which needs all three.

Functions over a Storage: the writer, the reader, cleaning and state each hold their own state and read these
records the same way (the writer and the reader through `LedgerReads`)."""

from __future__ import annotations

import json

from ..shards import CommitRecord
from ..storage import Storage
from .layout import CONSUMER, LANES, WORKERS, commit_path, producer_path, rank_of, seq_of, seqs


def producers(storage: Storage) -> dict[int, dict]:
    """rank -> registration (producers/p<rank>.json) of every registered producer."""
    out = {}
    for rel in storage.list("producers"):
        info = json.loads(storage.read(rel))
        out[int(info["rank"])] = info
    return out


def workers(storage: Storage) -> list[dict]:
    """Every producer's record (workers/<name>.json, written by precompute/lanes.py): its lanes, status and counts;
    one removed while listed is left out."""
    out = []
    for rel in storage.list(WORKERS):
        try:
            out.append(json.loads(storage.read(rel)))
        except FileNotFoundError:
            continue
    return out


def producer(storage: Storage, rank: int) -> dict | None:
    try:
        return json.loads(storage.read(producer_path(rank)))
    except FileNotFoundError:
        return None


def fix_lanes(storage: Storage, wanted: int, raw_shards: int | None = None) -> int:
    """The window's lane count (lanes.json, with the number of raw shards dealt to them): `wanted` if this call
    fixes it, else what its first producer fixed (a window written before lanes.json: its registrations').

    A producer's first write to a window: while there is no lanes.json, the store is first checked to refuse a
    second exclusive create (`Storage.check_exclusive`), since every lease and commit record relies on it; a store
    that does not is refused before anything is written, by every producer that starts on it."""
    known = world_size(storage)
    if known is None:
        storage.check_exclusive()
        if storage.create_exclusive(LANES, json.dumps({"lanes": wanted, "raw_shards": raw_shards}).encode()):
            return wanted
    return known if known is not None else json.loads(storage.read(LANES))["lanes"]


def world_size(storage: Storage) -> int | None:
    """The number of lanes (producer ranks): lanes.json, else the registrations' world size (None before either)."""
    try:
        return json.loads(storage.read(LANES))["lanes"]
    except FileNotFoundError:
        pass
    sizes = {info["world_size"] for info in producers(storage).values()}
    if len(sizes) > 1:
        raise RuntimeError(
            f"producers of {storage.uri} registered different world sizes {sorted(sizes)}; "
            "all ranks of one vt-precompute run must agree; use a fresh window"
        )
    return sizes.pop() if sizes else None


def consumer(storage: Storage) -> dict:
    """consumer.json with its ranks as ints and every field present (an empty window: all zero)."""
    try:
        state = json.loads(storage.read(CONSUMER))
    except FileNotFoundError:
        state = {}
    return {
        "read": {int(k): v for k, v in state.get("read", {}).items()},
        "watermark": {int(k): v for k, v in state.get("watermark", {}).items()},
        "read_position": state.get("read_position", 0),
        "watermark_position": state.get("watermark_position", 0),
    }


def write_consumer(storage: Storage, state: dict) -> None:
    """Only the trainer's rank 0 writes consumer.json; producers only read it."""
    storage.put_atomic(CONSUMER, json.dumps(state, sort_keys=True).encode())


def next_seq(storage: Storage, rank: int, positions: dict | None = None) -> int:
    """First seq of `rank` with no commit record: where a restarted producer resumes.

    Seqs below this rank's watermark were committed even if eviction removed their records."""
    positions = positions if positions is not None else consumer(storage)
    committed = seqs(storage.list(f"commits/p{rank}"))
    seq = positions["watermark"].get(rank, 0)
    while seq in committed:
        seq += 1
    return seq


def next_seqs(storage: Storage, positions: dict | None = None) -> dict[int, int]:
    """`next_seq` of every producer with a commit record present, from one listing of `commits/` (all producers)."""
    positions = positions if positions is not None else consumer(storage)
    committed: dict[int, set[int]] = {}
    for rel in storage.list("commits"):
        committed.setdefault(rank_of(rel), set()).add(seq_of(rel))
    out = {}
    for rank, seqs_of_rank in committed.items():
        seq = positions["watermark"].get(rank, 0)
        while seq in seqs_of_rank:
            seq += 1
        out[rank] = seq
    return out


def record(storage: Storage, rank: int, seq: int) -> CommitRecord | None:
    """The commit record of (rank, seq), or None if it is not committed (or was evicted)."""
    try:
        return CommitRecord.from_json(storage.read(commit_path(rank, seq)))
    except FileNotFoundError:
        return None


class LedgerReads:
    """What both roles read of the ledger, for a class holding the window's `storage` (writer.py, reader.py)."""

    storage: Storage

    def world_size(self) -> int | None:
        """The producers' world size as registered (None before any producer registered)."""
        return world_size(self.storage)

    def next_seq(self, rank: int, consumer: dict | None = None) -> int:
        return next_seq(self.storage, rank, consumer)

    def record(self, rank: int, seq: int) -> CommitRecord | None:
        return record(self.storage, rank, seq)
