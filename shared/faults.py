"""Fault injection for crash tests: a named point kills its own process with SIGKILL, for real.

Set `VT_FAULT_AT=point` (or `point@N` for the N-th time the point is reached, 1-based) in the
environment of the process under test. Unset, a fault point costs one dictionary lookup.
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
        targets[name] = int(count or 1)
    return targets


def fault_point(name: str) -> None:
    targets = _targets()
    if name not in targets:
        return
    _hits[name] += 1
    if _hits[name] == targets[name]:
        os.kill(os.getpid(), signal.SIGKILL)
