"""Fault injection for crash tests: a named point kills its own process with SIGKILL, for real.

Set `VT_FAULT_AT=point` (or `point@N` for the N-th time the point is reached, 1-based; several
points separated by commas) in the environment of the process under test. Unset, a fault point
costs one environment lookup. SIGKILL, not an exception: no `finally`, no flush, no atexit, exactly
what a power cut or the OOM killer leaves behind.

The points, by where they sit:
- storage.put.mid_write:<folder>   an atomic put with half its bytes written (local temp file;
                                   on S3 before the PUT, which S3 never keeps partially).
                                   <folder> is the first path part: data, progress, producers ...
- window.commit.after_data         shard data written, commit record not created yet
- window.commit.after_record       shard committed, nothing after it done yet
- window.evict.mid                 records below the watermark deleted, their data not yet
- window.publish_read              trainer: consumer read position written (mid-epoch)
- window.publish_watermark         trainer: checkpoint saved and watermark published, eviction next
- train.after_checkpoint           trainer: checkpoint saved, watermark published, evicted
"""

from __future__ import annotations

import os
import signal
from collections import Counter

_hits: Counter = Counter()


def _targets() -> dict[str, int]:
    targets = {}
    for item in filter(None, os.environ.get("VT_FAULT_AT", "").split(",")):
        name, _, count = item.strip().partition("@")
        if count and not count.isdigit():
            raise ValueError(f"VT_FAULT_AT item {item!r} must be point or point@N with N a positive integer")
        targets[name] = int(count or 1)
    return targets


def fault_point(name: str) -> None:
    """SIGKILL this process if VT_FAULT_AT names `name` and this is the chosen hit."""
    if "VT_FAULT_AT" not in os.environ:
        return
    targets = _targets()
    if name not in targets:
        return
    _hits[name] += 1
    if _hits[name] == targets[name]:
        os.kill(os.getpid(), signal.SIGKILL)
