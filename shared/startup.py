"""Where a process's start-up goes: seconds since the process was launched at which each part ended.

Both stages mark their parts (imports, model spec, weight digests, window, model loads ...) up to their
first useful work (vt-precompute's first decoded sample, vt-train's first step), so `make bench` and a
person reading precompute_report.json or <run.dir>/startup.json see which part to cut. The launch time
is the kernel's record of the process start, so the interpreter's own start and every import before vt
runs are counted too.
"""

from __future__ import annotations

import os
import time

__all__ = ["StartupTimeline", "launched_at"]


def launched_at() -> float:
    """This process's start, in seconds since the epoch (time.time's clock).

    On Linux from the kernel's clocks since boot: the process's start tick (/proc/self/stat) against the
    uptime now (/proc/uptime), to 10 ms. psutil's create_time adds the start tick to the boot time, which
    /proc/stat gives in whole seconds, so its answer can be up to a second early (every part would look
    longer by as much); it stays the fallback elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces; fields 3.. follow it
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        started_since_boot = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.time() - (uptime - started_since_boot)
    except (OSError, ValueError, IndexError):
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
