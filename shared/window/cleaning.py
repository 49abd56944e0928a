"""What a window's writers leave behind, removed by the role that owns it.

- Eviction (`evict`): shards below the consumer's watermark, records first, then data, so a crash in
  between leaves orphan data, never a record without its data. Run by the producers while they wait
  for room (the trainer may be gone) and by the trainer after a checkpoint.
- Orphans (`clean_orphans`): a producer rank's data files no record can ever name; run by that rank's
  producer at start and when it finishes.
- Temp files of killed writers (a local `put_atomic` or `create_exclusive` killed mid-write leaves a
  `.<name>.vt-tmp-<host>-<pid>-...` file; an S3 one an uncompleted multipart upload): each role cleans
  its own folders' debris (`clean_producer_debris`, `clean_consumer_debris`), which Storage tells from
  a live write by its writer's pid on this host, or else by age (storage.STALE_TEMP_SECONDS).
"""

from __future__ import annotations

import logging

from ..faults import fault_point
from ..storage import Storage
from . import ledger
from .layout import CONSUMER, seq_of, seqs

log = logging.getLogger("vt.window")


def evict(storage: Storage, rank: int | None = None) -> list[str]:
    """Delete shards below the watermark (all ranks, or one): records first, then data."""
    watermark = ledger.consumer(storage)["watermark"]
    deleted = []
    for k in sorted(watermark if rank is None else [rank]):
        floor = watermark.get(k, 0)
        records = [r for r in storage.list(f"commits/p{k}") if seq_of(r) < floor]
        deleted += delete_records_then_data(
            storage, records, lambda: [r for r in storage.list(f"data/p{k}") if seq_of(r) < floor]
        )
    if deleted:
        log.debug("evicted %d files below the watermark from %s", len(deleted), storage.uri)
    return deleted


def delete_records_then_data(storage: Storage, records: list[str], data) -> list[str]:
    """Delete commit `records`, then the data files (`data`: a list, or a function listing them once the records are
    gone): a crash in between leaves orphan data, never a record without its data. Returns what it deleted."""
    for rel in records:
        storage.delete(rel)
    if records:
        fault_point("window.evict.mid")  # records gone, data still there: orphans, never dangling records
    data = data() if callable(data) else data
    for rel in data:
        storage.delete(rel)
    return [*records, *data]


def clean_orphans(storage: Storage, rank: int, beyond: int | None = None) -> tuple[list[str], dict[int, list[str]]]:
    """Delete `rank`'s data that no record can ever name, and its writers' debris; run by that rank's producer.

    Safe even beside a live writer: other data files of a committed seq than the one its record
    names, data below the watermark whose record is gone (a killed eviction), temp files of dead
    writers and stale multipart uploads. Data of a seq not committed yet may be a live writer's
    next shard: it is kept and returned as leftovers (seq -> paths), for the producer to delete when
    it commits that seq (or, with `beyond`, deleted now when no seq from there on will be). Reads a
    record only for a seq with more than one data file. Returns (removed, leftovers).
    """
    removed = clean_producer_debris(storage, rank)
    floor = ledger.consumer(storage)["watermark"].get(rank, 0)
    committed = seqs(storage.list(f"commits/p{rank}"))
    files: dict[int, list[str]] = {}
    for rel in storage.list(f"data/p{rank}"):
        files.setdefault(seq_of(rel), []).append(rel)
    leftovers: dict[int, list[str]] = {}
    for seq, rels in sorted(files.items()):
        if seq in committed:
            record = ledger.record(storage, rank, seq) if len(rels) > 1 else None
            doomed = [rel for rel in rels if record is not None and rel != record.data]
        elif seq < floor or (beyond is not None and seq >= beyond):
            doomed = rels
        else:
            leftovers[seq], doomed = rels, []
        for rel in doomed:
            storage.delete(rel)
            removed.append(rel)
    if removed:
        log.info("removed %d orphan files of producer %d from %s", len(removed), rank, storage.uri)
    return removed, leftovers


def clean_producer_debris(storage: Storage, rank: int) -> list[str]:
    """Temp files and uploads of killed writes by producer `rank`: its data, records, leases and progress
    folders, its registration, and the shared text/ folder that every producer writes once."""
    removed = []
    for folder in (f"data/p{rank}", f"commits/p{rank}", f"leases/p{rank}", f"progress/p{rank}", "text"):
        removed += storage.clean_incomplete(folder)
    return removed + storage.clean_incomplete("producers", name=f"p{rank}.json")


def clean_consumer_debris(storage: Storage) -> list[str]:
    """Temp files of a trainer killed inside its consumer.json write; run by the trainer's rank 0."""
    removed = storage.clean_incomplete("", name=CONSUMER)
    if removed:
        log.info("removed %d temp files of killed consumer.json writes from %s", len(removed), storage.uri)
    return removed
