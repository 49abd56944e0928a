"""`vt-precompute pack FOLDER OUT`: a folder of clips and images with caption sidecars -> webdataset tars.

Object storage serves a few large files far better than many small ones, so a folder of media files
(media_files.py) is written as tars of about `shard_bytes` each: `<key>.<ext>` plus its `<key>.txt` /
`<key>.json`, consecutive per sample, keys as the folder gives them (so the samples keep their
identity's key part). OUT may be local or s3://; each tar is written as `.part` and renamed (locally)
or becomes visible only when its upload completes (S3), so a reader never sees half a tar.
"""

from __future__ import annotations

import io
import tarfile
import time
from collections.abc import Iterator

import fsspec

from vt.precompute.media_files import read_media_sample
from vt.precompute.sources import is_media, list_raw_shards, shard_names
from vt.shared.errors import UserError


def _members(folder: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) of every media sample under `folder`, in key order."""
    units = [url for url in list_raw_shards(folder) if is_media(url)]
    if not units:
        raise FileNotFoundError(f"no media files (clips or images) under {folder!r} to pack")
    names = shard_names(units)
    for url in units:
        yield names[url], read_media_sample(url)


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
    tar.addfile(info, io.BytesIO(data))


class _TarStream:
    """One tar being written to `url`: streamed (never whole in memory), committed on close."""

    def __init__(self, fs, path: str, local: bool):
        self.fs, self.path, self.local = fs, path, local
        self.file = fs.open(path + ".part" if local else path, "wb")  # S3: a multipart upload, unseen until close
        self.tar = tarfile.open(fileobj=self.file, mode="w|", format=tarfile.USTAR_FORMAT)

    @property
    def size(self) -> int:
        return self.tar.offset

    def close(self) -> None:
        self.tar.close()
        self.file.close()
        if self.local:
            self.fs.mv(self.path + ".part", self.path)


def pack_folder(folder: str, out: str, shard_bytes: int = 1 << 30, prefix: str = "raw") -> list[str]:
    """Pack the media samples under `folder` into `out/<prefix>-000000.tar ...`; returns their URLs.

    A tar is closed once it holds `shard_bytes` or more; a sample is never split across tars.
    """
    if shard_bytes < 1:
        raise UserError(f"shard size must be at least 1 byte, got {shard_bytes}")
    fs, root = fsspec.core.url_to_fs(out)
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    local = "file" in protocols or "local" in protocols
    if local:
        fs.makedirs(root, exist_ok=True)
    written: list[str] = []
    current: _TarStream | None = None
    now = time.time()
    for key, files in _members(folder):
        if current is None:
            name = f"{prefix}-{len(written):06d}.tar"
            current = _TarStream(fs, f"{root.rstrip('/')}/{name}", local)
            written.append(f"{out.rstrip('/')}/{name}")
        for ext, data in files.items():
            _add(current.tar, f"{key}.{ext}", data, now)
        if current.size >= shard_bytes:
            current.close()
            current = None
    if current is not None:
        current.close()
    return written


def parse_size(text: str) -> int:
    """'512MB', '1GiB', '100k', '2048' -> bytes (decimal units, binary with 'i')."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    cleaned = text.strip().lower().removesuffix("b")
    number = cleaned.rstrip("kmgti")
    unit = cleaned[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in units or value <= 0:
        raise UserError(f"size {text!r} must look like 512MB, 1GiB or 1000000 (bytes)")
    return int(value * units[unit])
