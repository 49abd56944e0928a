"""`python counting_worker.py run CONFIG ...` (under torchrun): vt-train with its storage requests counted.

It registers the URI scheme counted:// (a local folder, as file:// is) whose backend counts every request
this process makes: listings, reads and bytes read, existence and size checks, writes; reads also by the
window folder they fall in (commits, producers, data, ...), and a shard's header (a range from byte 0)
apart: `headers:<folder>` requests, `header_bytes:<folder>` bytes; listings by folder too (`lists:<folder>`).
At exit the counts go to $VT_STORAGE_COUNTS.<rank> as JSON, so a test can show which rank asked storage for what.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
from collections import Counter

from vt.shared.storage import BACKENDS
from vt.shared.storage.local import LocalBackend

COUNTS: Counter = Counter()


class CountingBackend(LocalBackend):
    """A local folder whose every request is counted in COUNTS."""

    def _folder(self, full: str) -> str:
        rel = os.path.relpath(full, self.root)
        return rel.split(os.sep, 1)[0] if os.sep in rel else "."

    def read(self, full: str) -> bytes:
        data = super().read(full)
        COUNTS["reads"] += 1
        COUNTS["bytes_read"] += len(data)
        COUNTS[f"reads:{self._folder(full)}"] += 1
        COUNTS[f"bytes:{self._folder(full)}"] += len(data)
        return data

    def read_ranges(self, full: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        """A shard's header (the range from byte 0) or some of its rows: requests and bytes by folder, the
        header's bytes apart (what a rank reads besides its rows)."""
        out = super().read_ranges(full, ranges)
        folder = self._folder(full)
        for (start, _), data in zip(ranges, out):
            COUNTS["reads"] += 1
            COUNTS["bytes_read"] += len(data)
            COUNTS[f"reads:{folder}"] += 1
            COUNTS[f"bytes:{folder}"] += len(data)
            if start == 0:
                COUNTS[f"headers:{folder}"] += 1
                COUNTS[f"header_bytes:{folder}"] += len(data)
        return out

    def find(self, base: str) -> dict[str, int]:
        COUNTS["lists"] += 1
        COUNTS[f"lists:{os.path.relpath(base, self.root).split(os.sep, 1)[0]}"] += 1  # the folder listed
        return super().find(base)

    def exists(self, full: str) -> bool:
        COUNTS["exists"] += 1
        return super().exists(full)

    def size(self, full: str) -> int:
        COUNTS["sizes"] += 1
        return super().size(full)

    def put(self, full: str, data: bytes, point: str) -> None:
        COUNTS["writes"] += 1
        super().put(full, data, point)

    def create(self, full: str, data: bytes) -> bool:
        COUNTS["writes"] += 1
        return super().create(full, data)

    def delete(self, full: str) -> None:
        COUNTS["deletes"] += 1
        super().delete(full)


def dump() -> None:
    with open(f"{os.environ['VT_STORAGE_COUNTS']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(dict(COUNTS), f)


if __name__ == "__main__":
    BACKENDS["counted"] = CountingBackend
    atexit.register(dump)
    from vt.train.cli import app

    app(sys.argv[1:], prog_name="vt-train")
