"""Whether a lane of a window may be taken: the judgement every producer makes before it claims one.

A lane is free when it is not done and was never held, its holder released it, its holder's process is
gone (killed, or a zombie not yet reaped) from the taker's own pid space (the same host, boot and pid
namespace, shared/identity.py: a container beside the taker, sharing its hostname, is judged by silence
only, since its pids are not the taker's), or its holder fell silent: its lease, rewritten by the holder's
heartbeat every claim_seconds / 4 (shared/lease.py `renew`), stayed unchanged for `claim_seconds` as the
taker watched it, on the taker's own clock. No two machines' clocks are ever compared, so clock skew
between hosts cannot make a live holder look dead.

One look is two listings (`leases/` with each file's stamp and each generation's host marker, `done/`); a
lease is read only when its holder runs on the taker's host (or names none), the first time the taker sees
its generation and once each time it missed a beat (unchanged for claim_seconds / 4), to learn whether
it shares the taker's pid space and its process is gone. So producers watching live holders cost listings only.

Taking a free lane is `lease.claim`: of two takers that judged it free, one creates the next generation
and the other is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from . import lease
from .identity import HOST, shares_pids
from .storage import Storage
from .storage.local import process_gone as pid_gone


@dataclass
class LaneSeen:
    """A lane as one look saw it: its newest lease generation and that file's stamp, released, done."""

    generation: int | None = None
    stamp: str | None = None
    host: str | None = None
    released: bool = False
    done: bool = False


def look(storage: Storage, lanes: int) -> dict[int, LaneSeen]:
    """Every lane's state from one listing of leases/ and one of done/."""
    seen = {lane: LaneSeen() for lane in range(lanes)}
    released, hosts = set(), {}
    for rel, stamp in storage.stamps("leases").items():
        lane, generation = int(rel.split("/")[1][1:]), lease.generation_of(rel)
        if lane not in seen:
            continue
        if rel.endswith(".released"):
            released.add((lane, generation))
        elif lease.HOST_MARK in rel.rsplit("/", 1)[1]:
            hosts[lane, generation] = rel.rsplit(lease.HOST_MARK, 1)[1]
        elif rel.endswith(".json") and generation > (seen[lane].generation or 0):
            seen[lane].generation, seen[lane].stamp = generation, stamp
    for lane, info in seen.items():
        info.released = (lane, info.generation) in released
        info.host = hosts.get((lane, info.generation))
    for rel in storage.list("done"):
        lane = int(rel.rsplit("/", 1)[1][1:])
        if lane in seen:
            seen[lane].done = True
    return seen


class Liveness:
    """What a taker saw of each lane's lease, and since when on its clock."""

    def __init__(self, claim_seconds: float, clock: Callable[[], float] = time.monotonic):
        self.claim_seconds = claim_seconds
        self.clock = clock
        self._seen: dict[int, tuple[tuple, float]] = {}  # lane -> ((generation, stamp), first seen at)
        self._read: set[tuple] = set()  # (lane, mark, phase) whose lease was read

    def unchanged_for(self, lane: int, mark: tuple) -> float | None:
        """Seconds `mark` has stayed the lane's lease; None when it is new to this taker."""
        now = self.clock()
        seen = self._seen.get(lane)
        if seen is None or seen[0] != mark:
            self._seen[lane] = (mark, now)
            return None
        return now - seen[1]

    def should_read(self, lane: int, mark: tuple, quiet: float | None) -> bool:
        """Read the lease when its generation is new to this taker, and once each time it missed a beat (not at
        every beat: a live holder's beats change its stamp, and reading then would cost a GET per lane per look)."""
        if quiet is None:
            key = (lane, mark[0])  # the generation: a new holder
        elif quiet >= self.claim_seconds / 4:
            key = (lane, mark)  # this silence
        else:
            return False
        if key in self._read:
            return False
        self._read.add(key)
        return True


def process_gone(record: dict) -> bool:
    """The lease's holder ran in this process's pid space (host, boot and pid namespace) and its process no longer
    runs (or is a zombie). Of a holder anywhere else, its pid says nothing here."""
    return shares_pids(record) and isinstance(record.get("pid"), int) and pid_gone(record["pid"])


def free(storage: Storage, lane: int, seen: LaneSeen, liveness: Liveness) -> bool:
    """May `lane`, as `look` saw it, be taken now? See the module docstring."""
    if seen.done:
        return False
    if seen.generation is None or seen.released:
        return True
    mark = (seen.generation, seen.stamp)
    quiet = liveness.unchanged_for(lane, mark)
    if quiet is not None and quiet >= liveness.claim_seconds:
        return True
    if seen.host in (None, HOST) and liveness.should_read(lane, mark, quiet):  # another host's: silence only
        record = lease.read_lease(storage, lane, seen.generation)
        return record is not None and process_gone(record)
    return False
