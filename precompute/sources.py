"""Raw webdataset shards in, one RawSample per key out; local folders, globs or s3:// prefixes.

A raw shard is a tar whose consecutive members share a key: `<key>.mp4` (or any extension in
VIDEO_EXTS; or a still image in IMAGE_EXTS, a sample of the one-frame buckets) plus `<key>.txt` or
`<key>.json` (webdataset's convention: the key is the member path up to the first dot of its file
name). A folder may also hold media files with caption sidecars instead of tars (media_files.py):
each is a one-sample unit of its own. Stage 1 must survive whatever a crawl produced, so
iter_raw_samples never raises for bad data: a sample with a problem carries a short reason in
`RawSample.error` (the service counts reasons in its report and lists them in rejects.jsonl), and a
damaged tar yields its good samples and then one `truncated_tar`. Storage failures (a shard that
cannot be opened at all) do raise: those are not data problems.

A sample's identity is its raw shard plus its key, since hand-made sets number keys per shard
(every tar holds `000000`, `000001`, ...). `RawSample.sample_id` is what latent shards, commit
records and trainer logs call the sample's key: `<shard name>/<key>`, where the shard name is the
tar's path below the common folder of *all* listed raw shards without `.tar` / `.tar.gz` / `.tgz`
(`shard_names`; e.g. raw/a/000.tar and raw/b/000.tar -> `a/000/<key>`, `b/000/<key>`). It is
computed from the whole list, before the per-rank split, so every rank names a shard alike. A key
that repeats inside one tar is bad input: the first sample is kept, a later one is rejected as
`duplicate_key`. A member whose extension the current sample already has (`a.mp4` twice, as
`tar --append` leaves it) starts a new sample with the same key, which is then a duplicate_key
rather than silently overwriting the first video.

A sample may also carry a control video (pose, depth, edges ...), for families that train on one
(`ModelSpec.control_video`): the member `<key>.<control>.<ext>` (`<key>.control.mp4` by default,
`data.control` names it; any extension of VIDEO_EXTS or IMAGE_EXTS), read only when asked for
(`iter_raw_samples(..., control=...)`). Asked for and absent, the sample is rejected as `missing_control`.

Tars are read as a stream (tarfile mode "r|*"), so an S3 shard is never downloaded whole first
and .tar.gz shards work too.

A clip manifest (JSON lines or parquet, named as a file or a glob) or a NeMo Curator output folder is
raw input too (manifests.py, curator.py): its units are runs of records (a Curator output's: its video
chunks), and its samples carry a `MediaRef` (the media URI and the clip's span) instead of bytes, decoded
by seeking.
"""

from __future__ import annotations

import json
import tarfile
import zlib
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import fsspec
from braceexpand import braceexpand

from vt.precompute.curator import curator_clips, curator_root, curator_units, is_curator_unit
from vt.precompute.manifests import clip_of, is_manifest, iter_manifest_records, manifest_units, unit_name
from vt.precompute.media_files import pick_media, read_media_sample, split_key
from vt.precompute.media_ref import MediaRef
from vt.shared.errors import UserError

# Extensions of the video files FFmpeg (so PyAV) demuxes with their timing, in the order one is
# picked when a sample holds several. Raw H.264 / HEVC elementary streams (.h264, .264, .hevc) are
# left out: they carry no timestamps to sample by.
VIDEO_EXTS = (
    "mp4",
    "m4v",
    "mov",
    "qt",
    "mkv",
    "mk3d",
    "webm",
    "avi",
    "divx",  # MPEG-4 / QuickTime, Matroska, AVI
    "ts",
    "m2ts",
    "mts",
    "m2t",
    "tsv",  # MPEG transport stream (broadcast, AVCHD cameras)
    "mpg",
    "mpeg",
    "mpe",
    "m1v",
    "m2v",
    "mpv",
    "vob",
    "evo",
    "mod",
    "tod",  # MPEG program / elementary, DVD
    "wmv",
    "asf",
    "flv",
    "f4v",
    "3gp",
    "3g2",
    "ogv",
    "ogm",  # Windows Media, Flash, mobile, Ogg
    "mxf",
    "dv",
    "dif",
    "y4m",
    "nut",
    "ivf",
    "rm",
    "rmvb",
    "wtv",
    "dvr-ms",
    "amv",
    "nsv",  # broadcast, raw, others
    "video",  # webdataset's generic name
)
# Still images: samples of one-frame buckets (1xHxW). A sample with a video and an image is its video.
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
MEDIA_EXTS = VIDEO_EXTS + IMAGE_EXTS
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_GLOB_CHARS = "*?["


