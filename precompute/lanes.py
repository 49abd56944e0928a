"""A producer's lanes: which it takes, keeping their leases alive, letting them go.

A window deals its raw shards to a fixed number of lanes (`precompute.lanes`, fixed by the first
producer in lanes.json): lane l reads every L-th raw shard from the l-th and commits its own sequence of
shards, as a torchrun rank did. Any number of `vt-precompute run` processes share the lanes by claiming
them through the window's storage (shared/claims.py): a producer takes a free lane, works it to its
done marker and takes the next; while every lane it holds waits for the trainer it takes one more, so
one producer can feed every lane. A heartbeat thread renews the held leases every claim_seconds / 4 and
writes the producer's record (`workers/<name>.json`: its lanes, counts and rate, for `vt-precompute
status`). Which producer made a shard never shows: the trainer's order depends on the data and the lane
count only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Callable

from vt.shared import lease
from vt.shared.claims import Liveness, free, look
from vt.shared.identity import HOST, identity, pid_tag
from vt.shared.storage import Storage
from vt.shared.window.layout import worker_path

log = logging.getLogger("vt.precompute")


def wanted_lanes(setting: int | None) -> int:
    """`precompute.lanes`, else the launcher's count of producers: torchrun's WORLD_SIZE, a Slurm array's task
    count; else 1. Only the window's first producer's value counts (lanes.json)."""
    if setting is not None:
        return setting
    for name in ("WORLD_SIZE", "SLURM_ARRAY_TASK_COUNT"):
        if int(os.environ.get(name, "1")) > 1:
            return int(os.environ[name])
    return 1


def launcher_index() -> int | None:
    """This process's index among the launcher's producers (torchrun's RANK, a Slurm array task's), if any."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return int(os.environ.get("RANK", "0"))
    if "SLURM_ARRAY_TASK_ID" in os.environ:
        return int(os.environ["SLURM_ARRAY_TASK_ID"]) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))
    return None


def producer_name() -> str:
    """How reports and `vt-precompute status` name this producer: its launcher index, else host and pid (and, in a
    pid namespace of its own, that namespace: containers sharing a hostname may each run it as pid 1)."""
    index = launcher_index()
    if index is not None:
        return f"rank{index}" if "SLURM_ARRAY_TASK_ID" not in os.environ else f"task{index}"
    return f"{HOST}-{os.getpid()}{pid_tag()}"


class LaneHolder:
    """This producer's claims on one window's lanes, renewed by a heartbeat thread until `close`."""

    def __init__(
        self, storage: Storage, lanes: int, claim_seconds: float, name: str, status: Callable[[], dict] = dict
    ):
        self.storage, self.lanes, self.name, self.status = storage, lanes, name, status
        self.claim_seconds = claim_seconds
        self.liveness = Liveness(claim_seconds)
        index = launcher_index()
        self.first = (index if index is not None else zlib.crc32(name.encode())) % lanes
        self.held: dict[int, tuple[int, dict]] = {}  # lane -> (generation, lease record)
        self.finished = False  # every lane had its done marker at the last look (`take`)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._write_record()  # shown by `vt-precompute status` from its start
        self._beat = threading.Thread(target=self._heartbeat, name="vt-lane-heartbeat", daemon=True)
        self._beat.start()

    def take(self) -> tuple[int, int] | None:
        """Claim a free lane that is not done, this producer's own first; (lane, generation), or None."""
        seen = look(self.storage, self.lanes)
        self.finished = all(lane.done for lane in seen.values())
        for lane in [(self.first + i) % self.lanes for i in range(self.lanes)]:
            if lane in self.held or not free(self.storage, lane, seen[lane], self.liveness):
                continue
            record = {"producer": self.name, **identity(), "started": time.time()}
            generation = lease.claim(self.storage, lane, seen[lane].generation, record)
            if generation is not None:
                with self._lock:
                    self.held[lane] = (generation, {**record, "rank": lane, "generation": generation, "beat": 0})
                if seen[lane].generation is not None:
                    log.info("producer %s took lane %d over (generation %d)", self.name, lane, generation)
                return lane, generation
        return None

    def all_done(self) -> bool:
        """Every lane of the window has its done marker (one listing)."""
        return len(self.storage.list("done")) >= self.lanes

    def let_go(self, lane: int) -> None:
        """Release a held lane (its work done, or this producer stopping): another may take it at once."""
        with self._lock:
            generation, _ = self.held.pop(lane)
        lease.release(self.storage, lane, generation)

    def lost(self, lane: int) -> None:
        """Forget a lane another producer took over (this one was fenced): nothing to release."""
        with self._lock:
            self.held.pop(lane, None)

    def close(self) -> None:
        """Stop the heartbeat and release every lane still held (on an error too: they are taken at once)."""
        self._stop.set()
        self._beat.join(timeout=max(5.0, self.claim_seconds))
        for lane in list(self.held):
            try:
                self.let_go(lane)
            except Exception as err:  # noqa: BLE001 - its holder stops anyway; the lane is taken once silent
                log.warning(
                    "lane %d of %s not released (%s); it is taken over once silent", lane, self.storage.uri, err
                )
        self._write_record()

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.claim_seconds / 4):
            try:
                with self._lock:
                    for lane, (generation, record) in self.held.items():
                        lease.renew(self.storage, lane, generation, record)
                self._write_record()
            except Exception as err:  # noqa: BLE001 - an outage past the retries: the next beat tries again
                log.warning(
                    "heartbeat of producer %s failed (%s); retrying in %.0fs", self.name, err, self.claim_seconds / 4
                )

    def _write_record(self) -> None:
        record = {
            "producer": self.name,
            **identity(),
            "lanes": sorted(self.held),
            "updated": time.time(),
            **self.status(),
        }
        self.storage.put_atomic(worker_path(self.name), json.dumps(record).encode())
