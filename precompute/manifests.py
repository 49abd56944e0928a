"""Clip manifests as raw input: a list of clips, each a media URI, a caption and an optional time span.

A manifest is a JSON lines (`.jsonl`, `.ndjson`) or parquet (`.parquet`) file, one clip a record: `video`
(any fsspec path; a relative one is relative to the manifest's folder), `caption`, and optionally `start` /
`end` (seconds on the video's timeline) and `key` (the sample's key; default: the record's line number, six
digits). Every other field is the clip's metadata, stored with the sample in its latent shard
(`meta["clips"]`). A manifest is split into units of UNIT_CLIPS records, units of work as the raw tars are
(`<manifest>#<first>-<end>`), named in sample ids by the manifest's file name. NeMo Curator's video output
is read by curator.py.

Clips are decoded through `MediaRef`s (media_ref.py): seeking into the file, never reading it whole.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import PurePosixPath

import fsspec

from vt.shared.errors import UserError

UNIT_CLIPS = 64
MANIFEST_SUFFIXES = (".jsonl", ".ndjson", ".parquet")
VIDEO_FIELDS = ("video", "media", "path", "uri")
CAPTION_FIELDS = ("caption", "text")


def is_manifest(path: str) -> bool:
    return path.split("#", 1)[0].lower().endswith(MANIFEST_SUFFIXES)


def manifest_units(fs, path: str) -> list[str]:
    """A manifest's units of work: `<path>#<first>-<end>`, UNIT_CLIPS records each."""
    count = _count(fs, path)
    return [f"{path}#{first}-{min(first + UNIT_CLIPS, count)}" for first in range(0, count, UNIT_CLIPS)]


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(
            "data.raw is a parquet manifest, which needs pyarrow: pip install 'vt[parquet]', or "
            "write the manifest as JSON lines (.jsonl)"
        ) from None
    return pq


def _count(fs, path: str) -> int:
    if path.lower().endswith(".parquet"):
        pq = _parquet()
        with fs.open(path, "rb") as handle:
            return pq.ParquetFile(handle).metadata.num_rows
    with fs.open(path, "rb") as handle:
        return sum(1 for line in handle if line.strip())


def unit_name(unit: str) -> str:
    """A unit's name in sample ids: the manifest's file name without its suffix."""
    name = PurePosixPath(unit.split("#", 1)[0]).name
    return name[: name.rfind(".")] if "." in name else name


def iter_manifest_records(unit: str) -> Iterator[tuple[str, dict, str]]:
    """(key, record, folder relative paths start from) of each clip of `unit`."""
    url, _, span = unit.partition("#")
    first, end = (int(v) for v in span.split("-"))
    folder = url.rsplit("/", 1)[0] if "/" in url else "."
    for index, record in _records(url, first, end):
        yield str(record.pop("key", None) or f"{index:06d}"), record, folder


def _records(url: str, first: int, end: int) -> Iterator[tuple[int, dict]]:
    fs, path = fsspec.core.url_to_fs(url)
    if path.lower().endswith(".parquet"):
        with fs.open(path, "rb") as handle:
            table = _parquet().read_table(handle).slice(first, end - first)
        for offset, row in enumerate(table.to_pylist()):
            yield first + offset, row
        return
    with fs.open(path, "rb") as handle:
        index = 0
        for line in handle:
            if not line.strip():
                continue
            if first <= index < end:
                try:
                    record = json.loads(line)
                except (UnicodeDecodeError, json.JSONDecodeError) as err:
                    record = {"__error__": f"line {index + 1} is not JSON: {err}"}
                yield index, record if isinstance(record, dict) else {"__error__": f"line {index + 1} is no object"}
            index += 1
            if index >= end:
                return


def clip_of(record: dict, folder: str) -> tuple[dict, str | None, str]:
    """What one record gives a sample: ({"uri", "start", "end", "caption", "meta"}, error reason, detail)."""
    if "__error__" in record:
        return {}, "manifest_bad_record", record["__error__"]
    uri = next((record.pop(f) for f in VIDEO_FIELDS if isinstance(record.get(f), str)), None)
    caption = next((record.pop(f) for f in CAPTION_FIELDS if isinstance(record.get(f), str)), None)
    start, end = record.pop("start", None), record.pop("end", None)
    clip = {
        "uri": _resolve(uri, folder) if uri else None,
        "start": start,
        "end": end,
        "caption": caption,
        "meta": plain_meta(record),
    }
    if uri is None:
        return clip, "missing_video", f"no {' / '.join(VIDEO_FIELDS)} field"
    if not _span_ok(start, end):
        return clip, "bad_span", f"start {start!r}, end {end!r}: give seconds with 0 <= start < end"
    return clip, None, ""


def plain_meta(meta: dict) -> dict:
    """`meta` as JSON holds it (a parquet timestamp becomes its text), to travel in the shard's header."""
    return json.loads(json.dumps(meta, default=str))


def _span_ok(start, end) -> bool:
    numbers = all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in (start, end))
    return numbers and (start or 0) >= 0 and (end is None or end > (start or 0))


def _resolve(uri: str, folder: str) -> str:
    if "://" in uri or uri.startswith("/") or not folder:
        return uri
    return f"{folder.rstrip('/')}/{uri}"