@dataclass
class RawSample:
    """One sample of a raw shard; `error` is a reason (e.g. "missing_caption") when it is unusable.

    `key` is the key inside the tar (webdataset's `__key__`), `name` the shard's name in sample
    keys (see the module docstring) and `position` the sample's ordinal in its tar (0, 1, ...),
    which tells two samples of one repeated key apart.
    """

    key: str
    shard: str
    video: bytes | MediaRef | None  # a manifest's clip: its file and span, decoded by seeking
    caption: str | None
    error: str | None = None
    detail: str = ""  # what was wrong, when `error` alone does not say it
    name: str = ""
    position: int = 0
    still: bool = False  # `video` holds a still image (IMAGE_EXTS), not a clip
    meta: dict | None = None  # the .json member's fields, when it holds a JSON object (caption processor)
    control: bytes | None = None  # the control video (`<key>.control.mp4`), when one was asked for
    clip: dict | None = None  # a manifest's record: uri, span and metadata, kept with the sample in its shard

    @property
    def sample_id(self) -> str:
        """The sample's key in latent shards, commit records and logs: `<shard name>/<key>`."""
        return f"{self.name}/{self.key}" if self.name else self.key


def _is_shard(path: str) -> bool:
    return path.lower().endswith(SHARD_SUFFIXES)


def is_media(path: str) -> bool:
    """A video or image file of a raw folder (precompute/media_files.py), not a tar."""
    return split_key(path)[1] in MEDIA_EXTS


def _units(paths: list[str]) -> list[str]:
    """The tars among `paths`, plus one media file per sample key (its video, else its image)."""
    return [p for p in paths if _is_shard(p)] + pick_media((p for p in paths if is_media(p)), MEDIA_EXTS)


def _to_url(fs, path: str) -> str:
    """Plain paths for local files (what users typed); protocol URLs for everything else."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def _list_one(uri: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache()  # a producer may have just uploaded shards; never trust a stale listing
    if any(ch in path for ch in _GLOB_CHARS):
        matched = fs.glob(path)
        found = _units(matched) + [unit for p in sorted(matched) if is_manifest(p) for unit in manifest_units(fs, p)]
    elif (root := curator_root(fs, path)) is not None:  # NeMo Curator's output: a unit per video chunk (curator.py)
        found = curator_units(fs, root)
    elif fs.isdir(path):
        found = _units(fs.find(path))  # a folder's manifests are not read: name one as data.raw
    elif fs.isfile(path) and is_manifest(path):
        found = manifest_units(fs, path)
    elif fs.isfile(path) and (_is_shard(path) or is_media(path)):
        found = [path]
    else:
        found = []
    return [_to_url(fs, p) for p in found]


def list_raw_shards(uri: str) -> list[str]:
    """Sorted shard URLs under `uri`: a folder, one .tar, a glob, braces, or s3://bucket/prefix.

    A media file with caption sidecars (a folder of clips, see media_files.py) is a one-sample unit
    of its own, listed as its video or image file."""
    urls: set[str] = set()
    for one in braceexpand(str(uri)):
        urls.update(_list_one(one))
    if not urls:
        raise FileNotFoundError(
            f"no raw .tar shards, media files or clips of a manifest found at {uri!r}. Give a folder of tars "
            f"or of clips and images with .txt/.json captions, one .tar file, a clip manifest (.jsonl, "
            f".parquet), a NeMo Curator output folder, a glob such as "
            f"'raw/*.tar', braces such as 'raw-{{000000..000009}}.tar', or s3://bucket/prefix; "
            f"make sample shards with: python scripts/make_sample_shards.py --clips DIR --out DIR"
        )
    return sorted(urls)


def _strip_suffix(name: str) -> str:
    if is_media(name):
        return split_key(name)[0]  # a media file's name is its sample key
    lower = name.lower()
    suffix = next((s for s in SHARD_SUFFIXES if lower.endswith(s)), "")
    return name[: len(name) - len(suffix)] if suffix else name


def shard_names(shards: list[str]) -> dict[str, str]:
    """Each shard URL -> its name in sample keys: its path below the common folder of all `shards`,
    without .tar / .tar.gz / .tgz ("raw/a/x.tar", "raw/b/x.tar" -> "a/x", "b/x"; one shard -> "x").

    Give it the full list (before split_for_rank) so every rank names every shard alike. Two tars
    that differ only in their suffix (x.tar, x.tgz) keep their suffixes, so names stay unique. A
    manifest's units are named by the manifest (manifests.unit_name): their keys are unique across them; a
    Curator output's by nothing (its keys are the spans' uuids).
    """
    listed = [url for url in shards if not (is_manifest(url) or is_curator_unit(url))]
    return {**{url: _unit_name(url) for url in shards if url not in set(listed)}, **_tar_names(listed)}


def _unit_name(url: str) -> str:
    return "" if is_curator_unit(url) else unit_name(url)


def _tar_names(shards: list[str]) -> dict[str, str]:
    parts = {url: url.split("/") for url in shards}
    common = 0
    for column in zip(*(p[:-1] for p in parts.values())):
        if len(set(column)) != 1:
            break
        common += 1
    names = {url: "/".join(p[common:]) for url, p in parts.items()}
    stripped = {url: _strip_suffix(name) for url, name in names.items()}
    uses = Counter(stripped.values())
    return {url: stripped[url] if uses[stripped[url]] == 1 else names[url] for url in shards}


def split_for_rank(shards: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's share: every world_size-th shard of the sorted list, starting at `rank`.

    Depends only on the list and the two numbers, so every run and every resume agrees. A rank
    gets no shards when there are fewer shards than ranks.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise UserError(f"rank {rank} is not in a world of size {world_size}; need 0 <= rank < world_size")
    return sorted(shards)[rank::world_size]


def _split_name(name: str) -> tuple[str, str]:
    """'dir/clip-001.mp4' -> ('dir/clip-001', 'mp4'); the key ends at the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    key = f"{folder}/{stem}" if folder else stem
    return key, ext.lower() if dot else ""


