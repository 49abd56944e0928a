"""A window's state at a glance, for `vt-precompute inspect`, reports and tests.

Apart from the reader and writer because it reads every present commit record (one GET each): fine
for a look at a window, never on the producer's or reader's hot path."""

from __future__ import annotations

from .. import lease
from ..storage import Storage
from . import ledger
from .layout import rank_of, seq_of


def window_size(producers: dict[int, dict]) -> int | str:
    """The window size the producers registered with: one value, "unknown" when none recorded it
    (a window written before sizes were recorded), else each rank's ("p0=2, p1=4")."""
    sizes = {rank: info["size"] for rank, info in producers.items() if info.get("size") is not None}
    if not sizes:
        return "unknown"
    if len(set(sizes.values())) == 1 and len(sizes) == len(producers):
        return next(iter(sizes.values()))
    return ", ".join(f"p{rank}={sizes.get(rank, 'unknown')}" for rank in sorted(producers))


def window_state(storage: Storage) -> dict:
    """Producers, committed / present / unread / evicted shards, consumer positions, bytes,
    per-bucket shard and sample counts, the shards' fingerprints, orphan data files and the
    temp files (or S3 uploads) of writes never finished, with their age in seconds (`leftovers`:
    a killed writer's, until the role that owns them cleans them; see cleaning.py).

    `size` is what the producers registered (window_size), never a Window object's own setting:
    `vt-precompute inspect` opens a window without knowing its size."""
    positions = ledger.consumer(storage)
    records = [
        r
        for r in (ledger.record(storage, rank_of(rel), seq_of(rel)) for rel in storage.list("commits"))
        if r is not None
    ]
    data = storage.sizes("data")
    registered = ledger.producers(storage)
    producers = {}
    for rank, info in sorted(registered.items()):
        committed = ledger.next_seq(storage, rank, positions)
        read = positions["read"].get(rank, 0)
        producers[rank] = {
            "world_size": info["world_size"],
            "size": info.get("size", "unknown"),
            "done": bool(info.get("done")),
            "num_shards": info.get("num_shards"),
            "committed": committed,
            "read": read,
            "unread": max(0, committed - read),
            "watermark": positions["watermark"].get(rank, 0),
            "generation": lease.newest_generation(storage, rank),
            "fingerprint": info.get("fingerprint"),
        }
    buckets: dict[str, dict[str, int]] = {}
    for record in records:
        entry = buckets.setdefault(record.bucket, {"shards": 0, "samples": 0})
        entry["shards"] += 1
        entry["samples"] += len(record.keys)
    present_below = sum(1 for r in records if r.seq < positions["watermark"].get(r.producer, 0))
    named = {r.data for r in records}
    return {
        "uri": storage.uri,
        "size": window_size(registered),
        "world_size": ledger.world_size(storage),
        "producers": producers,
        "committed": sum(p["committed"] for p in producers.values()),
        "unread": sum(p["unread"] for p in producers.values()),
        "present": len(records),
        "read": positions["read_position"],
        "watermark": positions["watermark_position"],
        "evicted": sum(positions["watermark"].values()) - present_below,
        "bytes": sum(data.values()),
        "buckets": dict(sorted(buckets.items())),
        "fingerprints": sorted({r.fingerprint for r in records}),
        "orphans": sorted(rel for rel in data if rel not in named),
        "leftovers": {rel: round(age) for rel, age in sorted(storage.incomplete("").items())},
    }
