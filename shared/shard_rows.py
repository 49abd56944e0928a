"""Some rows of a latent shard, read by byte range: the header once, then only the rows asked for.

A data-parallel trainer rank trains on its slice of each global batch, so it needs only those samples'
rows of a shard (issue 17: reads proportional to 1/D). A shard is one safetensors file whose tensors
are stacked along dim 0, one row per sample, so one sample's row of a tensor is one contiguous byte
range, and the header (8 bytes of length, then JSON) gives every tensor's dtype, shape and offsets.

Reading rows: the header (its size and sha256 are pinned in the commit record), then per tensor the
byte range of each run of consecutive rows asked for; the caption table's small tensors whole; of
its text rows, only the captions the rows refer to. Adjacent ranges merge into one request.

Checking rows: the whole file's sha256 (the commit record's) cannot be checked from a part of it, so
`encode_shard` stores digests in the header: one per sample over its rows of every per-sample tensor
(`row_sha256`), one per caption over its text rows (`caption_sha256`), one over the caption table's
index and row counts (`table_sha256`). Each piece read is checked against its digest, and the header
against the record: a byte changed anywhere a reader reads is caught, as with the whole-file check.

torch is imported inside the functions that need it (see shards.py).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["RowsCorrupt", "ShardLayout", "digests_of", "header_size", "merge_ranges"]

# safetensors dtype names -> torch dtype names (torch is imported late)
DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}
TEXT_PREFIX, ROWS_PREFIX, INDEX, CHOICES = "text.", "text_rows.", "text_index", "text_choices"  # caption_table.py's

Range = tuple[int, int]  # [start, stop) in bytes from the start of the file
Pick = Callable[[int, list[int]], int]  # (row, the sample's captions) -> the caption (table row) it trains on


class RowsCorrupt(ValueError):
    """Bytes read from a shard do not match the digest its header holds for them."""


def header_size(data: bytes) -> int:
    """Bytes from the start of a safetensors file to its first tensor byte (8 + the header's length)."""
    (length,) = struct.unpack("<Q", bytes(data[:8]))
    return 8 + length


def merge_ranges(ranges: Iterable[Range]) -> list[Range]:
    """Sorted ranges with touching or overlapping ones joined: one request each."""
    merged: list[list[int]] = []
    for start, stop in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(a, b) for a, b in merged]


def _runs(rows: Sequence[int]) -> list[tuple[int, int]]:
    """Sorted distinct rows as runs [first, stop) of consecutive rows."""
    runs: list[list[int]] = []
    for row in sorted(set(rows)):
        if runs and row == runs[-1][1]:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1])
    return [(a, b) for a, b in runs]


@dataclass(frozen=True)
class TensorSpan:
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    stop: int

    @property
    def row_bytes(self) -> int:
        return (self.stop - self.start) // self.shape[0] if self.shape and self.shape[0] else 0

    def rows(self, first: int, stop: int) -> Range:
        return self.start + first * self.row_bytes, self.start + stop * self.row_bytes


