"""The precompute report: what was seen, committed and rejected (by reason), bytes, seconds per stage."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Report:
    rank: int = 0
    seen: int = 0
    committed: int = 0
    skipped_committed: int = 0  # already committed by an earlier run of this producer
    shards: int = 0
    bytes: int = 0
    rejected: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)  # read, decode, text_encode, vae_encode, write, wait
    started: float = field(default_factory=time.perf_counter)

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    def to_dict(self) -> dict:
        elapsed = time.perf_counter() - self.started
        return {"rank": self.rank, "seen": self.seen, "committed": self.committed,
                "rejected": dict(sorted(self.rejected.items())), "rejected_total": sum(self.rejected.values()),
                "skipped_committed": self.skipped_committed, "shards": self.shards, "bytes": self.bytes,
                "seconds": {k: round(v, 3) for k, v in sorted(self.seconds.items())},
                "elapsed_s": round(elapsed, 3), "samples_per_s": round(self.committed / max(elapsed, 1e-9), 3)}

    def summary_line(self) -> str:
        d = self.to_dict()
        reasons = ", ".join(f"{k} {v}" for k, v in d["rejected"].items()) or "none"
        return (f"precompute rank {self.rank}: {d['committed']}/{d['seen']} samples committed in {d['shards']} shards "
                f"({d['bytes'] / 1e6:.2f} MB) in {d['elapsed_s']:.1f}s, {d['samples_per_s']:.2f} samples/s; "
                f"rejected {d['rejected_total']} ({reasons})")

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path
