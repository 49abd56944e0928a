"""`vt-precompute status WINDOW`: how far stage 1 is, from the window's storage alone.

Raw shards complete / being worked / waiting in the pass each lane is in (a lane's progress record), each
lane's holder, each producer's lanes, samples committed and rate (its `workers/` record, renewed with its
heartbeat), and the rejects by reason. Any machine that can read the window can run it.
"""

from __future__ import annotations

import json
import time
from collections import Counter

from vt.shared import lease
from vt.shared.claims import LaneSeen, look
from vt.shared.storage import Storage
from vt.shared.window import ledger
from vt.shared.window.layout import LANES


def _raw_shards(storage: Storage) -> int | None:
    try:
        return json.loads(storage.read(LANES)).get("raw_shards")
    except FileNotFoundError:
        return None


def _lane(storage: Storage, lane: int, lanes: int, total: int | None, seen: LaneSeen) -> dict:
    mine = len(range(lane, total, lanes)) if total is not None else None
    holder = lease.read_lease(storage, lane, seen.generation) if seen.generation is not None else None
    records = lease.read_progress(storage, lane)
    after = records[0][1]["after"] if records else {"epoch": 0, "complete": []}
    complete = sum(last - first + 1 for first, last in after["complete"])
    state = "done" if seen.done else "held" if seen.generation is not None and not seen.released else "waiting"
    return {
        "state": state,
        "raw_shards": mine,
        "complete": mine if state == "done" else complete,
        "pass": after["epoch"],
        "holder": (holder or {}).get("producer") if state == "held" else None,
        "generation": seen.generation,
    }


def window_status(storage: Storage) -> dict:
    """The window's lanes and producers as `vt-precompute status` prints them (also its --json)."""
    lanes = ledger.world_size(storage) or 0
    total = _raw_shards(storage)
    by_lane = {lane: _lane(storage, lane, lanes, total, seen) for lane, seen in look(storage, lanes).items()}
    counts = Counter()
    for lane in by_lane.values():
        left = (lane["raw_shards"] or 0) - lane["complete"]
        counts["complete"] += lane["complete"]
        counts["being_worked" if lane["state"] == "held" else "waiting"] += max(0, left)
    producers, rejected = {}, Counter()
    for record in ledger.workers(storage):
        rejected.update(record.get("rejected", {}))
        producers[record["producer"]] = {**record, "seconds_since_update": round(time.time() - record["updated"], 1)}
    return {
        "uri": storage.uri,
        "lanes": lanes,
        "raw_shards": total,
        **{k: counts[k] for k in ("complete", "being_worked", "waiting")},
        "by_lane": by_lane,
        "producers": producers,
        "rejected": dict(sorted(rejected.items())),
    }


def format_status(status: dict) -> str:
    lines = [
        f"window {status['uri']}: {status['lanes']} lanes over {status['raw_shards'] or '?'} raw shards",
        f"raw shards: {status['complete']} complete, {status['being_worked']} being worked, "
        f"{status['waiting']} waiting (in each lane's current pass)",
        "lane  state    pass  complete  holder",
    ]
    for lane, info in status["by_lane"].items():
        mine = "?" if info["raw_shards"] is None else info["raw_shards"]
        lines.append(
            f"{lane:<5} {info['state']:<8} {info['pass']:>4}  {info['complete']:>4}/{mine:<4} {info['holder'] or '-'}"
        )
    lines.append("producer                    lanes     status   committed  samples/s  updated")
    for name, p in sorted(status["producers"].items()):
        lanes = ",".join(map(str, p.get("lanes") or p.get("worked") or [])) or "-"  # held now, else worked
        lines.append(
            f"{name:<27} {lanes:<9} {p.get('status', '?'):<8} {p.get('committed', 0):>9}  "
            f"{p.get('samples_per_s', 0):>9.2f}  {p['seconds_since_update']:.0f}s ago"
        )
    reasons = ", ".join(f"{k} {v}" for k, v in status["rejected"].items()) or "none"
    lines.append(f"rejected: {reasons}")
    return "\n".join(lines)
