"""Whether a lane of a window may be taken: the judgement every producer makes before it claims one.

A lane is free when it was never held, when its holder released it, when its holder's process is gone
from this host (killed, or a zombie not yet reaped), or when its holder fell silent: the beat in its
lease (counted up by the holder's heartbeat, shared/lease.py `renew`) has not changed for
`claim_seconds` as the taker watched it, on the taker's own clock. No two machines' clocks are ever
compared, so clock skew between hosts cannot make a live holder look dead.

Taking a free lane is `lease.claim`: of two takers that judged it free, one creates the next
generation and the other is refused.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable

from . import lease
from .storage import Storage

HOST = socket.gethostname()


class Liveness:
    """What a taker saw of each lane's lease, and since when on its clock: silence is a beat unchanged that long."""

    def __init__(self, claim_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.claim_seconds = claim_seconds
        self.clock = clock
        self._seen: dict[int, tuple[tuple, float]] = {}  # lane -> ((generation, beat), first seen at)

    def silent(self, lane: int, mark: tuple) -> bool:
        now = self.clock()
        seen = self._seen.get(lane)
        if seen is None or seen[0] != mark:
            self._seen[lane] = (mark, now)
            return False
        return now - seen[1] >= self.claim_seconds


def process_gone(record: dict) -> bool:
    """The lease's holder ran on this host and its process no longer runs (or is a zombie)."""
    if record.get("host") != HOST or not isinstance(record.get("pid"), int):
        return False
    pid = record["pid"]
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


def free(storage: Storage, lane: int, liveness: Liveness) -> tuple[bool, int | None]:
    """(may be taken, its newest lease generation or None): see the module docstring."""
    newest = lease.newest_generation(storage, lane)
    if newest is None:
        return True, None
    record = lease.read_lease(storage, lane, newest)
    if record is None:  # pruned by a newer claim between the listing and the read: held
        return False, newest
    gone = record.get("released") or process_gone(record)
    return bool(gone) or liveness.silent(lane, (newest, record.get("beat"))), newest
