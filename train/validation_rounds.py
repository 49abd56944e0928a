"""The trainer's validations (train/validation.py renders them): the base's videos once before this process's first
step, the trained model's at most once a step, and the records the parts measure of them (the videos' metrics),
which every rank passes to its parts alike and rank 0 logs under the step of their videos."""

from __future__ import annotations

from pathlib import Path

from vt.train.parts import Parts
from vt.train.validation import Validator


class ValidationRounds:
    def __init__(self, validator: Validator, parts: Parts, world, tracker):
        self.validator, self.parts, self.world, self.tracker = validator, parts, world, tracker
        self.last: tuple[int, list[Path]] = (-1, [])  # the last validated step and its videos
        self.base_checked = False  # the base's videos made or found (validation.base)

    def before_step(self, transformer, step: int) -> bool:
        """Before each step (every rank): stop now if the window lacks the prompts' conditions; before the first,
        the base's videos (a full fine-tune's base is step 0's). Whether the base's were made or found now."""
        if not self.validator.enabled:
            return False
        self.validator.conditions()  # the window has them once a shard is there
        if self.base_checked:
            return False
        self.base_checked = True
        base = self.validator.render_base(transformer, step, self.parts.validation_renders())
        self.log_records(self.parts.after_validation(step, base))  # the base's metrics
        return True

    def validate(self, transformer, step: int) -> list[Path]:
        """The trained model's videos of `step` (every rank takes part), rendered once however often asked."""
        if not self.validator.enabled:
            return []
        if self.last[0] == step:  # the periodic validation already rendered this step
            return self.last[1]
        weights = self.parts.weights_for("validation")
        videos = self.validator.render(transformer, step, weights, self.parts.validation_renders())
        self.world.barrier()
        self.last = (step, videos)
        self.log_records(self.parts.after_validation(step, videos))  # the videos' metrics, as they are done
        return videos

    def finish(self) -> None:
        """After the last validation: the one wait for the work beside training (the videos' metrics)."""
        self.log_records(self.parts.after_run())

    def log_records(self, records: list[tuple[int, dict]]) -> None:
        """Records measured apart from their step's (rank 0's): every rank's parts see them (keep_best may rank by
        one)."""
        for step, values in self.world.broadcast_object(records if self.world.is_main else None):
            self.tracker.log_records([(step, values)])
            self.parts.logged(step, values)
