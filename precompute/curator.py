"""NeMo Curator's video output as raw input, read as its writer means it.

The writer is Curator's `ClipWriterStage` (nemo-curator 1.4.0, nemo_curator/stages/video/io/clip_writer.py).
Under its output folder it writes, for each clip, `metas/v0/<span_uuid>.json` (`source_video`, `duration_span`
[start, end] seconds on the source video's timeline, `framerate` of the transcoded clip, `windows`, `valid`) and,
with `upload_clips`, the transcoded clip `clips/<span_uuid>.mp4`; a clip a filter dropped goes the same way into
`filtered_clips/` (its metadata into the same `metas/v0/`, `valid` unchanged). Last, per video chunk,
`processed_clip_chunks/<video>_<chunk>.json` lists the chunk's `clips` and `filtered_clips` and each window's
caption (`all_windows`, `all_windows_enhanced_caption`: uuid -> "<start_frame>_<end_frame>" -> caption, the first
of the writer's caption models that has one). What that means here:

- A unit of work is one video chunk's file, written after all its clips; an output without them (a copy of
  `metas/v0/` alone) has one unit per clip's metadata, a clip under `filtered_clips/` being filtered.
- A filtered clip is rejected as `filtered_clip`, one Curator marked invalid (no transcoded clip, or no windows)
  as `invalid_clip`: both keyed by the span's uuid.
- Curator captions each window of a clip (`start_frame`..`end_frame`, inclusive, frames of the transcoded clip)
  on its own, so each window is a sample, `<span_uuid>#w<n>`, trained on its own frames with its own caption (an
  enhanced one first); a window without a caption is rejected as `missing_caption`.
- The transcoded clip holds the span alone (Curator cuts it with `-ss start -to end`), so its time 0 is the span's
  start and a window of frames [s, e] is seconds [s / fps, (e + 1) / fps] of it, at most the span's length.
- Where a clip is is the output folder's `clips/<span_uuid>.mp4`, wherever the folder now is: the written
  `clip_location` names it as Curator's working directory saw it. A clip whose file is missing is rejected as
  `missing_clip`; only an output with no `clips/` folder at all (written without `upload_clips`) is read from
  the source videos, the window's span placed on the source's timeline (`source_video` as Curator wrote it: an
  absolute path or URL, or relative to the working directory).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import PurePosixPath

import fsspec

from vt.precompute.manifests import plain_meta

METAS = "metas/v0"
CHUNKS = "processed_clip_chunks"
CLIPS, FILTERED = "clips", "filtered_clips"

# (key, clip {"uri", "start", "end", "caption", "meta"}, error reason or None, detail)
CuratorClip = tuple[str, dict, str | None, str]


def curator_root(fs, path: str) -> str | None:
    """The output folder of a Curator output at `path` (the output folder or its `metas/v0`), else None."""
    path = path.rstrip("/")
    root = path[: -len(METAS) - 1] if path.endswith(f"/{METAS}") else path
    return root if fs.isdir(f"{root}/{METAS}") else None


def curator_units(fs, root: str) -> list[str]:
    """The video chunks' files of the output at `root`, else (none written) its clips' metadata files."""
    chunks = f"{root}/{CHUNKS}"
    found = sorted(p for p in fs.find(chunks) if p.endswith(".json")) if fs.isdir(chunks) else []
    return found or sorted(p for p in fs.find(f"{root}/{METAS}") if p.endswith(".json"))


def is_curator_unit(path: str) -> bool:
    return path.endswith(".json") and (f"/{CHUNKS}/" in path or f"/{METAS}/" in path)


def curator_clips(unit: str) -> Iterator[CuratorClip]:
    """The samples of one unit: each window of each clip, a filtered or invalid clip as one reject."""
    fs, path = fsspec.core.url_to_fs(unit)
    if f"/{CHUNKS}/" in path:
        yield from _chunk_clips(fs, path.split(f"/{CHUNKS}/", 1)[0], path)
        return
    root = path.rsplit(f"/{METAS}/", 1)[0]
    record = json.loads(fs.cat_file(path))
    uuid = str(record.get("span_uuid") or PurePosixPath(path).stem)
    if PurePosixPath(str(record.get("clip_location", ""))).parent.name == FILTERED:
        yield uuid, {}, "filtered_clip", f"Curator filtered clip {uuid}: its clip_location is under {FILTERED}/"
        return
    yield from _windows(fs, root, uuid, record, _meta_captions(record))


def _chunk_clips(fs, root: str, path: str) -> Iterator[CuratorClip]:
    chunk = json.loads(fs.cat_file(path))
    name = path.split(f"/{CHUNKS}/", 1)[1]
    for uuid in chunk.get("clips") or []:
        try:
            record = json.loads(fs.cat_file(f"{root}/{METAS}/{uuid}.json"))
        except FileNotFoundError:
            yield uuid, {}, "missing_clip_meta", f"{CHUNKS}/{name} lists clip {uuid}; {METAS}/{uuid}.json is not there"
            continue
        captions = {}
        for field in ("all_windows", "all_windows_enhanced_caption"):  # an enhanced caption over the plain one
            captions.update((chunk.get(field) or {}).get(uuid) or {})
        yield from _windows(fs, root, uuid, record, captions)
    for uuid in chunk.get("filtered_clips") or []:
        yield uuid, {}, "filtered_clip", f"Curator filtered clip {uuid} ({CHUNKS}/{name} lists it in filtered_clips)"


def _meta_captions(record: dict) -> dict[str, str]:
    """Each window's caption from the clip's metadata: an enhanced one first, else the first model's."""
    captions = {}
    for window in record.get("windows") or []:
        texts = [v for k, v in window.items() if k.endswith("_caption") and isinstance(v, str)]
        enhanced = [v for k, v in window.items() if k.endswith("_enhanced_caption") and isinstance(v, str)]
        if enhanced or texts:
            captions[f"{window.get('start_frame')}_{window.get('end_frame')}"] = (enhanced + texts)[0]
    return captions


