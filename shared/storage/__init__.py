"""Storage rooted at a URI: the only way the two stages touch files they share.

The window protocol (vt.shared.window) needs exactly two guarantees from storage, and each backend
(one small class per kind of URI, in `BACKENDS`) keeps them its own way:

- `put_atomic`: a reader sees the old object, or the whole new one, never a torn write.
  Local (local.py): write a temp file in the same folder, then `os.replace` (atomic on POSIX).
  S3 (remote.py): one PUT (or a multipart upload, which is invisible until completed).
- `create_exclusive`: of two writers creating the same path, exactly one wins.
  Local: write a temp file, then `os.link` it to the target, which fails if the target exists.
  S3: a conditional PUT (`If-None-Match: *`). memory:// (one process only): check-then-put under a lock.
  A store that ignores the condition would let both win: `check_exclusive` finds that out (the window's
  first write calls it) and refuses the store.

Transient failures (connection refused or reset, timeouts, HTTP 5xx, throttling, AWS's 409
ConditionalRequestConflict to conditional creates racing for one key) are retried here, in one place,
with a bounded exponential backoff (`RetryPolicy`, retry.py); botocore's and s3fs's own retry loops are
switched off so the bound is the one written here. Logical answers (404 not found, 412 precondition
failed, 403) are never retried: they are the protocol's information. A retried exclusive create is
ambiguous (the first PUT may have landed before its reply was lost), so after a transient failure an
"already exists" holding exactly our bytes counts as our own create.

A killed writer can leave invisible debris, which `clean_incomplete` removes and `incomplete` lists:
local temp files (named with host and pid, so a dead writer's files are told from a live one's,
and any older than STALE_TEMP_SECONDS) and S3 multipart uploads that were never completed.
"""

from __future__ import annotations

import logging
import time
import uuid

from vt.shared.errors import UserError

from .local import STALE_TEMP_SECONDS, LocalBackend
from .remote import MemoryBackend, S3Backend
from .retry import RetryPolicy, StorageUnavailable, is_transient

__all__ = [
    "BACKENDS",
    "STALE_TEMP_SECONDS",
    "SUPPORTED",
    "RetryPolicy",
    "Storage",
    "StorageUnavailable",
    "is_transient",
]

log = logging.getLogger("vt.storage")

SUPPORTED = "a local path, file:///abs/path, s3://bucket/prefix or memory://name"
BACKENDS = {"file": LocalBackend, "s3": S3Backend, "memory": MemoryBackend}  # URI scheme -> backend


