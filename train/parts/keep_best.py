"""The best steps' exports kept (`keep_best.count` = k): the LoRA (or full weights) of each step that logs the ranking
metric exported to `<run.dir>/exports/step-<step>/`, the k best by it kept, the others' deleted, never the newest one.

The metric is the held-out loss (`by = "held_out"`: `eval_loss`, every `held_out.every` steps and at the end), or any
metric metrics.jsonl logs (`by = "loss"`, a video metric `val/<name>` ...), `goal = "min"` or `"max"` being best. An
export holds the weights that were measured: the held-out loss's (`weights_for("held_out")`: the average with
ema.eval), a validation metric's (`val/...`: `weights_for("validation")`), else the trained weights.
`<run.dir>/keep_best.json` (rank 0's, replaced whole) holds every measured step's value and the steps kept; it is
written after the export and before any export is deleted, so a run killed between them leaves at most an export
no record names, which the next run deletes at its first record. A resumed run forgets the steps after its checkpoint
(it measures them again), a fresh run in an old run folder all of them. The run page lists the kept steps; the run's own final export (`<run.dir>/lora/`) is never touched.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path

from vt.shared.errors import UserError
from vt.shared.log import get_logger
from vt.train.export import export_run
from vt.train.parts.base import Part, RunContext

log = get_logger("vt.train.keep_best")
RECORD = "keep_best.json"
EXPORTS = "exports"


def export_folder(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / EXPORTS / f"step-{step:06d}"


def best_steps(scores: dict[int, float], count: int, goal: str) -> list[int]:
    """The `count` best steps of `scores` by `goal` ("min" or "max"; an earlier step wins a tie), in step order."""
    ranked = sorted(scores, key=lambda step: (scores[step] if goal == "min" else -scores[step], step))
    return sorted(ranked[:count])


def kept_steps(scores: dict[int, float], count: int, goal: str) -> list[int]:
    """The steps whose exports stay: the `count` best and the newest, in step order."""
    return sorted(set(best_steps(scores, count, goal)) | ({max(scores)} if scores else set()))


class KeepBestPart(Part):
    section = "keep_best"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.keep_best.count > 0

    @property
    def metric(self) -> str:
        """The metrics.jsonl key steps are ranked by."""
        return "eval_loss" if self.settings.by == "held_out" else self.settings.by

    def check(self, spec, world_size: int) -> None:
        if self.settings.by == "held_out" and not self.config.data.eval:
            raise UserError(
                'keep_best.by = "held_out" ranks steps by the held-out loss over data.eval, which is not set: set '
                'data.eval (and held_out.every), or name a metric metrics.jsonl logs, e.g. keep_best.by = "loss"'
            )

    def start(self, run: RunContext) -> None:
        self.run = run
        self.root = Path(self.config.run_dir)
        stored = self._read() if run.world.is_main else {}
        self.scores: dict[int, float] = {int(step): value for step, value in stored.get("scores", {}).items()}
        self.started_at: int | None = 0  # the step this run starts from (a resume's); None once the record follows it
        self.pending: set[int] = set()  # validation steps exported, their metric not logged yet

    def after_resume(self, step: int) -> None:
        self.started_at = step

    def _forget_after_start(self) -> None:
        """The steps after the one this run starts from are trained and measured again (a fresh run in an old run
        folder: all of them): their values and exports go."""
        if self.started_at is not None and self.run.world.is_main:
            self.scores = {s: v for s, v in self.scores.items() if s <= self.started_at}
            self._prune()
        self.started_at = None

    def _read(self) -> dict:
        try:
            return json.loads((self.root / RECORD).read_text())
        except (OSError, ValueError):
            return {}

    def _weights(self):
        if self.settings.by == "held_out":
            return self.run.parts.weights_for("held_out")
        if self.metric.startswith("val/"):
            return self.run.parts.weights_for("validation")
        return contextlib.nullcontext()

    def after_validation(self, step: int, videos: list) -> list:
        """A validation metric is measured beside training and logged steps later: the weights its videos were
        rendered with are exported now, and kept until their value comes (every rank calls it)."""
        if self.metric.startswith("val/") and videos and step > 0:
            self._export(step)
            self.pending.add(step)
        return []

    def logged(self, step: int, record: dict) -> None:
        """A record with the metric: export this step's weights (a validation metric's: exported at its validation),
        then keep the best (every rank calls it; rank 0's value decides, as the other ranks may not have measured it)."""
        self._forget_after_start()
        value = self.run.world.broadcast_object(record.get(self.metric) if self.run.world.is_main else None)
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            return
        exported = self.run.world.broadcast_object(step in self.scores if self.run.world.is_main else None)
        if not exported and step not in self.pending:  # a final record repeats the last step's: one export a step
            self._export(step)
        self.pending.discard(step)
        if self.run.world.is_main:
            self.scores[step] = float(value)
            self._prune()

    def _export(self, step: int) -> None:
        with self._weights():
            export_run(
                self.run.transformer,
                self.run.spec,
                self.config.train.mode,
                export_folder(self.root, step),
                step,
                self.run.world.barrier,
            )

    def _prune(self) -> None:
        """Write the record (the kept steps), then delete every export it does not keep (rank 0)."""
        kept = kept_steps(self.scores, self.settings.count, self.settings.goal)
        record = {
            "by": self.metric,
            "goal": self.settings.goal,
            "count": self.settings.count,
            "scores": {str(step): value for step, value in sorted(self.scores.items())},
            "best": best_steps(self.scores, self.settings.count, self.settings.goal),
            "kept": kept,
        }
        tmp = self.root / f".{RECORD}.{os.getpid()}.tmp"
        self.root.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record, indent=1))
        os.replace(tmp, self.root / RECORD)
        folder = self.root / EXPORTS
        for export in sorted(folder.glob("step-*")) if folder.is_dir() else []:
            step = int(export.name.removeprefix("step-")) if export.name.removeprefix("step-").isdigit() else None
            if step not in kept and step not in self.pending:
                shutil.rmtree(export, ignore_errors=True)
        dropped = sorted(set(self.scores) - set(kept))
        if dropped:
            log.info("keep_best: exports of steps %s kept (by %s), the others deleted", kept, self.metric)
