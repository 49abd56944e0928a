"""What a producer did, live and at the end.

`Report`: samples seen, committed and rejected (by reason; each rejected sample is listed in
`rejects_file`, see rejects.py), bytes written and seconds per stage
(read, decode, text_encode, vae_encode, write, and wait: time blocked on a full window). Written as
JSON at the end of a run, also when it fails (with the error), so a crashed or stopped run still
says how far it got. Counts cover this process's run; after a restart, `skipped_committed` and
`skipped_shards` count what earlier runs had already committed.

`ProgressBar`: one line on stderr with clips/s, MB written, shards and the window fill (the latest
lane's committed-unread shards against its share), unless log.progress is off; every producer logs
its summary line at the end.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from vt.shared.progress import Progress
from vt.shared.startup import StartupTimeline

STAGES = ("read", "decode", "text_encode", "vae_encode", "write", "wait")


@dataclass
class Report:
    producer: str = "producer"  # this producer's name (precompute/lanes.py producer_name)
    lanes: list[int] = field(default_factory=list)  # the lanes it worked, in the order it took them
    seen: int = 0
    committed: int = 0
    skipped_committed: int = 0  # samples an earlier run of this producer already committed
    skipped_shards: int = 0  # raw shards an earlier run had fully handled (not read again)
    shards: int = 0
    bytes: int = 0
    generation: int | None = None  # its first lane's lease generation (1 for a first start)
    resumed_at: int = 0  # the seq its first lane started committing at
    status: str = "running"
    rejects_file: str | None = None  # where the rejected samples are listed (rejects.jsonl)
    rejected: Counter = field(default_factory=Counter)
    decode_restarts: int = 0  # decode actors replaced (precompute.engine = "ray": died or timed out)
    seconds: Counter = field(default_factory=lambda: Counter({stage: 0.0 for stage in STAGES}))
    started: float = field(default_factory=time.perf_counter)
    startup: StartupTimeline | None = None  # seconds since launch at which each start-up part ended

    def reject(self, reason: str) -> None:
        self.rejected[reason] += 1

    def to_dict(self) -> dict:
        elapsed = time.perf_counter() - self.started
        return {
            "producer": self.producer,
            "lanes": self.lanes,
            "status": self.status,
            "seen": self.seen,
            "committed": self.committed,
            "rejected": dict(sorted(self.rejected.items())),
            "rejected_total": sum(self.rejected.values()),
            "skipped_committed": self.skipped_committed,
            "skipped_shards": self.skipped_shards,
            "shards": self.shards,
            "bytes": self.bytes,
            "generation": self.generation,
            "resumed_at": self.resumed_at,
            "rejects_file": self.rejects_file,
            "decode_restarts": self.decode_restarts,
            "seconds": {k: round(v, 3) for k, v in sorted(self.seconds.items())},
            "elapsed_s": round(elapsed, 3),
            "samples_per_s": round(self.committed / max(elapsed, 1e-9), 3),
            **({"startup": self.startup.to_dict()} if self.startup else {}),
        }

    def summary_line(self) -> str:
        d = self.to_dict()
        reasons = ", ".join(f"{k} {v}" for k, v in d["rejected"].items()) or "none"
        listed = f", listed in {self.rejects_file}" if self.rejects_file else ""
        resumed = f"; resumed at shard {self.resumed_at}" if self.resumed_at else ""
        resumed += f"; decode actors replaced: {self.decode_restarts}" if self.decode_restarts else ""
        lanes = ",".join(map(str, self.lanes)) or "none"
        return (
            f"precompute {self.producer} (lanes {lanes}): {d['committed']}/{d['seen']} samples committed in {d['shards']} shards "
            f"({d['bytes'] / 1e6:.2f} MB) in {d['elapsed_s']:.1f}s, {d['samples_per_s']:.2f} samples/s; "
            f"rejected {d['rejected_total']} ({reasons}){listed}{resumed}"
        )

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path


class ProgressBar:
    """clips/s, MB written, shards and window fill on one stderr line (quiet in logs)."""

    def __init__(self, report: Report, enabled: bool = True):
        self.report = report
        self.fill = "-"
        self._bar = Progress(None, f"precompute[{report.producer}]", enabled=enabled, unit="clip")

    def window(self, unread: int, share: int) -> None:
        """This producer's window fill after its latest commit wait ("keep" windows have no share)."""
        self.fill = f"{unread}/{share}" if share else "keep"

    def update(self) -> None:
        self._bar.update(
            1,
            MB=f"{self.report.bytes / 1e6:.1f}",
            shards=self.report.shards,
            window=self.fill,
            rejected=sum(self.report.rejected.values()),
        )

    def close(self) -> None:
        self._bar.close()
