"""Where a process's start-up goes: seconds since the process was launched at which each part ended.

Both stages mark their parts (imports, model spec, weight digests, window, model loads ...) up to their
first useful work (vt-precompute's first decoded sample, vt-train's first step), so `make bench` and a
person reading precompute_report.json or <run.dir>/startup.json see which part to cut. The launch time
is the kernel's record of the process start (psutil), so the interpreter's own start and every import
before vt runs are counted too.
"""

from __future__ import annotations

import time

__all__ = ["StartupTimeline", "launched_at"]


def launched_at() -> float:
    """This process's start, in seconds since the epoch (time.time's clock)."""
    import psutil

    return psutil.Process().create_time()


class StartupTimeline:
    """Named marks in seconds since launch; `parts()` gives each part's own duration, in order."""

    def __init__(self):
        self.launched = launched_at()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> None:
        """The part `name` ended now (a repeated name keeps its first mark)."""
        self.marks.setdefault(name, round(time.time() - self.launched, 3))

    def parts(self) -> dict[str, float]:
        """Each part's seconds: from the previous mark (or the launch) to its own."""
        out, previous = {}, 0.0
        for name, at in self.marks.items():
            out[name] = round(at - previous, 3)
            previous = at
        return out

    def to_dict(self) -> dict:
        return {"launched_at": self.launched, "marks_s": dict(self.marks), "parts_s": self.parts()}
