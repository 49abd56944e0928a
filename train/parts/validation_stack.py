"""Drift against the sampler people use (`validation_stack.loras`): LoRA files, such as a turbo or distillation LoRA,
stacked on the trained model for one more video of each validation prompt, `<prompt>-stacked.mp4` beside the plain one
at every validation (and among the base's renders), sampled with `steps` and `guidance_scale` as people sample with
them. The run page then shows whether the trained weights still work with the LoRA users stack on them.

The files are read once, at start-up, and checked against the transformer's modules (names and shapes); during the
stacked render forward hooks add each file's delta to its modules' outputs (train/stacked_lora.py): no second copy
of the model and no weight changed, so FSDP2's shards, a quantized or float8 base and the trained adapters stay as
they are. Memory: the files' factors, whole on every rank, on the device during the stacked render only.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from vt.shared.errors import UserError
from vt.train.parts.base import Part, Render, RunContext
from vt.train.stacked_lora import check_targets, read_file, stacked


class ValidationStackPart(Part):
    section = "validation_stack"

    @classmethod
    def wanted(cls, config) -> bool:
        return bool(config.validation_stack.loras)

    def check(self, spec, world_size: int) -> None:
        settings, config = self.settings, self.config
        if not config.validation.prompts:
            raise UserError(
                "validation_stack.loras renders the validation prompts with the files stacked: set "
                "validation.prompts, or remove validation_stack.loras"
            )
        if settings.strengths and len(settings.strengths) != len(settings.loras):
            raise UserError(
                f"validation_stack.strengths = {settings.strengths}: one per file of validation_stack.loras "
                f"({len(settings.loras)}), or none (1.0 each)"
            )
        if settings.steps is not None:
            from vt.train.validation import check_sampling_steps

            check_sampling_steps(spec, settings.steps, "validation_stack.steps")
        if config.parallel.tp > 1:
            raise UserError(
                f"validation_stack.loras with parallel.tp = {config.parallel.tp}: tensor parallel splits each "
                "layer's input or output, which the stacked files' deltas are not split for; set parallel.tp = 1 "
                "(FSDP2, context and pipeline parallel stack them), or remove validation_stack.loras"
            )
        if spec.experts():
            raise UserError(
                f"validation_stack.loras: {spec.family} samples with several experts, and a stacked file names no "
                "expert; remove validation_stack.loras"
            )
        if settings.guidance_scale is not None and spec.pipeline_default("guidance_scale") is None:
            raise UserError(
                f"validation_stack.guidance_scale = {settings.guidance_scale}: the {spec.family} pipeline takes no "
                "guidance scale; remove it"
            )

    def check_machine(self, device) -> None:
        missing = [path for path in self.settings.loras if not Path(path).is_file()]
        if missing:
            raise UserError(f"validation_stack.loras: no file at {', '.join(missing)}")

    def start(self, run: RunContext) -> None:
        self.device = run.device
        strengths = self.settings.strengths or [1.0] * len(self.settings.loras)
        self.files = [read_file(path, run.spec, strength) for path, strength in zip(self.settings.loras, strengths)]
        staged = run.world is not None and run.world.dims.pp > 1
        for path, deltas in zip(self.settings.loras, self.files):
            found = check_targets(run.transformer, deltas, path, staged=staged)
            if staged:  # each stage holds some of the modules: all of them together
                found = int(run.world.sum(torch.tensor([found], device=run.world.comm_device), over="pp").item())
            if found != len(deltas):
                raise UserError(
                    f"validation_stack.loras: {path} adapts {len(deltas)} modules, the transformer's stages hold "
                    f"{found} of them"
                )

    def validation_renders(self) -> list[Render]:
        settings = self.settings
        arguments = () if settings.guidance_scale is None else (("guidance_scale", settings.guidance_scale),)
        files = []
        for index, path in enumerate(settings.loras):
            found = Path(path)
            stat = found.stat() if found.is_file() else None
            strength = settings.strengths[index] if settings.strengths else 1.0
            files.append([str(found.resolve()), strength, stat and stat.st_size, stat and stat.st_mtime_ns])
        return [
            Render(
                "stacked",
                lambda transformer: stacked(transformer, self.files, self.device),
                steps=settings.steps,
                arguments=arguments,
                key=json.dumps(files),
            )
        ]

    def run_memory(self, plan) -> None:
        if plan.validation:  # the files' factors on every rank, during the stacked render
            plan.rank.validation += sum(Path(p).stat().st_size for p in self.settings.loras if Path(p).is_file())