def _caption(files: dict[str, bytes]) -> tuple[str | None, str | None]:
    """(caption, error reason) from the .txt member, else the .json member's "caption"/"text"."""
    if "txt" in files:
        raw, source = files["txt"], "txt"
    elif "json" in files:
        raw, source = files["json"], "json"
    else:
        return None, "missing_caption"
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None, "caption_not_utf8"
    if source == "json":
        try:
            meta = json.loads(text)
        except json.JSONDecodeError:
            return None, "caption_bad_json"
        if not isinstance(meta, dict):
            return None, "caption_bad_json"
        value = meta.get("caption", meta.get("text"))
        if value is None:
            return None, "missing_caption"
        if not isinstance(value, str):
            return None, "caption_bad_json"
        text = value
    text = text.strip()
    if not text:
        return None, "empty_caption"
    return text, None


def _meta(files: dict[str, bytes]) -> dict | None:
    """The .json member as a dict (None without one, or when it is not a JSON object)."""
    try:
        meta = json.loads(files["json"].decode("utf-8")) if "json" in files else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) else None


class _Samples:
    """Turns the member groups of one tar into RawSamples: positions, and the first-key-wins rule."""

    def __init__(self, shard: str, name: str, control: str | None = None):
        self.shard, self.name, self.control = shard, name, control
        self.seen: set[str] = set()
        self.position = 0

    def make(self, key: str, files: dict[str, bytes]) -> RawSample:
        video = next((files[ext] for ext in VIDEO_EXTS if ext in files), None)
        image = next((files[ext] for ext in IMAGE_EXTS if ext in files), None)
        still = video is None and image is not None
        video = image if still else video
        caption, error = _caption(files)
        detail = ""
        control = (
            next((files[f"{self.control}.{ext}"] for ext in MEDIA_EXTS if f"{self.control}.{ext}" in files), None)
            if self.control
            else None
        )
        if video is None:
            error = "missing_video"  # no video or image outranks any caption problem: nothing to train on
        elif self.control and control is None:  # as does a missing control video, for a family that needs one
            error = "missing_control"
            detail = (
                f"no {key}.{self.control}.mp4 (or another video extension) beside it in {self.shard}: "
                f"the model family trains on a control video per sample (data.control names the member)"
            )
        if key in self.seen:  # a repeat outranks everything: the first sample of the key is the one
            error, caption, video, control = "duplicate_key", None, None, None  # nothing of it is used
            detail = f"key {key!r} came earlier in {self.shard}; the first sample with it is kept"
        self.seen.add(key)
        return self._next(
            RawSample(
                key=key,
                shard=self.shard,
                video=video,
                caption=caption,
                error=error,
                detail=detail,
                meta=_meta(files) if video is not None else None,
                still=still and video is not None,
                control=control,
            )
        )

    def damaged(self, key: str) -> RawSample:
        """The marker that ends a damaged tar; `key` is the sample that was being read."""
        return self._next(
            RawSample(
                key=key,
                shard=self.shard,
                video=None,
                caption=None,
                error="truncated_tar",
                detail=f"the tar ends or is damaged after {self.position} samples",
            )
        )

    def _next(self, sample: RawSample) -> RawSample:
        sample.name, sample.position = self.name, self.position
        self.position += 1
        return sample


