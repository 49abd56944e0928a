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

Transient failures (connection refused or reset, timeouts, HTTP 5xx, throttling) are retried here,
in one place, with a bounded exponential backoff (`RetryPolicy`); botocore's and s3fs's own retry
loops are switched off so the bound is the one written here. Logical answers (404 not found, 412
precondition failed, 403) are never retried: they are the protocol's information. A retried
exclusive create is ambiguous (the first PUT may have landed before its reply was lost), so after a
transient failure an "already exists" holding exactly our bytes counts as our own create.

A killed writer can leave two kinds of invisible debris, which `clean_incomplete` removes: local
temp files (named with host and pid, so only a dead writer's files are touched) and S3 multipart
uploads that were never completed.
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import fsspec

from .faults import fault_point

log = logging.getLogger("vt.storage")

SUPPORTED = "a local path, file:///abs/path, s3://bucket/prefix or memory://name"
_TEMP_MARK = ".vt-tmp-"  # local temp files carry this; list() hides them
_HOST = socket.gethostname().replace("-", "_")
STALE_TEMP_SECONDS = 3600.0  # another host's temp file this old is debris, not a write in progress
_MEMORY_LOCK = threading.Lock()
_TRANSIENT_CODES = {"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestTimeout",
                    "InternalError", "ServiceUnavailable", "RequestLimitExceeded", "ProvisionedThroughputExceeded"}


class StorageUnavailable(OSError):
    """A storage operation kept failing with transient errors until the retry budget was spent."""


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff: wait ~base * 2**n (capped), half of it jittered.

    The defaults ride out a store restart or a brown-out of ~20 s; VT_STORAGE_RETRIES sets `attempts`.
    """

    attempts: int = 10  # tries per operation, the first included
    base_seconds: float = 0.1
    max_seconds: float = 5.0

    def delay(self, failures: int) -> float:
        ceiling = min(self.max_seconds, self.base_seconds * 2 ** (failures - 1))
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    @classmethod
    def from_env(cls) -> "RetryPolicy":
        raw = os.environ.get("VT_STORAGE_RETRIES", "")
        if not raw:
            return cls()
        if not raw.isdigit() or int(raw) < 1:
            raise ValueError(f"VT_STORAGE_RETRIES={raw!r} must be a positive integer (attempts per operation)")
        return cls(attempts=int(raw))


def is_transient(err: BaseException) -> bool:
    """True for failures a retry can cure (network, timeouts, 5xx, throttling); False for answers."""
    if isinstance(err, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError,
                        NotADirectoryError)):
        return False
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (ConnectionError, TimeoutError)):  # refused, reset, broken pipe, socket timeouts
            return True
        module = type(err).__module__
        if module.startswith("aiohttp"):  # connection-level errors of s3fs's HTTP client
            return True
        if module.startswith("botocore"):
            response = getattr(err, "response", None)
            if response is None:  # BotoCoreError: endpoint connection, read timeout, parse error ...
                return type(err).__name__ not in ("NoCredentialsError", "ParamValidationError",
                                                  "PartialCredentialsError", "ProfileNotFound")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = response.get("Error", {}).get("Code", "")
            return status >= 500 or status == 429 or code in _TRANSIENT_CODES
        if type(err).__name__ == "FSTimeoutError":
            return True
        err = err.__cause__ or err.__context__
    return False


class Storage:
    """Files under one root URI, addressed by relative paths like "commits/p0/00000003.json"."""

    def __init__(self, uri: str, retry: RetryPolicy | None = None):
        if not isinstance(uri, str) or not uri.strip():
            raise ValueError(f"storage URI must be a non-empty string ({SUPPORTED}), got {uri!r}")
        self.uri = uri
        self.retry = retry or RetryPolicy.from_env()
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
            # Own instance (not fsspec's shared one) so that switching off s3fs's retry loop touches no one else.
            self.fs = fsspec.filesystem("s3", use_listings_cache=False, skip_instance_cache=True,
                                        config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}})
            self.fs.retries = 1
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

    def _retrying(self, what: str, rel: str, fn, *args):
        """fn(*args), retried on transient errors under self.retry; logical errors pass through at once."""
        started = time.monotonic()
        for attempt in range(1, self.retry.attempts + 1):
            try:
                return fn(*args)
            except Exception as err:
                if not is_transient(err):
                    raise
                if attempt == self.retry.attempts:
                    raise StorageUnavailable(
                        f"{what} {rel!r} under {self.uri} failed {attempt} times over "
                        f"{time.monotonic() - started:.1f}s, last with {err!r}. The store is unreachable or "
                        "overloaded: check AWS_ENDPOINT_URL and the network, or allow more attempts with "
                        "VT_STORAGE_RETRIES") from err
                delay = self.retry.delay(attempt)
                log.warning("storage retry %d/%d in %.2fs: %s %s under %s failed with %r", attempt,
                            self.retry.attempts - 1, delay, what, rel, self.uri, err)
                time.sleep(delay)

    # -- reads ---------------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        full = self.path(rel)
        if self.protocol == "file":
            with open(full, "rb") as f:  # FileNotFoundError as is
                return f.read()
        try:
            return self._retrying("read", rel, self.fs.cat_file, full)
        except FileNotFoundError:
            raise FileNotFoundError(f"{rel} not found under {self.uri}") from None

    def exists(self, rel: str) -> bool:
        full = self.path(rel)
        if self.protocol == "file":
            return os.path.isfile(full)
        return self._retrying("exists", rel, self.fs.isfile, full)

    def size(self, rel: str) -> int:
        full = self.path(rel)
        if self.protocol == "file":
            return os.path.getsize(full)
        try:
            return int(self._retrying("size", rel, self.fs.size, full))
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
                        try:
                            out[self._rel(full)] = os.path.getsize(full)
                        except FileNotFoundError:  # deleted (evicted) while we walked
                            pass
            return out
        try:
            found = self._retrying("list", prefix, lambda: self.fs.find(base, detail=True))
        except FileNotFoundError:
            return {}
        return {self._rel(p): int(info.get("size") or 0) for p, info in found.items()
                if info.get("type", "file") == "file" and p.rstrip("/") != base.rstrip("/")}

    # -- writes --------------------------------------------------------------------------------
    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write `data` so that readers see all of it or none of it."""
        full = self.path(rel)
        point = f"storage.put.mid_write:{rel.split('/', 1)[0]}"  # e.g. storage.put.mid_write:data
        if self.protocol == "file":
            tmp = self._write_temp(full, data, point)
            os.replace(tmp, full)
            return
        fault_point(point)  # a killed client's PUT never completes: S3 keeps nothing of it
        self._retrying("put", rel, self.fs.pipe_file, full, bytes(data))

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
        tries = []

        def attempt() -> bool:
            tries.append(1)
            try:
                self.fs.pipe_file(full, bytes(data), mode="create")
                return True
            except FileExistsError:
                return False

        if self._retrying("create", rel, attempt):
            return True
        if len(tries) > 1:  # an earlier try may have landed with its reply lost: ours if the bytes match
            try:
                return self.read(rel) == bytes(data)
            except FileNotFoundError:
                return False
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
            self._retrying("delete", rel, self.fs.rm_file, full)
        except FileNotFoundError:
            pass

    def clean_incomplete(self, prefix: str, started_before: float | None = None) -> list[str]:
        """Remove a killed writer's invisible debris under the folder `prefix`; returns what went.

        Local: temp files of processes on this host that are gone (or another host's, once older
        than STALE_TEMP_SECONDS). S3: multipart uploads under the prefix initiated before
        `started_before` (epoch seconds; default now), which a crash left uncompleted.
        """
        if self.protocol == "file":
            return self._clean_temp(self.path(prefix))
        if self.protocol != "s3":
            return []
        bucket, _, key = self.path(prefix).partition("/")
        cutoff = datetime.datetime.fromtimestamp(started_before or time.time(), datetime.timezone.utc)
        listing = self._retrying("list uploads", prefix, lambda: self.fs.call_s3(
            "list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/"))
        removed = []
        for upload in listing.get("Uploads", []) or []:
            if upload["Initiated"] < cutoff:
                self._retrying("abort upload", upload["Key"], lambda u=upload: self.fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]))
                removed.append(self._rel(f"{bucket}/{upload['Key']}"))
        return removed

    def _clean_temp(self, base: str) -> list[str]:
        removed = []
        for folder, _, files in os.walk(base):
            for name in files:
                if _TEMP_MARK in name and _temp_is_debris(os.path.join(folder, name), name):
                    try:
                        os.unlink(os.path.join(folder, name))
                        removed.append(self._rel(os.path.join(folder, name)))
                    except FileNotFoundError:
                        pass
        return removed

    @staticmethod
    def _write_temp(full: str, data: bytes, point: str | None = None) -> str:
        """Write a fully flushed temp file next to `full` (same filesystem, so rename/link work).

        Its name carries host and pid, so `clean_incomplete` can tell a dead writer's leftovers
        from a live writer's file.
        """
        folder, name = os.path.split(full)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}{_TEMP_MARK}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        with open(tmp, "wb") as f:
            if point is not None:
                half = len(data) // 2
                f.write(data[:half])
                f.flush()
                fault_point(point)  # crash tests: killed with half the bytes in the temp file
                f.write(data[half:])
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp


def _temp_is_debris(full: str, name: str) -> bool:
    try:
        host, pid, _ = name.rsplit(_TEMP_MARK, 1)[1].rsplit("-", 2)
        pid = int(pid)
    except ValueError:
        return _older_than(full, STALE_TEMP_SECONDS)  # not our naming: only by age
    if host != _HOST:
        return _older_than(full, STALE_TEMP_SECONDS)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _older_than(full: str, seconds: float) -> bool:
    try:
        return time.time() - os.path.getmtime(full) > seconds
    except FileNotFoundError:
        return False
