"""A tqdm progress bar on stderr with rates and the latest values, shown on rank 0 only (both stages).

With several ranks, one bar per rank would interleave into garbage, so ranks other than 0 get a
silent bar. When stderr is not a terminal (a log file, a job scheduler) the bar redraws at most every
30 s instead of 10 times a second, so logs stay readable.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

from vt.shared import runtime

TTY_REFRESH_SECONDS = 0.1
LOG_REFRESH_SECONDS = 30.0


class Progress:
    """Steps done, their rate and the latest values (loss, samples/s ...) on one line."""

    def __init__(self, total: int | None, desc: str, enabled: bool = True, unit: str = "step"):
        self.enabled = enabled and runtime.rank() == 0
        stream = sys.stderr
        tty = hasattr(stream, "isatty") and stream.isatty()
        self._bar = tqdm(
            total=total or None,
            desc=desc,
            unit=unit,
            file=stream,
            disable=not self.enabled,
            dynamic_ncols=True,
            mininterval=TTY_REFRESH_SECONDS if tty else LOG_REFRESH_SECONDS,
        )

    def update(self, n: int = 1, **postfix: float) -> None:
        """Advance by `n`; keyword values are shown after the bar (e.g. loss=0.12, samples_s=40)."""
        if not self.enabled:
            return
        if postfix:
            self._bar.set_postfix({name: _short(value) for name, value in postfix.items()}, refresh=False)
        self._bar.update(n)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(value) -> str:
    """4 significant digits: enough to watch a loss, short enough for one line."""
    if hasattr(value, "item"):
        value = value.item()
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)
