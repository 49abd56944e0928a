"""Local folders: atomic writes by temp file and rename, exclusive creates by hard link.

A temp file is named `.<name>.vt-tmp-<host>-<pid>-<random>` beside its target (same filesystem, so
rename and link work), hidden from listings. A killed writer's temp file is debris once its process
is gone (this host) or, for another host's or an unknown name, once older than STALE_TEMP_SECONDS."""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

from ..faults import fault_point

TEMP_MARK = ".vt-tmp-"  # local temp files carry this; listings hide them
_HOST = socket.gethostname().replace("-", "_")
STALE_TEMP_SECONDS = 3600.0  # another host's temp file this old is debris, not a write in progress


class LocalBackend:
    """Full paths are absolute paths on this machine."""

    def __init__(self, root: str, retrying=None):
        self.root = root

    @staticmethod
    def root_of(uri: str, rest: str | None) -> str:
        return str(Path(rest if rest is not None else uri).expanduser().resolve())

    def read(self, full: str) -> bytes:
        with open(full, "rb") as f:
            return f.read()

    def read_ranges(self, full: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        out = []
        with open(full, "rb") as f:
            for start, stop in ranges:
                f.seek(start)
                out.append(f.read(stop - start))
        return out

    def exists(self, full: str) -> bool:
        return os.path.isfile(full)

    def size(self, full: str) -> int:
        return os.path.getsize(full)

    def find(self, base: str) -> dict[str, int]:
        return {full: stat.st_size for full, stat in _walk(base)}

    def find_stamps(self, base: str) -> dict[str, str]:
        return {full: f"{stat.st_ino}-{stat.st_mtime_ns}-{stat.st_size}" for full, stat in _walk(base)}

    def put(self, full: str, data: bytes, point: str) -> None:
        os.replace(_write_temp(full, data, point), full)

    def create(self, full: str, data: bytes) -> bool:
        tmp = _write_temp(full, data)
        try:
            os.link(tmp, full)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)

    def delete(self, full: str) -> None:
        os.unlink(full)

    def incomplete(self, base: str) -> dict[str, float]:
        """Every temp file under `base` (a live write's or a dead one's), with its age in seconds."""
        now = time.time()
        out = {}
        for full in _temp_files(base, None):
            try:
                out[full] = now - os.path.getmtime(full)
            except FileNotFoundError:
                pass
        return out

    def clean_incomplete(self, base: str, name: str | None, started_before: float | None) -> list[str]:
        removed = []
        for full in _temp_files(base, name):
            if _temp_is_debris(full, os.path.basename(full)):
                try:
                    os.unlink(full)
                    removed.append(full)
                except FileNotFoundError:
                    pass
        return removed


def _walk(base: str):
    """(full path, stat) of every finished file under `base` (temp files left out)."""
    for folder, _, files in os.walk(base):
        for name in files:
            if TEMP_MARK not in name:
                full = os.path.join(folder, name)
                try:
                    yield full, os.stat(full)
                except FileNotFoundError:  # deleted (evicted) while we walked
                    pass


def process_gone(pid: int) -> bool:
    """No process `pid` runs on this host, or it is a zombie (exited, not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _temp_files(base: str, name: str | None) -> list[str]:
    """Temp files under the folder `base`; with `name`, only those of writes to `base/name` (not recursive)."""
    if name is not None:
        try:
            entries = os.listdir(base)
        except FileNotFoundError:
            return []
        return [os.path.join(base, e) for e in entries if e.startswith(f".{name}{TEMP_MARK}")]
    return [os.path.join(folder, e) for folder, _, files in os.walk(base) for e in files if TEMP_MARK in e]


def _write_temp(full: str, data: bytes, point: str | None = None) -> str:
    """Write a fully flushed temp file next to `full`; its name carries host and pid, so
    `clean_incomplete` can tell a dead writer's leftovers from a live writer's file."""
    folder, name = os.path.split(full)
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{name}{TEMP_MARK}{_HOST}-{os.getpid()}-{uuid.uuid4().hex[:12]}")
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
    """Older than STALE_TEMP_SECONDS (a write flushes as it goes, so no live write's file is that old: this
    covers other hosts' writers and reused pids), or sooner when its writer on this host is gone."""
    if _older_than(full, STALE_TEMP_SECONDS):
        return True
    try:
        host, pid, _ = name.rsplit(TEMP_MARK, 1)[1].rsplit("-", 2)
        pid = int(pid)
    except ValueError:
        return False  # not our naming: only by age
    if host != _HOST or pid == os.getpid():
        return False
    return process_gone(pid)


def _older_than(full: str, seconds: float) -> bool:
    try:
        return time.time() - os.path.getmtime(full) > seconds
    except FileNotFoundError:
        return False
