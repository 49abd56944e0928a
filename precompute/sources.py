"""Raw webdataset shards in, one RawSample per key out; local folders, globs or s3:// prefixes.

A raw shard is a tar whose consecutive members share a key: `<key>.mp4` plus `<key>.txt` or
`<key>.json` (webdataset's convention: the key is the member path up to the first dot of its file
name). Stage 1 must survive whatever a crawl produced, so iter_raw_samples never raises for bad
data: a sample with a problem carries a short reason in `RawSample.error` (the service counts
reasons in its report), and a damaged tar yields its good samples and then one `truncated_tar`.
Storage failures (a shard that cannot be opened at all) do raise: those are not data problems.

Tars are read as a stream (tarfile mode "r|*"), so an S3 shard is never downloaded whole first
and .tar.gz shards work too.
"""

from __future__ import annotations

import json
import tarfile
import zlib
from dataclasses import dataclass
from typing import Iterator

import fsspec
from braceexpand import braceexpand

VIDEO_EXTS = ("mp4", "webm", "mkv", "mov", "m4v", "avi", "video")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
_GLOB_CHARS = "*?["


@dataclass
class RawSample:
    """One sample of a raw shard; `error` is a reason (e.g. "missing_caption") when it is unusable."""

    key: str
    shard: str
    video: bytes | None
    caption: str | None
    error: str | None = None


def _is_shard(path: str) -> bool:
    return path.lower().endswith(SHARD_SUFFIXES)


def _to_url(fs, path: str) -> str:
    """Plain paths for local files (what users typed); protocol URLs for everything else."""
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return path if protocol in ("file", "local") else fs.unstrip_protocol(path)


def _list_one(uri: str) -> list[str]:
    fs, path = fsspec.core.url_to_fs(uri)
    fs.invalidate_cache()  # a producer may have just uploaded shards; never trust a stale listing
    if any(ch in path for ch in _GLOB_CHARS):
        found = [p for p in fs.glob(path) if _is_shard(p)]
    elif fs.isdir(path):
        found = [p for p in fs.find(path) if _is_shard(p)]
    elif fs.isfile(path) and _is_shard(path):
        found = [path]
    else:
        found = []
    return [_to_url(fs, p) for p in found]


def list_raw_shards(uri: str) -> list[str]:
    """Sorted shard URLs under `uri`: a folder, one .tar, a glob, braces, or s3://bucket/prefix."""
    urls: set[str] = set()
    for one in braceexpand(str(uri)):
        urls.update(_list_one(one))
    if not urls:
        raise FileNotFoundError(
            f"no raw .tar shards found at {uri!r}. Give a folder of tars, one .tar file, a glob such as "
            f"'raw/*.tar', braces such as 'raw-{{000000..000009}}.tar', or s3://bucket/prefix; "
            f"make sample shards with: python scripts/make_sample_shards.py --clips DIR --out DIR"
        )
    return sorted(urls)


def split_for_rank(shards: list[str], rank: int, world_size: int) -> list[str]:
    """This rank's share: every world_size-th shard of the sorted list, starting at `rank`.

    Depends only on the list and the two numbers, so every run and every resume agrees. A rank
    gets no shards when there are fewer shards than ranks.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}; need 0 <= rank < world_size")
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


def _to_sample(key: str, shard: str, files: dict[str, bytes]) -> RawSample:
    video = next((files[ext] for ext in VIDEO_EXTS if ext in files), None)
    caption, error = _caption(files)
    if video is None:
        error = "missing_video"  # no video outranks any caption problem: nothing to train on
    return RawSample(key=key, shard=shard, video=video, caption=caption, error=error)


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


def iter_raw_samples(shard_url: str) -> Iterator[RawSample]:
    """The samples of one tar (local path or any fsspec URL such as s3://), in tar order.

    On damage (cut short, garbage header, broken gzip) the sample being read is still yielded if
    it has a whole video and a caption (only an extra member can be lost), else dropped; then one
    RawSample with error "truncated_tar" ends the shard.
    """
    with fsspec.open(shard_url, "rb") as stream:
        key, files = None, {}
        try:
            with tarfile.open(fileobj=stream, mode="r|*", tarinfo=_EndTrackingTarInfo) as tar:
                for member in tar:
                    if not member.isfile():
                        continue
                    member_key, ext = _split_name(member.name)
                    if member_key != key:
                        if key is not None:
                            yield _to_sample(key, shard_url, files)
                        key, files = member_key, {}
                    if ext:
                        files[ext] = _read(tar, member)  # raises if the tar ends inside it
                damaged = not isinstance(getattr(tar, "vt_end_error", None), tarfile.EOFHeaderError)
        except (tarfile.TarError, EOFError, zlib.error):  # cut inside a member, bad gzip ...
            damaged = True
        last = _to_sample(key, shard_url, files) if key is not None else None
        if last is not None and not (damaged and last.error):
            yield last
        if damaged:
            yield RawSample(key=key or "", shard=shard_url, video=None, caption=None, error="truncated_tar")