@dataclass(frozen=True)
class ShardLayout:
    """Where every tensor of a shard lies, from its header alone."""

    size: int  # header bytes, 8-byte length included
    tensors: dict[str, TensorSpan]
    metadata: dict[str, str]

    @classmethod
    def parse(cls, header: bytes) -> "ShardLayout":
        size = header_size(header)
        obj = json.loads(bytes(header[8:size]))
        metadata = obj.pop("__metadata__", None) or {}
        tensors = {
            name: TensorSpan(
                info["dtype"], tuple(info["shape"]), size + info["data_offsets"][0], size + info["data_offsets"][1]
            )
            for name, info in obj.items()
        }
        return cls(size, tensors, metadata)

    # -- what the shard says about itself ---------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        return json.loads(self.metadata["keys"])

    @property
    def meta(self) -> dict:
        return json.loads(self.metadata["meta"])

    @property
    def text_lengths(self) -> dict[str, int]:
        return json.loads(self.metadata.get("text_lengths", "{}"))

    @property
    def has_digests(self) -> bool:
        return "row_sha256" in self.metadata

    def sample_names(self) -> list[str]:
        return sorted(n for n in self.tensors if not _is_text(n))

    def table_names(self) -> list[str]:
        return sorted(n for n in self.tensors if n in (INDEX, CHOICES) or n.startswith(ROWS_PREFIX))

    # -- byte ranges ----------------------------------------------------------------------------------
    def sample_ranges(self, rows: Sequence[int]) -> dict[str, list[Range]]:
        """name -> the byte ranges of `rows` of each per-sample tensor, one per run of consecutive rows."""
        return {name: [self.tensors[name].rows(a, b) for a, b in _runs(rows)] for name in self.sample_names()}

    def table_ranges(self) -> dict[str, Range]:
        return {name: (self.tensors[name].start, self.tensors[name].stop) for name in self.table_names()}

    def caption_ranges(self, kept: dict[str, list[int]], captions: Iterable[int]) -> dict[int, dict[str, Range]]:
        """caption -> name -> byte range of its stored text rows; `kept`: each name's rows per caption."""
        out: dict[int, dict[str, Range]] = {}
        for caption in sorted(set(captions)):
            out[caption] = {}
            for name in sorted(kept):
                span = self.tensors[TEXT_PREFIX + name]
                first = sum(kept[name][:caption])
                out[caption][name] = span.rows(first, first + kept[name][caption])
        return out

    # -- reading ---------------------------------------------------------------------------------------
    def read_rows(
        self, rows: Sequence[int], fetch: Callable[[list[Range]], list[bytes]], pick: Pick | None = None
    ) -> dict[str, "Tensor"]:
        """name -> (len(rows), ...) tensors of `rows` (in that order), captions padded back as `decode_shard`
        gives them; `fetch(ranges)` returns the bytes of each range. Every piece is checked against its digest.
        A sample with several captions gets `pick(row, its captions)`'s (its first without `pick`)."""
        if not self.has_digests:
            raise ValueError("this shard's header holds no row digests (written before vt read shards by rows)")
        wanted = list(rows)
        runs = _runs(wanted)
        sample = self.sample_ranges(wanted)
        lengths = self.text_lengths
        table = self.table_ranges() if lengths else {}
        pieces = _Pieces(fetch, [r for ranges in sample.values() for r in ranges] + list(table.values()))
        # The table first: which caption each row refers to, and how many rows each caption keeps.
        table_bytes = {name: pieces.get(*span) for name, span in table.items()}
        if lengths:
            _check(
                b"".join(table_bytes[n] for n in sorted(table_bytes)),
                self.metadata["table_sha256"],
                "the caption table",
            )
        by_run = {
            name: {first: pieces.get(*span) for (first, _), span in zip(runs, ranges)}
            for name, ranges in sample.items()
        }
        digests = json.loads(self.metadata["row_sha256"])
        for row in set(wanted):
            _check(
                b"".join(_row_bytes(by_run[name], runs, row, self.tensors[name].row_bytes) for name in sample),
                digests[row],
                f"sample row {row}",
            )
        order = [_position(runs, row) for row in wanted]
        stacked = {name: self._rows_tensor(name, by_run[name], runs)[order] for name in sample}
        if lengths:
            stacked.update(self._captions(wanted, table_bytes, lengths, fetch, pick))
        return stacked

    def _rows_tensor(self, name: str, chunks: dict[int, bytes], runs: list[tuple[int, int]]) -> "Tensor":
        """The runs' rows of tensor `name`, concatenated in run order."""
        import torch

        span = self.tensors[name]
        data = bytearray(b"".join(chunks[first] for first, _ in runs))
        count = sum(b - a for a, b in runs)
        if not data:
            return torch.empty((count, *span.shape[1:]), dtype=getattr(torch, DTYPES[span.dtype]))
        return torch.frombuffer(data, dtype=getattr(torch, DTYPES[span.dtype])).reshape(count, *span.shape[1:])

    def _captions(
        self, rows: list[int], table_bytes: dict[str, bytes], lengths: dict[str, int], fetch, pick: Pick | None
    ) -> dict[str, "Tensor"]:
        """name -> (len(rows), L, ...): each row's caption text padded back to its full length."""
        import torch

        index = torch.frombuffer(bytearray(table_bytes[INDEX]), dtype=torch.int64).tolist()
        if CHOICES in table_bytes and pick is not None:  # several captions of a sample: the one `pick` draws
            width = self.tensors[CHOICES].shape[1]
            flat = torch.frombuffer(bytearray(table_bytes[CHOICES]), dtype=torch.int64).reshape(-1, width).tolist()
            for row in set(rows):
                index[row] = pick(row, [c for c in flat[row] if c >= 0])
        kept = {
            name: torch.frombuffer(bytearray(table_bytes[ROWS_PREFIX + name]), dtype=torch.int64).tolist()
            for name in lengths
        }
        wanted = [index[row] for row in rows]
        ranges = self.caption_ranges(kept, wanted)
        pieces = _Pieces(fetch, [span for spans in ranges.values() for span in spans.values()])
        digests = json.loads(self.metadata["caption_sha256"])
        per_caption: dict[int, dict[str, "Tensor"]] = {}
        for caption, spans in ranges.items():
            data = {name: pieces.get(*span) for name, span in spans.items()}
            _check(b"".join(data[n] for n in sorted(data)), digests[caption], f"caption {caption}'s text")
            per_caption[caption] = {}
            for name, chunk in data.items():
                span = self.tensors[TEXT_PREFIX + name]
                dtype = getattr(torch, DTYPES[span.dtype])
                stored = (
                    torch.frombuffer(bytearray(chunk), dtype=dtype).reshape(-1, *span.shape[1:])
                    if chunk
                    else torch.empty((0, *span.shape[1:]), dtype=dtype)
                )
                padded = stored.new_zeros((lengths[name], *span.shape[1:]))
                padded[: stored.shape[0]] = stored
                per_caption[caption][name] = padded
        return {name: torch.stack([per_caption[c][name] for c in wanted]) for name in lengths}


