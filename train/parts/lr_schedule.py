"""The learning rate over optimizer steps ([lr_schedule]): a linear warm-up from train.lr / warmup_steps to train.lr
over `warmup_steps`, then constant. The scheduler counts optimizer steps (not micro-steps) and is saved in the
checkpoints with the optimizer, so a resumed run continues the same curve."""

from __future__ import annotations

import torch

from vt.train.parts.base import Part


def lr_factor(step: int, warmup: int) -> float:
    """The multiple of train.lr optimizer step `step` (0-based) applies."""
    return (step + 1) / warmup if warmup and step < warmup else 1.0


class LRSchedulePart(Part):
    section = "lr_schedule"

    def constant(self) -> bool:
        """Whether every step applies train.lr as it is (no warm-up)."""
        return self.settings.warmup_steps == 0

    def scheduler(self, optimizer: torch.optim.Optimizer, max_steps: int):
        warmup = self.settings.warmup_steps
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, warmup))
