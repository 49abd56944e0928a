"""The one exception a processor raises for bad input, so the service can skip and count it.

`reason` is a short snake_case word ("corrupt_video", "too_short") used as a counter key in
precompute_report.json; `detail` says what was wrong with this sample, for the log.
"""

from __future__ import annotations


class SampleError(Exception):
    """A sample that cannot be used; the service skips it and counts `reason`."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail)  # both in args, so the error pickles across worker processes
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason
