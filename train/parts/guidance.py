"""Guidance-augmented targets (`guidance.scale`): fine-tuning that keeps a guidance-distilled base's guidance.

A guidance-distilled base (MiniMax H3) answers a caption in one pass with what classifier-free guidance would give:
plain flow matching teaches it the unguided velocity and so undoes the distillation. With scale w each target
becomes u + w (target - u), where u is the frozen base's prediction (the transformer with its adapters switched
off, no gradients) for the empty caption's conditions at the same sigmas, noise and spec draws; a sound
stream's target likewise. Computed as target + (w - 1) (target - u), so w = 1 leaves the target exactly as it was.
Costs one extra forward per step, without gradients. docs/stage2.md (`guidance.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch
from torch import Tensor, nn

from vt.shared.adapters import adapters_off
from vt.shared.errors import UserError
from vt.shared.models.flow import Prediction
from vt.train.parts.base import Part, RunContext
from vt.train.parts.caption_dropout import drop_captions


def guided_target(target: Tensor, base: Tensor, scale: float) -> Tensor:
    """u + scale (target - u) for the base's prediction u, as target + (scale - 1) (target - u): exact at scale 1."""
    base = base.detach().to(target.dtype)
    return target + (scale - 1) * (target - base)


def guided(out: Prediction, base: Prediction, scale: float) -> Prediction:
    """`out` with its target (and its sound stream's) guided by `base`'s predictions (`guided_target`)."""
    audio = out.audio
    if audio is not None:
        audio = replace(audio, target=guided_target(audio.target, base.audio.prediction, scale))
    return replace(out, target=guided_target(out.target, base.prediction, scale), audio=audio)


def copied(generators: list[torch.Generator] | None) -> list[torch.Generator] | None:
    """Generators in the states of `generators`: the base's pass draws what the trained pass then draws."""
    if generators is None:
        return None
    copies = []
    for generator in generators:
        copy = torch.Generator(device=generator.device)
        copy.set_state(generator.get_state())
        copies.append(copy)
    return copies


class Guidance:
    """The spec's forward with guided targets (`forward`, the trainer's stand-in for `spec.forward`)."""

    def __init__(self, spec, scale: float, empty_caption: Callable[[], dict[str, Tensor]]):
        """`empty_caption()`: the window's empty-caption conditions, name -> one sample's tensor (read when first
        needed: the trainer knows the window's fingerprint once a shard is read)."""
        self.spec = spec
        self.scale = float(scale)
        self.empty_caption = empty_caption

    def base(
        self,
        model: nn.Module,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """The frozen base's prediction (adapters off, no gradients) of `batch` on the empty caption, drawing from
        copies of `generators` and leaving the global random state as it found it."""
        rows = list(range(batch["latents"].shape[0]))
        empty = drop_captions(batch, self.empty_caption(), rows)
        devices = [noise.device] if noise.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad(), adapters_off(model):
            return self.spec.forward(model, empty, sigmas, noise, generators=copied(generators))

    def forward(
        self,
        model: nn.Module,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """`spec.forward` of `batch` with each target guided by the base's prediction on the empty caption."""
        base = self.base(model, batch, sigmas, noise, generators)
        return guided(self.spec.forward(model, batch, sigmas, noise, generators=generators), base, self.scale)


class GuidancePart(Part):
    """guidance.scale: the step's forward guided by the frozen base's (`Guidance.forward`), in the trainer, the
    held-out loss and the plan's trace alike (its memory is traced: the base's forward and its kept prediction)."""

    section = "guidance"

    @classmethod
    def wanted(cls, config) -> bool:
        return config.guidance.scale is not None

    def check(self, spec, world_size: int) -> None:
        """The base's prediction comes from the trained transformer with its adapters switched off: a full fine-tune
        has no frozen base, and pipeline stages no whole model to call twice."""
        scale, train, pp = self.settings.scale, self.config.train, self.config.parallel.pp
        if train.mode != "lora":
            raise UserError(
                f"guidance.scale = {scale} guides each target with the frozen base's prediction, the transformer "
                'with its adapters switched off; a full fine-tune has no frozen base: set train.mode = "lora" or '
                "remove guidance.scale"
            )
        if pp > 1:
            raise UserError(
                f"guidance.scale = {scale} with parallel.pp = {pp}: the base's extra forward is not carried "
                "through the pipeline stages; set parallel.pp = 1 or remove guidance.scale"
            )
        if spec.text_with_image:
            raise UserError(
                f"guidance.scale = {scale}: {spec.family}'s text encoder reads each caption together with its "
                "clip's first frame, so the window's empty caption cannot stand in for a sample's text; remove "
                "guidance.scale"
            )

    def forward(self, forward: Callable, run: RunContext) -> Callable:
        return Guidance(run.spec, self.settings.scale, run.empty_caption).forward

    def trace_key(self) -> tuple:
        return (self.settings.scale,)
