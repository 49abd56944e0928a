"""fsspec stores: S3 (one PUT is atomic, conditional PUTs create exclusively) and memory:// (one
process, for tests). Listings are never served from a cache: a producer and a trainer in different
processes must see each other's commits on the next poll."""

from __future__ import annotations

import datetime
import threading
import time

import fsspec

from vt.shared.errors import UserError

from ..faults import fault_point
from ..log import get_logger
from .retry import is_transient

log = get_logger("vt.storage")

_MEMORY_LOCK = threading.Lock()


class FsspecBackend:
    """Full paths are the filesystem's own ("bucket/prefix/rel" on S3, "/name/rel" in memory)."""

    def __init__(self, fs, root: str, retrying):
        self.fs = fs
        self.root = root
        self.retrying = retrying  # Storage._retrying: for the calls made here beyond one per operation

    def read(self, full: str) -> bytes:
        return self.fs.cat_file(full)

    def read_ranges(self, full: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        if not ranges:
            return []
        starts, stops = zip(*ranges)
        return list(self.fs.cat_ranges([full] * len(ranges), list(starts), list(stops), on_error="raise"))

    def exists(self, full: str) -> bool:
        return self.fs.isfile(full)

    def size(self, full: str) -> int:
        return int(self.fs.size(full))

    def find(self, base: str) -> dict[str, int]:
        found = self.fs.find(base, detail=True)
        return {
            p: int(info.get("size") or 0)
            for p, info in found.items()
            if info.get("type", "file") == "file" and p.rstrip("/") != base.rstrip("/")
        }

    def find_stamps(self, base: str) -> dict[str, str]:
        found = self.fs.find(base, detail=True)
        return {
            p: str(info.get("ETag") or info.get("LastModified") or info.get("mtime") or info.get("created"))
            for p, info in found.items()
            if info.get("type", "file") == "file" and p.rstrip("/") != base.rstrip("/")
        }

    def put(self, full: str, data: bytes, point: str) -> None:
        fault_point(point)  # a killed client's PUT never completes: the store keeps nothing of it
        self.fs.pipe_file(full, bytes(data))

    def delete(self, full: str) -> None:
        self.fs.rm_file(full)

    def incomplete(self, base: str) -> dict[str, float]:
        return {}

    def clean_incomplete(self, base: str, name: str | None, started_before: float | None) -> list[str]:
        return []


class MemoryBackend(FsspecBackend):
    """memory:// (one process only): an exclusive create is check-then-put under a lock."""

    def __init__(self, root: str, retrying):
        super().__init__(fsspec.filesystem("memory"), root, retrying)

    @staticmethod
    def root_of(uri: str, rest: str) -> str:
        return "/" + rest.strip("/")

    def create(self, full: str, data: bytes) -> bool:
        with _MEMORY_LOCK:
            if self.fs.exists(full):
                return False
            self.fs.pipe_file(full, bytes(data))
            return True


class S3Backend(FsspecBackend):
    """S3: an exclusive create is a PUT with `If-None-Match: *` (s3fs `pipe_file(mode="create")`,
    FileExistsError on a 412; a 409 ConditionalRequestConflict, AWS's answer to two such creates racing, is
    retried as transient). AWS S3 honours it since 2024, as do moto and MinIO; a store that ignores the header
    would silently overwrite, and the window's first write refuses it (`Storage.check_exclusive`). A killed
    writer's debris is a multipart upload never completed."""

    def __init__(self, root: str, retrying):
        # Own instance (not fsspec's shared one) so that switching off s3fs's retry loop touches no one else.
        # 64 connections (botocore's default is 10): the trainer's rank 0 reads commit records 64 at a time ahead of
        # its walk (window/reader.py), beside the read-ahead's data reads.
        fs = fsspec.filesystem(
            "s3",
            use_listings_cache=False,
            skip_instance_cache=True,
            config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}, "max_pool_connections": 64},
        )
        fs.retries = 1
        quiet_lost_connections()
        super().__init__(fs, root, retrying)

    @staticmethod
    def root_of(uri: str, rest: str) -> str:
        if not rest.strip("/").split("/")[0]:
            raise UserError(f"{uri!r} names no bucket; use s3://bucket/prefix")
        return rest.strip("/")

    def create(self, full: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(full, bytes(data), mode="create")
            return True
        except FileExistsError:
            return False

    def endpoint(self) -> str:
        """The URL requests go to (AWS_ENDPOINT_URL, or AWS's own for the region), for messages."""
        return self.fs.s3.meta.endpoint_url

    def _uploads(self, base: str, name: str | None) -> list[dict]:
        bucket, _, key = base.partition("/")
        prefix = f"{key.rstrip('/')}/" if key else ""
        listing = self.retrying(
            "list uploads",
            base,
            lambda: self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix + (name or "")),
        )
        uploads = listing.get("Uploads", []) or []
        return [u for u in uploads if name is None or u["Key"] == prefix + name]

    def incomplete(self, base: str) -> dict[str, float]:
        now = datetime.datetime.now(datetime.timezone.utc)
        bucket = base.partition("/")[0]
        return {f"{bucket}/{u['Key']}": (now - u["Initiated"]).total_seconds() for u in self._uploads(base, None)}

    def clean_incomplete(self, base: str, name: str | None, started_before: float | None) -> list[str]:
        bucket = base.partition("/")[0]
        cutoff = datetime.datetime.fromtimestamp(started_before or time.time(), datetime.timezone.utc)
        removed = []
        for upload in self._uploads(base, name):
            if upload["Initiated"] < cutoff:
                self.retrying(
                    "abort upload",
                    upload["Key"],
                    lambda u=upload: self.fs.call_s3(
                        "abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]
                    ),
                )
                removed.append(f"{bucket}/{upload['Key']}")
        return removed


def quiet_lost_connections() -> None:
    """On fsspec's event loop (where s3fs's aiohttp sessions run), a connection error that no one awaited
    (aiohttp's connection tasks of a request that failed and was retried here) is logged at debug level
    instead of asyncio's "Task exception was never retrieved" traceback: the retry's own lines say what
    happened, and an outage that the retries rode out must not read as a crash. Anything else still goes
    to the default handler."""
    from fsspec.asyn import get_loop

    global _QUIETED
    loop = get_loop()
    if loop is _QUIETED:
        return
    previous = loop.get_exception_handler()

    def handler(loop, context) -> None:
        err = context.get("exception")
        if err is not None and is_transient(err):
            log.debug("a connection error no request awaited (%s): %r", context.get("message", ""), err)
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    _QUIETED = loop


_QUIETED = None  # the event loop quiet_lost_connections set its handler on
