"""Storage rooted at a URI: the only way the two stages touch files they share.

The window protocol (vt.shared.window) needs exactly two guarantees from storage, and this module is
where they are kept, per backend:

- `put_atomic`: a reader sees the old object, or the whole new one, never a torn write.
  Local: write a temp file in the same folder, then `os.replace` (atomic on POSIX). S3: one PUT
  (or a multipart upload, which is invisible until completed); S3 has no partial objects.
- `create_exclusive`: of two writers creating the same path, exactly one wins.
  Local: write a temp file, then `os.link` it to the target, which fails if the target exists.
  S3: a PUT with `If-None-Match: *` (s3fs `pipe_file(mode="create")`, FileExistsError on a 412).
  AWS S3 honours it since 2024, as do moto and MinIO; an S3-compatible store that ignores the
  header would silently overwrite, so use one that supports conditional writes.
  memory:// (one process only): check-then-put under a lock.

Listings are never served from a cache: s3fs is opened with `use_listings_cache=False`, because a
producer and a trainer in different processes must see each other's commits on the next poll.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import fsspec

SUPPORTED = "a local path, file:///abs/path, s3://bucket/prefix or memory://name"
_TEMP_MARK = ".vt-tmp-"  # local temp files carry this; list() hides them
_MEMORY_LOCK = threading.Lock()


class Storage:
    """Files under one root URI, addressed by relative paths like "commits/p0/00000003.json"."""

    def __init__(self, uri: str):
        if not isinstance(uri, str) or not uri.strip():
            raise ValueError(f"storage URI must be a non-empty string ({SUPPORTED}), got {uri!r}")
        self.uri = uri
        protocol, sep, rest = uri.partition("://")
        if not sep or protocol == "file":
            self.protocol = "file"
            self.root = str(Path(rest if sep else uri).expanduser().resolve())
            self.fs = fsspec.filesystem("file")
        elif protocol == "s3":
            bucket = rest.strip("/").split("/")[0]
            if not bucket:
                raise ValueError(f"{uri!r} names no bucket; use s3://bucket/prefix")
            self.protocol = "s3"
            self.root = rest.strip("/")
            self.fs = fsspec.filesystem("s3", use_listings_cache=False)
        elif protocol == "memory":
            self.protocol = "memory"
            self.root = "/" + rest.strip("/")
            self.fs = fsspec.filesystem("memory")
        else:
            raise ValueError(f"unsupported storage URI {uri!r}; use {SUPPORTED}")

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    # -- paths ---------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """Full backend path of a relative path (rejects absolute paths and '..')."""
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if rel.startswith("/") or ".." in parts:
            raise ValueError(f"storage paths are relative to {self.uri} and may not use '..': {rel!r}")
        return "/".join([self.root.rstrip("/"), *parts]) if parts else self.root

    def _rel(self, full: str) -> str:
        prefix = self.root.rstrip("/") + "/"
        assert full.startswith(prefix), (full, prefix)
        return full[len(prefix):]

    # -- reads ---------------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        full = self.path(rel)
        if self.protocol == "file":
            with open(full, "rb") as f:  # FileNotFoundError as is
                return f.read()
        try:
            return self.fs.cat_file(full)
        except FileNotFoundError:
            raise FileNotFoundError(f"{rel} not found under {self.uri}") from None

    def exists(self, rel: str) -> bool:
        full = self.path(rel)
        if self.protocol == "file":
            return os.path.isfile(full)
        return self.fs.isfile(full)

    def size(self, rel: str) -> int:
        full = self.path(rel)
        if self.protocol == "file":
            return os.path.getsize(full)
        try:
            return int(self.fs.size(full))
        except FileNotFoundError:
            raise FileNotFoundError(f"{rel} not found under {self.uri}") from None

    def list(self, prefix: str = "") -> list[str]:
        """Sorted relative paths of all files under the folder `prefix` ("" = everything)."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """{relative path: bytes} of all files under the folder `prefix`, from one listing."""
        base = self.path(prefix)
        if self.protocol == "file":
            out = {}
            for folder, _, files in os.walk(base):
                for name in files:
                    if _TEMP_MARK not in name:
                        full = os.path.join(folder, name)
                        out[self._rel(full)] = os.path.getsize(full)
            return out
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return {}
        return {self._rel(p): int(info.get("size") or 0) for p, info in found.items()
                if info.get("type", "file") == "file" and p.rstrip("/") != base.rstrip("/")}

    # -- writes --------------------------------------------------------------------------------
    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write `data` so that readers see all of it or none of it."""
        full = self.path(rel)
        if self.protocol == "file":
            tmp = self._write_temp(full, data)
            os.replace(tmp, full)
        else:
            self.fs.pipe_file(full, bytes(data))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` with `data` unless it exists; True if this call created it."""
        full = self.path(rel)
        if self.protocol == "file":
            tmp = self._write_temp(full, data)
            try:
                os.link(tmp, full)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)
        if self.protocol == "memory":
            with _MEMORY_LOCK:
                if self.fs.exists(full):
                    return False
                self.fs.pipe_file(full, bytes(data))
                return True
        try:
            self.fs.pipe_file(full, bytes(data), mode="create")
            return True
        except FileExistsError:
            return False

    def delete(self, rel: str) -> None:
        """Delete `rel`; a missing file is fine (eviction and orphan cleaning may race)."""
        full = self.path(rel)
        if self.protocol == "file":
            try:
                os.unlink(full)
            except FileNotFoundError:
                pass
            return
        try:
            self.fs.rm_file(full)
        except FileNotFoundError:
            pass

    @staticmethod
    def _write_temp(full: str, data: bytes) -> str:
        """Write a fully flushed temp file next to `full` (same filesystem, so rename/link work)."""
        folder, name = os.path.split(full)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}{_TEMP_MARK}{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp
