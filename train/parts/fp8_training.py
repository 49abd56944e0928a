"""Full fine-tuning in float8 ([fp8_training]): torchao's float8 linear layers with the tensorwise or rowwise recipe
(train/fp8.py), converted before the parallel layout, the tensorwise all-gather's scales precomputed after each
optimizer step. Needs a CUDA GPU of sm89+ and torchao: checked on the machine at start-up, not by the plan."""

from __future__ import annotations

import torch

from vt.shared.errors import UserError
from vt.train.fp8 import after_optimizer_step, apply_fp8_training, fp8_training_support
from vt.train.parts.base import Part, RunContext


class FP8TrainingPart(Part):
    section = "fp8_training"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.fp8_training.recipe != "none"

    def check(self, spec, world_size: int) -> None:
        if self.config.train.mode != "full":
            raise UserError(
                f"fp8_training.recipe = {self.settings.recipe!r} is for full fine-tuning; for LoRA use "
                'frozen_base.fp8 = true (or set train.mode = "full")'
            )

    def check_machine(self, device: torch.device) -> None:
        self.check(None, 1)  # the mode first: its refusal holds on any machine
        why = fp8_training_support(device)
        if why is not None:
            raise UserError(f'fp8_training.recipe = {self.settings.recipe!r}: {why}. Set fp8_training.recipe = "none"')

    def convert(self, model: torch.nn.Module, fsdp: bool) -> None:
        apply_fp8_training(model, self.settings.recipe, fsdp=fsdp)

    def start(self, run: RunContext) -> None:
        self.model, self.fsdp = run.transformer, run.world.dims.fsdp_enabled

    def after_optimizer_step(self) -> None:
        after_optimizer_step(self.model, self.settings.recipe, fsdp=self.fsdp)
