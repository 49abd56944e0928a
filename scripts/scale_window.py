"""A window whose global batches all divide over D ranks, and what each rank should read of it.

Shared by tests/parallel/test_rank_bytes.py (the acceptance test of issue 17's "bytes per rank <= 1/D")
and scripts/bench_scale.py (`make bench`'s scaling rows). Both run vt-train's ranks through
tests/helpers/counting_worker.py, which counts every storage request per rank.

`regroup` re-encodes the committed samples of a finished window into a new kept window: `samples`
samples (cycled if there are fewer, each copy under a new key) of one bucket in shards of
`per_shard`, committed as producer 0 of 1 with the original records' fingerprint and bucket, so a
trainer configured like the source's precompute accepts them. With a batch that is a multiple of
`per_shard` and of D, every global batch is full and every rank's slice has B/D samples.

`run_bytes` says, from the shards themselves, what a run over that window reads: per sample, its rows
of every per-sample tensor plus its caption's stored text rows (the global batch's bytes); per shard,
its header and the caption table's small tensors (index, rows per caption), which every rank touching
the shard reads besides its rows. `expected_rank_bytes` is exactly what rank r of D must read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from vt.train.parallel.batching import slice_bounds

COUNTING_WORKER = Path(__file__).resolve().parents[1] / "tests" / "helpers" / "counting_worker.py"


def regroup(source: Path, dest: Path, samples: int = 16, per_shard: int = 4) -> list:
    """Re-encode `samples` of `source`'s committed samples (its most common bucket, cycled) into a kept window
    at `dest` in shards of `per_shard`; returns the new commit records in order."""
    import torch

    from vt.shared.caption_table import Captions
    from vt.shared.shard_rows import ShardLayout
    from vt.shared.shards import decode_shard, encode_shard
    from vt.shared.storage import Storage
    from vt.shared.window import open_reader, open_writer

    if samples % per_shard:
        raise ValueError(f"{samples} samples do not fill shards of {per_shard}")
    old = open_reader(str(source))
    records = list(old.order())
    bucket = max(
        sorted({r.bucket for _, r in records}), key=lambda b: sum(len(r.keys) for _, r in records if r.bucket == b)
    )
    pool, text_names, meta, fingerprint = [], set(), None, None
    for _, record in records:
        if record.bucket != bucket:
            continue
        data = old.read_shard(record)
        tensors, keys, meta = decode_shard(data)
        text_names = set(ShardLayout.parse(data).text_lengths)
        fingerprint = record.fingerprint
        pool += [(key, {name: t[i] for name, t in tensors.items()}) for i, key in enumerate(keys)]
    if not pool:
        raise ValueError(f"{source} holds no committed samples")
    new = open_writer(str(dest), size="keep")
    new.acquire(0)
    new.register_producer(0, 1, fingerprint)
    src, dst = Storage(str(source)), Storage(str(dest))
    for rel in src.list("text"):  # the empty caption and validation conditions, as precompute left them
        dst.put_atomic(rel, src.read(rel))
    out = []
    for seq in range(samples // per_shard):
        chosen = [pool[i % len(pool)] for i in range(seq * per_shard, (seq + 1) * per_shard)]
        keys = [f"{key}#{seq * per_shard + i}" for i, (key, _) in enumerate(chosen)]
        rows = [row for _, row in chosen]
        # One caption per distinct text (samples cut from one clip share it), as precompute stores them.
        distinct: dict[bytes, int] = {}
        text = [b"".join(_raw(row[n]) for n in sorted(text_names)) for row in rows]
        index = [distinct.setdefault(t, len(distinct)) for t in text]
        firsts = [index.index(c) for c in range(len(distinct))]
        conditions = {n: torch.stack([rows[i][n] for i in firsts]) for n in text_names}
        tensors = {n: torch.stack([row[n] for row in rows]) for n in rows[0] if n not in text_names}
        data = encode_shard(tensors, keys, meta, captions=Captions(conditions, index))
        out.append(new.commit(0, seq, 0, data, bucket, keys, fingerprint))
    new.finish_producer(0, len(out))
    return out


def _raw(tensor) -> bytes:
    """A tensor's bytes as stored (bf16 included, which numpy lacks)."""
    import torch

    return tensor.contiguous().flatten().view(torch.uint8).numpy().tobytes()


@dataclass
class ShardBytes:
    """What one shard costs a reader: header, caption table, and per sample its rows and its caption's."""

    header: int
    table: int
    rows: list[int]  # per sample: its rows of every per-sample tensor
    caption: list[int]  # per sample: the index of its caption
    caption_bytes: list[int]  # per caption: its stored text rows

    def sample_bytes(self, row: int) -> int:
        return self.rows[row] + self.caption_bytes[self.caption[row]]


