"""Producer leases: one writer per lane (a producer rank of the window), even when two producers want it.

Each taker of a lane takes the next generation of it by creating
`leases/p<rank>/<generation:08d>.json` exclusively (the newest generation is the owner), rewrites it
with its beat counted up while it holds the lane (`renew`), and lets it go with a marker beside it,
`<generation:08d>.released`; a second marker, `<generation:08d>.on-<host>`, names the holder's host so a
listing tells it (shared/claims.py says when a lane may be taken). Before it
writes a shard and again before it creates the commit record, a producer lists its rank's leases;
if a newer generation exists it stops with `ProducerFenced`. Object stores cannot tie a write to a
lease, so a replaced producer may still finish the one commit it was in the middle of; the window
stays correct anyway, because commit records are created exclusively and data files are named by
their content, so the two writers never overwrite each other's bytes.

The producer's progress record (its resume state, written before each commit) is kept per
generation too, `progress/p<rank>/<generation:08d>.json`, so a replaced producer can never
overwrite its successor's record. The newest few progress records are kept (a start that commits nothing
writes none) and the leases of the last few generations; older ones are pruned.
"""

from __future__ import annotations

import json
import time

from vt.shared.errors import UserError

from .identity import identity
from .storage import Storage

KEEP_GENERATIONS = 3  # leases of the last few starts; progress records of the last few that wrote one


class ProducerFenced(UserError, RuntimeError):
    """A newer producer took over this rank; this one must stop writing."""


def lease_path(rank: int, generation: int) -> str:
    return f"leases/p{rank}/{generation:08d}.json"


def progress_path(rank: int, generation: int) -> str:
    return f"progress/p{rank}/{generation:08d}.json"


def released_path(rank: int, generation: int) -> str:
    return f"leases/p{rank}/{generation:08d}.released"


HOST_MARK = ".on-"  # <generation:08d>.on-<host>: the host a generation's holder runs on


def host_path(rank: int, generation: int, host: str) -> str:
    return f"leases/p{rank}/{generation:08d}{HOST_MARK}{host}"


def generation_of(rel: str) -> int:
    """The generation in a lease, progress or release marker path ("leases/p0/00000003.json" -> 3)."""
    return int(rel.rsplit("/", 1)[1].split(".", 1)[0])


def _generations(storage: Storage, folder: str) -> list[int]:
    return sorted(generation_of(rel) for rel in storage.list(folder) if rel.endswith(".json"))


def newest_generation(storage: Storage, rank: int) -> int | None:
    gens = _generations(storage, f"leases/p{rank}")
    return gens[-1] if gens else None


def acquire(storage: Storage, rank: int) -> int:
    """Take the next generation of `rank` (exclusive create); returns it. Prunes old generations."""
    generation = (newest_generation(storage, rank) or 0) + 1
    info = {"rank": rank, **identity(), "started": time.time()}
    while not storage.create_exclusive(
        lease_path(rank, generation), json.dumps({**info, "generation": generation}).encode()
    ):
        generation += 1  # another start raced us to this generation: take the next one
    _prune(storage, rank, generation)
    return generation


def read_lease(storage: Storage, rank: int, generation: int) -> dict | None:
    """A lease's record: {"rank", "producer", "host", "boot_id", "pid_ns", "pid", "beat", ...} (the holder's
    identity, shared/identity.py); None once pruned."""
    try:
        return json.loads(storage.read(lease_path(rank, generation)))
    except FileNotFoundError:
        return None


def claim(storage: Storage, rank: int, after: int | None, info: dict) -> int | None:
    """Take lane `rank` as generation after + 1 (exclusive create): of two takers that saw the same newest
    generation `after`, one wins. Returns the generation, or None when another taker got there first."""
    generation = (after or 0) + 1
    record = {**info, "rank": rank, "generation": generation, "beat": 0}
    if not storage.create_exclusive(lease_path(rank, generation), json.dumps(record).encode()):
        return None
    if info.get("host"):  # the holder's host, shown by a listing: takers elsewhere need not read the lease
        storage.put_atomic(host_path(rank, generation, info["host"]), b"")
    _prune(storage, rank, generation)
    return generation


def renew(storage: Storage, rank: int, generation: int, record: dict) -> None:
    """The holder's heartbeat: the lease rewritten with its beat counted up (what a taker watches change)."""
    record["beat"] = record.get("beat", 0) + 1
    storage.put_atomic(lease_path(rank, generation), json.dumps(record).encode())


def release(storage: Storage, rank: int, generation: int) -> None:
    """Let the lane go: any producer may take it at once (its progress record says where to go on). A marker
    beside the lease, so a listing shows it without reading the lease."""
    storage.put_atomic(released_path(rank, generation), b"{}")


def _prune(storage: Storage, rank: int, generation: int) -> None:
    """Leases of generations KEEP_GENERATIONS older than `generation`, and progress records but the newest
    KEEP_GENERATIONS there are. Progress is counted by its own records, not by generations: a start that commits
    nothing (its share of the window full until it stopped) writes none, so a few such starts in a row would
    otherwise prune the one record a restart resumes from."""
    for rel in storage.list(f"leases/p{rank}"):
        if generation_of(rel) <= generation - KEEP_GENERATIONS:
            storage.delete(rel)
    for old in _generations(storage, f"progress/p{rank}")[:-KEEP_GENERATIONS]:
        storage.delete(progress_path(rank, old))


def check(storage: Storage, rank: int, generation: int) -> None:
    """Raise ProducerFenced if a newer producer of `rank` started after generation `generation`."""
    newest = newest_generation(storage, rank)
    if newest is not None and newest > generation:
        try:
            who = json.loads(storage.read(lease_path(rank, newest)))
            where = f" on {who.get('host')} (pid {who.get('pid')})"
        except FileNotFoundError:
            where = ""
        raise ProducerFenced(
            f"lane {rank} of {storage.uri} was taken over by generation {newest}{where} while this producer "
            f"(generation {generation}) held it, silent for longer than precompute.claim_seconds: this producer "
            "lets the lane go and the new holder carries on from the last committed shard"
        )


def write_progress(storage: Storage, rank: int, generation: int, payload: dict) -> None:
    storage.put_atomic(progress_path(rank, generation), json.dumps(payload, sort_keys=True).encode())


def read_progress(storage: Storage, rank: int) -> list[tuple[int, dict]]:
    """(generation, payload) of the rank's progress records, newest generation first."""
    out = []
    for generation in reversed(_generations(storage, f"progress/p{rank}")):
        try:
            out.append((generation, json.loads(storage.read(progress_path(rank, generation)))))
        except FileNotFoundError:  # pruned by a newer start meanwhile
            pass
    return out