class _Pieces:
    """Fetches the merged cover of some ranges in one call, then hands out each range's bytes."""

    def __init__(self, fetch: Callable[[list[Range]], list[bytes]], ranges: list[Range]):
        self.cover = merge_ranges(r for r in ranges if r[1] > r[0])
        self.data = fetch(self.cover) if self.cover else []

    def get(self, start: int, stop: int) -> bytes:
        if stop <= start:
            return b""
        for (a, b), chunk in zip(self.cover, self.data):
            if a <= start and stop <= b:
                return chunk[start - a : stop - a]
        raise AssertionError(f"range {start}-{stop} was not fetched")


def _is_text(name: str) -> bool:
    return name in (INDEX, CHOICES) or name.startswith((TEXT_PREFIX, ROWS_PREFIX))


def _position(runs: list[tuple[int, int]], row: int) -> int:
    """Index of `row` among the runs' rows, in run order."""
    offset = 0
    for a, b in runs:
        if a <= row < b:
            return offset + row - a
        offset += b - a
    raise KeyError(row)


def _row_bytes(chunks: dict[int, bytes], runs: list[tuple[int, int]], row: int, row_bytes: int) -> bytes:
    for a, b in runs:
        if a <= row < b:
            start = (row - a) * row_bytes
            return chunks[a][start : start + row_bytes]
    raise KeyError(row)


def _check(data: bytes, digest: str, what: str) -> None:
    found = hashlib.sha256(data).hexdigest()
    if found != digest:
        raise RowsCorrupt(f"{what}: sha256 {found[:12]}... but the shard's header says {digest[:12]}...")


def digests_of(data: bytes) -> dict[str, str]:
    """The row digests `read_rows` checks, as header metadata, of a shard's safetensors bytes."""
    layout = ShardLayout.parse(data)
    keys = layout.keys
    rows = [
        hashlib.sha256(
            b"".join(bytes(data[slice(*layout.tensors[n].rows(i, i + 1))]) for n in layout.sample_names())
        ).hexdigest()
        for i in range(len(keys))
    ]
    out = {"row_sha256": json.dumps(rows)}
    lengths = layout.text_lengths
    if lengths:
        table = layout.table_ranges()
        out["table_sha256"] = hashlib.sha256(b"".join(bytes(data[slice(*table[n])]) for n in sorted(table))).hexdigest()
        import torch

        kept = {
            name: torch.frombuffer(bytearray(data[slice(*table[ROWS_PREFIX + name])]), dtype=torch.int64).tolist()
            for name in lengths
        }
        captions = len(next(iter(kept.values())))
        ranges = layout.caption_ranges(kept, range(captions))
        out["caption_sha256"] = json.dumps(
            [
                hashlib.sha256(b"".join(bytes(data[slice(*ranges[c][n])]) for n in sorted(ranges[c]))).hexdigest()
                for c in range(captions)
            ]
        )
    return out