@dataclass
class RunBytes:
    shards: list[ShardBytes]  # in the window's order
    batch_size: int
    batches: list[list[tuple[int, int]]] = field(default_factory=list)  # (shard, row) of each global batch

    @property
    def global_bytes(self) -> int:
        """Bytes of every global batch of the run: each sample's rows and its caption's text rows."""
        return sum(self.shards[s].sample_bytes(r) for batch in self.batches for s, r in batch)

    def caption_excess(self, samples: int) -> int:
        """The most `samples` samples' bytes can exceed their mean share by: a bucket's samples have rows of one
        size, but captions keep different numbers of text rows, so up to samples x (longest caption - mean)."""
        caps = [
            shard.caption_bytes[shard.caption[r]]
            for batch in self.batches
            for shard, r in ((self.shards[s], r) for s, r in batch)
        ]
        return -(-samples * (max(caps) * len(caps) - sum(caps)) // len(caps))

    def rank_reads(self, rank: int, dp: int) -> dict:
        """What rank `rank` of `dp` reads of the data folder: exactly its rows, each distinct caption of them
        once per shard, and each touched shard's header and caption table once."""
        touched: dict[int, set[int]] = {}
        rows = 0
        for batch in self.batches:
            start, stop = slice_bounds(len(batch), rank, dp)
            for s, r in batch[start:stop] if stop > start else batch[:1]:  # an empty slice: row 0 stands in
                touched.setdefault(s, set()).add(r)
                rows += self.shards[s].rows[r]
        captions = sum(
            self.shards[s].caption_bytes[c]
            for s, rs in touched.items()
            for c in {self.shards[s].caption[r] for r in rs}
        )
        return {
            "shards": len(touched),
            "headers": sum(self.shards[s].header for s in touched),
            "tables": sum(self.shards[s].table for s in touched),
            "rows": rows,
            "captions": captions,
            "data": sum(self.shards[s].header + self.shards[s].table for s in touched) + rows + captions,
        }


def shard_bytes(data: bytes) -> ShardBytes:
    """A committed shard's costs, from its header and caption table (vt.shared.shard_rows.ShardLayout)."""
    import torch

    from vt.shared.shard_rows import ROWS_PREFIX, TEXT_PREFIX, ShardLayout

    layout = ShardLayout.parse(data)
    n = len(layout.keys)
    rows = sum(layout.tensors[name].row_bytes for name in layout.sample_names())
    table = layout.table_ranges()
    lengths = layout.text_lengths
    if not lengths:
        return ShardBytes(layout.size, 0, [rows] * n, list(range(n)), [0] * n)

    def ints(name: str) -> list[int]:
        return torch.frombuffer(bytearray(data[slice(*table[name])]), dtype=torch.int64).tolist()

    index = ints("text_index")
    kept = {name: ints(ROWS_PREFIX + name) for name in lengths}
    captions = len(next(iter(kept.values())))
    caption_bytes = [
        sum(kept[name][c] * layout.tensors[TEXT_PREFIX + name].row_bytes for name in lengths) for c in range(captions)
    ]
    return ShardBytes(layout.size, sum(b - a for a, b in table.values()), [rows] * n, index, caption_bytes)


def run_bytes(window: Path, batch_size: int) -> RunBytes:
    """The shards of a finished one-bucket window in its order, and the run's global batches over them (full
    batches, then the remainder: train/data.py's plan for one bucket, one epoch)."""
    from vt.shared.window import open_reader

    win = open_reader(str(window))
    shards = [shard_bytes(win.read_shard(record)) for _, record in win.order()]
    refs = [(s, r) for s, shard in enumerate(shards) for r in range(len(shard.rows))]
    batches = [refs[i : i + batch_size] for i in range(0, len(refs), batch_size)]
    return RunBytes(shards, batch_size, batches)


def read_counts(prefix: Path, nproc: int) -> list[dict]:
    """Each rank's request counts (counting_worker.py's $VT_STORAGE_COUNTS.<rank>), in rank order."""
    return [json.loads(Path(f"{prefix}.{rank}").read_text()) for rank in range(nproc)]


def rank_row(counts: dict, expected: dict) -> dict:
    """One rank's counted reads of the data folder beside what it should have read."""
    return {
        "data_bytes": counts.get("bytes:data", 0),
        "header_bytes": counts.get("header_bytes:data", 0),
        "table_bytes": expected["tables"],
        "rows_bytes": counts.get("bytes:data", 0) - counts.get("header_bytes:data", 0) - expected["tables"],
        "data_requests": counts.get("reads:data", 0),
        "header_requests": counts.get("headers:data", 0),
        "shards": expected["shards"],
        "lists": counts.get("lists", 0),
        "expected_data_bytes": expected["data"],
    }