def _windows(fs, root: str, uuid: str, record: dict, captions: dict[str, str]) -> Iterator[CuratorClip]:
    meta = plain_meta({k: v for k, v in record.items() if k != "windows"})
    if not record.get("valid", True):
        yield uuid, {}, "invalid_clip", f"Curator marked clip {uuid} invalid (no transcoded clip or no windows)"
        return
    media, error, detail = _media(fs, root, uuid, record)
    if error:
        yield uuid, {}, error, detail
        return
    uri, offset, length, fps = media
    for n, window in enumerate(record.get("windows") or []):
        key, first, last = f"{uuid}#w{n}", window.get("start_frame"), window.get("end_frame")
        if not (isinstance(first, int) and isinstance(last, int) and 0 <= first <= last and first / fps < length):
            yield key, {}, "bad_span", f"window {n} of clip {uuid}: frames {first!r}..{last!r} of {length:g}s"
            continue
        start, end = first / fps, min((last + 1) / fps, length)
        clip = {
            "uri": uri,
            "start": offset + start,
            "end": offset + end,
            "caption": captions.get(f"{first}_{last}"),
            "meta": {**meta, "window": plain_meta(window)},
        }
        yield key, clip, None, ""


def _media(fs, root: str, uuid: str, record: dict) -> tuple[tuple[str, float, float, float], str | None, str]:
    """((uri, where the clip starts in it, the span's length, the clip's frame rate), error, detail)."""
    span, fps = record.get("duration_span"), record.get("framerate") or record.get("framerate_source")
    numbers = isinstance(span, list) and len(span) == 2 and all(isinstance(v, (int, float)) for v in span)
    if not numbers or not 0 <= span[0] < span[1]:
        return ("", 0, 0, 0), "bad_span", f"duration_span {span!r} of clip {uuid}"
    if not isinstance(fps, (int, float)) or fps <= 0:
        return ("", 0, 0, 0), "bad_span", f"clip {uuid} has no framerate to place its windows' frames"
    length = float(span[1] - span[0])
    clip_file = f"{root}/{CLIPS}/{uuid}.mp4"
    if fs.exists(clip_file):
        return (_url(fs, clip_file), 0.0, length, float(fps)), None, ""
    if fs.isdir(f"{root}/{CLIPS}"):
        return ("", 0, 0, 0), "missing_clip", f"{CLIPS}/{uuid}.mp4 is not in the Curator output {root}"
    source = str(record.get("source_video") or "")
    if not source or not fsspec.core.url_to_fs(source)[0].exists(source):
        detail = f"source video {source!r} is not there, and {root} has no {CLIPS}/ (written without upload_clips)"
        return ("", 0, 0, 0), "missing_video", detail
    return (source, float(span[0]), length, float(fps)), None, ""


def _url(fs, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)