class Storage:
    """Files under one root URI, addressed by relative paths like "commits/p0/00000003.json"."""

    def __init__(self, uri: str, retry: RetryPolicy | None = None):
        if not isinstance(uri, str) or not uri.strip():
            raise UserError(f"storage URI must be a non-empty string ({SUPPORTED}), got {uri!r}")
        self.uri = uri
        self.retry = retry or RetryPolicy.from_env()
        protocol, sep, rest = uri.partition("://")
        protocol = protocol if sep else "file"
        if protocol not in BACKENDS:
            raise UserError(f"unsupported storage URI {uri!r}; use {SUPPORTED}")
        self.protocol = protocol
        backend = BACKENDS[protocol]
        self.root = backend.root_of(uri, rest if sep else None)
        self.backend = backend(self.root, self._retrying)

    def __repr__(self) -> str:
        return f"Storage({self.uri!r})"

    # -- paths ---------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        """Full backend path of a relative path (rejects absolute paths and '..')."""
        parts = [p for p in rel.split("/") if p not in ("", ".")]
        if rel.startswith("/") or ".." in parts:
            raise UserError(f"storage paths are relative to {self.uri} and may not use '..': {rel!r}")
        return "/".join([self.root.rstrip("/"), *parts]) if parts else self.root

    def relative(self, full: str) -> str:
        prefix = self.root.rstrip("/") + "/"
        assert full.startswith(prefix), (full, prefix)
        return full[len(prefix) :]

    def _retrying(self, what: str, rel: str, fn, *args):
        """fn(*args), retried on transient errors under self.retry; logical errors pass through at once."""
        started, attempt = time.monotonic(), 0
        while True:
            attempt += 1
            try:
                return fn(*args)
            except Exception as err:
                if not is_transient(err):
                    raise
                delay = self.retry.delay(attempt)
                elapsed = time.monotonic() - started
                if self.retry.gives_up(attempt, elapsed, delay):
                    raise StorageUnavailable(
                        f"{what} {rel!r} under {self.uri} failed {attempt} times over {elapsed:.1f}s, last with "
                        f"{err!r}. The store is unreachable or overloaded: check AWS_ENDPOINT_URL and the network, "
                        f"or allow a longer outage than the retry budget ({self.retry.describe()}) with "
                        "VT_STORAGE_RETRY_SECONDS"
                    ) from err
                log.warning(
                    "storage retry %d in %.2fs: %s %s under %s failed with %r", attempt, delay, what, rel, self.uri, err
                )
                time.sleep(delay)

    # -- reads ---------------------------------------------------------------------------------
    def read(self, rel: str) -> bytes:
        try:
            return self._retrying("read", rel, self.backend.read, self.path(rel))
        except FileNotFoundError:
            raise FileNotFoundError(f"{rel} not found under {self.uri}") from None

    def read_ranges(self, rel: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """The bytes [start, stop) of each range of `rel` (local: seeks in one open file; S3: ranged GETs,
        concurrently); a range past the end of the file comes back short, as a read does."""
        try:
            return self._retrying("read ranges of", rel, self.backend.read_ranges, self.path(rel), list(ranges))
        except FileNotFoundError:
            raise FileNotFoundError(f"{rel} not found under {self.uri}") from None

    def exists(self, rel: str) -> bool:
        return self._retrying("exists", rel, self.backend.exists, self.path(rel))

    def size(self, rel: str) -> int:
        try:
            return self._retrying("size", rel, self.backend.size, self.path(rel))
        except FileNotFoundError:
            raise FileNotFoundError(f"{rel} not found under {self.uri}") from None

    def list(self, prefix: str = "") -> list[str]:
        """Sorted relative paths of all files under the folder `prefix` ("" = everything)."""
        return sorted(self.sizes(prefix))

    def sizes(self, prefix: str = "") -> dict[str, int]:
        """{relative path: bytes} of all files under the folder `prefix`, from one listing."""
        try:
            found = self._retrying("list", prefix, self.backend.find, self.path(prefix))
        except FileNotFoundError:
            return {}
        return {self.relative(full): size for full, size in found.items()}

    def stamps(self, prefix: str = "") -> dict[str, str]:
        """{relative path: a token that changes when the file is rewritten} under `prefix`, from one listing (S3:
        the ETag; local: inode and mtime). Only for telling "rewritten since I last looked" on one's own clock."""
        try:
            found = self._retrying("list", prefix, self.backend.find_stamps, self.path(prefix))
        except FileNotFoundError:
            return {}
        return {self.relative(full): stamp for full, stamp in found.items()}

    # -- writes --------------------------------------------------------------------------------
    def put_atomic(self, rel: str, data: bytes) -> None:
        """Write `data` so that readers see all of it or none of it."""
        point = f"storage.put.mid_write:{rel.split('/', 1)[0]}"  # e.g. storage.put.mid_write:data
        self._retrying("put", rel, self.backend.put, self.path(rel), data, point)

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` with `data` unless it exists; True if this call created it."""
        tries = []

        def attempt() -> bool:
            tries.append(1)
            return self.backend.create(self.path(rel), data)

        if self._retrying("create", rel, attempt):
            return True
        if len(tries) > 1:  # an earlier try may have landed with its reply lost: ours if the bytes match
            try:
                return self.read(rel) == bytes(data)
            except FileNotFoundError:
                return False
        return False

    def check_exclusive(self) -> None:
        """Raise UserError unless the store refuses a second exclusive create of one path (a store that ignores
        S3's `If-None-Match: *` overwrites instead). Two creates and a delete of a probe of its own, once per window:
        a producer's first write to it (shared/window/ledger.py `fix_lanes`)."""
        rel = f"exclusive-probe-{uuid.uuid4().hex}"  # at the root: no folder left behind
        try:
            self.create_exclusive(rel, b"first")
            refused = not self.create_exclusive(rel, b"second")
        finally:
            self.delete(rel)
        if not refused:
            where = f" (endpoint {self.backend.endpoint()})" if hasattr(self.backend, "endpoint") else ""
            raise UserError(
                f"the store at {self.uri}{where} let a second exclusive create of {rel!r} overwrite the first: it "
                "ignores conditional writes (If-None-Match: *), so two producers could both take one lane and "
                "overwrite each other's commit records. Use a store that honours them (AWS S3, MinIO, moto), or "
                "point AWS_ENDPOINT_URL at one"
            )

    def delete(self, rel: str) -> None:
        """Delete `rel`; a missing file is fine (eviction and orphan cleaning may race)."""
        try:
            self._retrying("delete", rel, self.backend.delete, self.path(rel))
        except FileNotFoundError:
            pass

    def incomplete(self, prefix: str = "") -> dict[str, float]:
        """{relative path: age in seconds} of writes under the folder `prefix` not finished (yet, or ever):
        local temp files, S3 multipart uploads. What `vt-precompute inspect` shows as leftovers."""
        found = self.backend.incomplete(self.path(prefix))
        return {self.relative(full): age for full, age in found.items()}

    def clean_incomplete(self, prefix: str, started_before: float | None = None, name: str | None = None) -> list[str]:
        """Remove killed writers' invisible debris under the folder `prefix`; returns what went.

        Local: temp files whose process on this host is gone, or older than STALE_TEMP_SECONDS. S3:
        multipart uploads under the prefix initiated before `started_before` (epoch seconds; default
        now). With `name`, only the debris of writes to `prefix/name` (not the folders below).
        """
        found = self.backend.clean_incomplete(self.path(prefix), name, started_before)
        return [self.relative(full) for full in found]
