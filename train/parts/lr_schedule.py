"""The learning rate over optimizer steps ([lr_schedule]): a linear warm-up from train.lr / warmup_steps to train.lr
over `warmup_steps`, then constant (`decay = "constant"`), or decaying to `min_ratio` x train.lr at train.max_steps,
linearly or along a half cosine. The scheduler counts optimizer steps (not micro-steps) and is saved in the
checkpoints with the optimizer, so a resumed run continues the same curve."""

from __future__ import annotations

import math

import torch

from vt.shared.errors import UserError
from vt.train.parts.base import Part


def lr_factor(step: int, warmup: int, decay: str, total: int, min_ratio: float) -> float:
    """The multiple of train.lr optimizer step `step` (0-based) applies."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 1 - progress if decay == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return min_ratio + (1 - min_ratio) * shape


class LRSchedulePart(Part):
    section = "lr_schedule"

    def check(self, spec, world_size: int) -> None:
        settings, max_steps = self.settings, self.config.train.max_steps
        if settings.decay != "constant" and not max_steps:
            raise UserError(
                f"lr_schedule.decay = {settings.decay!r} decays to the run's last step, which train.max_steps = 0 "
                'leaves open (until the data ends): set train.max_steps, or lr_schedule.decay = "constant"'
            )
        if settings.decay != "constant" and settings.warmup_steps >= max_steps:
            raise UserError(
                f"lr_schedule.warmup_steps = {settings.warmup_steps} leaves nothing of train.max_steps = "
                f'{max_steps} to decay over: lower the warm-up, or set lr_schedule.decay = "constant"'
            )

    def constant(self) -> bool:
        """Whether every step applies train.lr as it is (no warm-up, no decay)."""
        return self.settings.warmup_steps == 0 and self.settings.decay == "constant"

    def scheduler(self, optimizer: torch.optim.Optimizer, max_steps: int):
        settings = self.settings
        self.lr = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: lr_factor(step, settings.warmup_steps, settings.decay, max_steps, settings.min_ratio),
        )
        return self.lr

    def after_resume(self, step: int) -> None:
        """The rate of step `step` on this run's curve, not the checkpoint's: a run resumed with another
        train.max_steps decays to its own last step from here on."""
        lrs = [base * fn(self.lr.last_epoch) for base, fn in zip(self.lr.base_lrs, self.lr.lr_lambdas)]
        for group, lr in zip(self.lr.optimizer.param_groups, lrs):
            group["lr"] = lr
        self.lr._last_lr = lrs
