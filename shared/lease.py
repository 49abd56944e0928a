"""Producer leases: one writer per producer rank, even when a second one is started by mistake.

Each start of a producer takes the next generation of its rank by creating
`leases/p<rank>/<generation:08d>.json` exclusively (the newest generation is the owner). Before it
writes a shard and again before it creates the commit record, a producer lists its rank's leases;
if a newer generation exists it stops with `ProducerFenced`. Object stores cannot tie a write to a
lease, so a replaced producer may still finish the one commit it was in the middle of; the window
stays correct anyway, because commit records are created exclusively and data files are named by
their content, so the two writers never overwrite each other's bytes.

The producer's progress record (its resume state, written before each commit) is kept per
generation too, `progress/p<rank>/<generation:08d>.json`, so a replaced producer can never
overwrite its successor's record. The newest few generations are kept; older ones are pruned.
"""

from __future__ import annotations

import json
import os
import socket
import time

from .storage import Storage

from vt.shared.errors import UserError

KEEP_GENERATIONS = 3  # progress records of the last few starts, for the rare overlap of two starts


class ProducerFenced(UserError, RuntimeError):
    """A newer producer took over this rank; this one must stop writing."""


def lease_path(rank: int, generation: int) -> str:
    return f"leases/p{rank}/{generation:08d}.json"


def progress_path(rank: int, generation: int) -> str:
    return f"progress/p{rank}/{generation:08d}.json"


def _generations(storage: Storage, folder: str) -> list[int]:
    return sorted(int(rel.rsplit("/", 1)[1].split(".", 1)[0]) for rel in storage.list(folder))


def newest_generation(storage: Storage, rank: int) -> int | None:
    gens = _generations(storage, f"leases/p{rank}")
    return gens[-1] if gens else None


def acquire(storage: Storage, rank: int) -> int:
    """Take the next generation of `rank` (exclusive create); returns it. Prunes old generations."""
    generation = (newest_generation(storage, rank) or 0) + 1
    info = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    while not storage.create_exclusive(lease_path(rank, generation),
                                       json.dumps({**info, "generation": generation}).encode()):
        generation += 1  # another start raced us to this generation: take the next one
    for folder, path in (("leases", lease_path), ("progress", progress_path)):
        for old in _generations(storage, f"{folder}/p{rank}"):
            if old <= generation - KEEP_GENERATIONS:
                storage.delete(path(rank, old))
    return generation


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
            f"two producers are writing as rank {rank} of {storage.uri}: this one (generation {generation}) "
            f"was replaced by generation {newest}{where} and stops. Run exactly one producer per rank; "
            "the newest one carries on from the last committed shard")


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
