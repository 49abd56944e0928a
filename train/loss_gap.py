"""The gap between the held-out and the training loss, and when it widens: one definition for the trainer's log
(train/parts/held_out.py) and the run page (train/report.py), both reading the records metrics.jsonl holds.

At each held-out evaluation but the first (a record with `eval_loss`), the gap is its held-out loss minus the mean
training loss of the records logged since the previous evaluation (this one's included): the training loss of one
step moves with its random sigmas and noise, the mean over the span between two evaluations much less. The gap
widens at an evaluation when over the last WINDOW gaps (this one's included) it grew at every evaluation, and by more
than WIDENING of this evaluation's held-out loss in all: the trained weights fit the training clips better while the
held-out ones no longer follow (overfitting), the time to take an earlier step's export (`[keep_best]`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WINDOW = 3  # gaps (held-out evaluations after the first) the widening is judged over
WIDENING = 0.1  # how much the gap must grow over them, as a share of the held-out loss


@dataclass(frozen=True)
class Gap:
    step: int
    gap: float  # held-out loss - mean training loss since the previous evaluation
    eval_loss: float
    train_loss: float


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def gaps(records: list[dict]) -> list[Gap]:
    """Each held-out evaluation's gap but the first's, from metrics records in step order (one record a step)."""
    out, since, evaluated = [], [], False
    for record in records:
        if _finite(record.get("loss")):
            since.append(float(record["loss"]))
        if not _finite(record.get("eval_loss")):
            continue
        if evaluated and since:
            train = sum(since) / len(since)
            out.append(Gap(int(record["step"]), float(record["eval_loss"]) - train, float(record["eval_loss"]), train))
        evaluated, since = True, []
    return out


def widening(found: list[Gap]) -> str | None:
    """The warning when the gap widened at the last of `found` (None when it did not)."""
    if len(found) < WINDOW:
        return None
    last = found[-WINDOW:]
    grew = all(later.gap > earlier.gap for earlier, later in zip(last, last[1:]))
    if not grew or last[-1].gap - last[0].gap <= WIDENING * abs(last[-1].eval_loss):
        return None
    steps = ", ".join(str(g.step) for g in last)
    return (
        f"the gap between the held-out and the training loss widened over the held-out evaluations at steps {steps}: "
        f"from {last[0].gap:.4g} to {last[-1].gap:.4g} (held-out loss {last[-1].eval_loss:.4g}; more than "
        f"{WIDENING:.0%} of it): the weights may be fitting the training clips at the held-out ones' expense; an "
        "earlier step's weights may be better ([keep_best] keeps the best steps' exports)"
    )


def widenings(records: list[dict]) -> list[tuple[int, str]]:
    """(step, warning) for every evaluation at which the gap widened."""
    found = gaps(records)
    out = []
    for end in range(WINDOW, len(found) + 1):
        message = widening(found[:end])
        if message:
            out.append((found[end - 1].step, message))
    return out
