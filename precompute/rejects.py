"""Which samples a producer rejected and why: `rejects.jsonl` in the run folder, one JSON line each.

    {"epoch": 0, "shard": "raw/crawl-000003.tar", "position": 17, "key": "crawl-000003/000017",
     "reason": "corrupt_video", "detail": "PyAV cannot open it: ..."}

`shard` is the raw tar as listed, `position` the sample's ordinal in it (0, 1, ...), `key` the
sample's key as latent shards and logs name it (`<shard name>/<key in the tar>`, see sources.py),
`reason` the counter name of precompute_report.json. A part of a raw sample rejected alone while the chain kept
its other parts (a scene of a split video, processors/chain.py) has a line of its own, keyed by the part's key
(`<key>#s<n>`). With several lanes each has its own file,
`rejects.lane<l>.jsonl`, written by whichever producer holds the lane.

Lines are appended and flushed as samples are rejected, so a killed producer's file holds what it
rejected so far. A restarted producer keeps the file and its lines, and writes each (epoch, shard,
position) once: re-reading a raw shard that was only partly done rejects the same samples again,
and those are not listed twice (a line is known by epoch, shard, position and key). A producer that starts with nothing committed in its window starts
the file anew. A line cut by a kill is dropped on restart.
"""

from __future__ import annotations

import json
from pathlib import Path


def rejects_name(lane: int, lanes: int) -> str:
    """The file name: rejects.jsonl, or rejects.lane<l>.jsonl with several lanes."""
    return "rejects.jsonl" if lanes == 1 else f"rejects.lane{lane}.jsonl"


class RejectLog:
    """Appends one line per rejected sample to `path`; `keep` carries on an earlier run's file."""

    def __init__(self, path: Path, keep: bool):
        self.path = path
        self.listed: set[tuple[int, str, int, str]] = set()  # (epoch, shard, position, key) already in the file
        path.parent.mkdir(parents=True, exist_ok=True)
        if keep and path.exists():
            self._load()
        else:
            path.write_bytes(b"")
        self._file = open(path, "a", encoding="utf-8")

    def _load(self) -> None:
        data = self.path.read_bytes()
        whole = data[: data.rfind(b"\n") + 1]  # a line cut short by a kill is dropped
        if len(whole) != len(data):
            self.path.write_bytes(whole)
        for line in whole.decode("utf-8").splitlines():
            if line.strip():
                entry = json.loads(line)
                self.listed.add((entry["epoch"], entry["shard"], entry["position"], entry["key"]))

    def add(self, epoch: int, shard: str, position: int, key: str, reason: str, detail: str) -> bool:
        """List one rejected sample; False if this (epoch, shard, position, key) is listed already."""
        identity = (epoch, shard, position, key)
        if identity in self.listed:
            return False
        self.listed.add(identity)
        entry = {"epoch": epoch, "shard": shard, "position": position, "key": key, "reason": reason, "detail": detail}
        self._file.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._file.flush()
        return True

    def close(self) -> None:
        self._file.close()
