"""A window's state at a glance, for `vt-precompute inspect`, reports and tests.

Separate from window.py because it reads every present commit record (one GET each): fine for a
look at a window, never on the producer's or reader's hot path.
"""

from __future__ import annotations

from . import lease


def window_size(producers: dict[int, dict]) -> int | str:
    """The window size the producers registered with: one value, "unknown" when none recorded it
    (a window written before sizes were recorded), else each rank's ("p0=2, p1=4")."""
    sizes = {rank: info["size"] for rank, info in producers.items() if info.get("size") is not None}
    if not sizes:
        return "unknown"
    if len(set(sizes.values())) == 1 and len(sizes) == len(producers):
        return next(iter(sizes.values()))
    return ", ".join(f"p{rank}={sizes.get(rank, 'unknown')}" for rank in sorted(producers))


def window_state(window) -> dict:
    """Producers, committed / present / unread / evicted shards, consumer positions, bytes,
    per-bucket shard and sample counts, the shards' fingerprints and orphan data files.

    `size` is what the producers registered (window_size), never this Window object's own setting:
    `vt-precompute inspect` opens a window without knowing its size."""
    from .window import seq_of

    storage = window.storage
    consumer = window._consumer()
    records = [r for r in (window.record(int(rel.split("/")[1][1:]), seq_of(rel))
                           for rel in storage.list("commits")) if r is not None]
    data = storage.sizes("data")
    registered = window._producers()
    producers = {}
    for rank, info in sorted(registered.items()):
        committed = window.next_seq(rank, consumer)
        read = consumer["read"].get(rank, 0)
        producers[rank] = {"world_size": info["world_size"], "size": info.get("size", "unknown"),
                           "done": bool(info.get("done")),
                           "num_shards": info.get("num_shards"), "committed": committed,
                           "read": read, "unread": max(0, committed - read),
                           "watermark": consumer["watermark"].get(rank, 0),
                           "generation": lease.newest_generation(storage, rank),
                           "fingerprint": info.get("fingerprint")}
    buckets: dict[str, dict[str, int]] = {}
    for record in records:
        entry = buckets.setdefault(record.bucket, {"shards": 0, "samples": 0})
        entry["shards"] += 1
        entry["samples"] += len(record.keys)
    present_below = sum(1 for r in records if r.seq < consumer["watermark"].get(r.producer, 0))
    named = {r.data for r in records}
    return {"uri": window.uri, "size": window_size(registered), "world_size": window.world_size(),
            "producers": producers,
            "committed": sum(p["committed"] for p in producers.values()),
            "unread": sum(p["unread"] for p in producers.values()),
            "present": len(records),
            "read": consumer["read_position"], "watermark": consumer["watermark_position"],
            "evicted": sum(consumer["watermark"].values()) - present_below,
            "bytes": sum(data.values()),
            "buckets": dict(sorted(buckets.items())),
            "fingerprints": sorted({r.fingerprint for r in records}),
            "orphans": sorted(rel for rel in data if rel not in named)}