class _EndTrackingTarInfo(tarfile.TarInfo):
    """Remembers why the header read that ended the archive failed.

    tarfile stops quietly, as if the archive had ended, when a header is missing, cut short or
    garbage. Only an all-zero block (EOFHeaderError) is a real end-of-archive marker; any other
    ending means the tar was damaged, which the caller must report.
    """

    @classmethod
    def fromtarfile(cls, tarfile_obj):
        try:
            return super().fromtarfile(tarfile_obj)
        except tarfile.HeaderError as err:
            tarfile_obj.vt_end_error = err
            raise


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    return handle.read() if handle is not None else b""


def iter_raw_samples(shard_url: str, name: str | None = None, control: str | None = None) -> Iterator[RawSample]:
    """The samples of one tar (local path or any fsspec URL such as s3://), in tar order; or the one
    sample of a media file with its caption sidecars.

    `control`: the member name of each sample's control video (`"control"`: `<key>.control.mp4`), read into
    `RawSample.control` (a sample without one is rejected as `missing_control`); None reads none.

    `name` is the shard's name in sample ids (from shard_names over all shards; default: the file
    name without its suffix). On damage (cut short, garbage header, broken gzip) the sample being
    read is still yielded if it has a whole video and a caption (only an extra member can be lost),
    else dropped; then one RawSample with error "truncated_tar" ends the shard.
    """
    if is_manifest(shard_url) or is_curator_unit(shard_url):
        yield from _manifest_samples(shard_url, _unit_name(shard_url) if name is None else name, control)
        return
    if is_media(shard_url):  # one sample of a folder of clips: its name is its key
        key = shard_names([shard_url])[shard_url] if name is None else name
        yield _Samples(shard_url, "", control).make(key, read_media_sample(shard_url, control))
        return
    samples = _Samples(shard_url, shard_names([shard_url])[shard_url] if name is None else name, control)
    with fsspec.open(shard_url, "rb") as stream:
        key, files = None, {}
        try:
            with tarfile.open(fileobj=stream, mode="r|*", tarinfo=_EndTrackingTarInfo) as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    member_key, ext = _split_name(member.name)
                    # A new key, or an extension this sample already has, starts the next sample.
                    if member_key != key or (ext and ext in files):
                        if key is not None:
                            yield samples.make(key, files)
                        key, files = member_key, {}
                    if ext:
                        files[ext] = _read(tar, member)  # raises if the tar ends inside it
                damaged = not isinstance(getattr(tar, "vt_end_error", None), tarfile.EOFHeaderError)
        except (tarfile.TarError, EOFError, zlib.error):  # cut inside a member, bad gzip ...
            damaged = True
        last = samples.make(key, files) if key is not None else None
        if last is not None and not (damaged and last.error):
            yield last
        if damaged:
            yield samples.damaged(key or "")


def _unit_clips(unit: str) -> Iterator[tuple[str, dict, str | None, str]]:
    """(key, clip, error, detail) of each clip of a manifest unit or a Curator output's unit."""
    if is_curator_unit(unit):
        yield from curator_clips(unit)
        return
    for key, record, folder in iter_manifest_records(unit):
        yield key, *clip_of(record, folder)


def _manifest_samples(unit: str, name: str, control: str | None) -> Iterator[RawSample]:
    """The clips of one manifest unit as RawSamples: a MediaRef each (a still image's bytes), the caption,
    the record's other fields as `meta`; a record's problem is its `error` (manifests.clip_of, curator.py)."""
    seen: set[str] = set()
    for position, (key, clip, error, detail) in enumerate(_unit_clips(unit)):
        caption = (clip.get("caption") or "").strip() or None
        if error is None and caption is None:
            error, detail = ("empty_caption" if clip.get("caption") is not None else "missing_caption"), ""
        if error is None and control:
            error = "missing_control"
            detail = "a clip manifest carries no control videos; pack such samples into tars (data.control)"
        if key in seen:
            error, detail = "duplicate_key", f"key {key!r} came earlier in {unit}; the first clip with it is kept"
        seen.add(key)
        video, still = None, False
        if error is None:
            uri = clip["uri"]
            still = split_key(uri)[1] in IMAGE_EXTS
            video = (
                _read_still(uri)
                if still
                else MediaRef(uri, float(clip["start"] or 0.0), None if clip["end"] is None else float(clip["end"]))
            )
            if video is None:
                error, detail, still = "missing_video", f"{uri} is not there", False
        yield RawSample(
            key=key,
            shard=unit,
            video=video,
            caption=caption,
            error=error,
            detail=detail,
            name=name,
            position=position,
            still=still,
            meta=clip.get("meta") if video is not None else None,
            clip={k: clip.get(k) for k in ("uri", "start", "end", "meta")} if video is not None else None,
        )


def _read_still(uri: str) -> bytes | None:
    fs, path = fsspec.core.url_to_fs(uri)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        return None
