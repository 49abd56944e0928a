"""One step's loss path: draws, the forward and the loss, shared by the trainer's step, the held-out
loss (train/parts/held_out.py) and the benchmark (which times `Trainer.train_step`, this path inside it).

- `draws(part, step)`: the sigmas, noise and the spec's own generators for a data-parallel slice, each from its
  sample's key, the step and `train.seed` (parallel/batching.py), so every layout and every resume draws alike; with
  model.audio the audio noise and, for a family with independent audio timesteps, the audio sigmas.
- `losses(model, part, draws)`: (loss, audio loss or None, real rows) per route of the slice (the one transformer,
  or each expert's rows), lazily, under the run's autocast and its parts' forward contexts (activation offload),
  through the family's forward as the parts wrap it (guided targets: train/parts/guidance.py).

The [flow] section (sigma sampling, shift, loss weighting) is this module's and train/objectives.py's; the keys a
config leaves unset are the family's reference recipe's (`flow_settings`: ModelSpec.flow_recipe). Caption
dropout changes a batch before it gets here (train/parts/caption_dropout.py, the parts' `batch` hook).

The held-out loss passes fixed draws of its own instead of `draws` (the same loss path, other sigmas and noise).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import torch

from vt.shared.errors import UserError
from vt.train.experts import expert_modules, routes
from vt.train.objectives import flow_settings, joint_loss, loss_weights, scheduler_shift
from vt.train.parallel.batching import Slice, draw_audio_noise, draw_audio_sigmas, draw_inputs, spec_generators


@dataclass
class Draws:
    """What a forward of a slice is given besides its data: sigmas, noise and the spec's own generators, and with
    model.audio the audio noise (and independent audio sigmas)."""

    sigmas: torch.Tensor
    noise: torch.Tensor
    generators: list[torch.Generator]
    audio_noise: torch.Tensor | None = None
    audio_sigmas: torch.Tensor | None = None


class LossPath:
    """The loss of a slice as the run computes it, through the run's parts (vt.train.parts.Parts): their forward
    wrapping (guidance) and forward contexts (activation offload)."""

    def __init__(self, config, spec, device: torch.device, amp_dtype: torch.dtype | None, parts, run):
        """`run`: the trainer's RunContext (vt.train.parts), for the parts that wrap the forward."""
        self.config, self.spec, self.device, self.amp_dtype, self.parts = config, spec, device, amp_dtype, parts
        self.flow, self.run = flow_settings(config.flow, spec), run

    @staticmethod
    def check(config, spec) -> None:
        """What the [flow] settings cannot do with the family (the trainer and the plan call it)."""
        weighting = flow_settings(config.flow, spec).loss_weighting
        if weighting != "none" and config.model.diffusion_forcing:
            raise UserError(
                f"flow.loss_weighting = {weighting!r} weights each sample by its sigma, but "
                'model.diffusion_forcing draws one sigma per latent frame; set flow.loss_weighting = "none"'
            )

    def shift(self, latent_shape: tuple[int, ...]) -> float:
        """`flow.shift`, or with "auto" the family scheduler's at this bucket's token count (objectives.py)."""
        if self.flow.shift != "auto":
            return self.flow.shift
        return scheduler_shift(self.scheduler_config, self.spec.tokens_per_sample(latent_shape))

    @cached_property
    def scheduler_config(self) -> dict:
        return dict(self.spec.load_config("scheduler"))

    def draws(self, part: Slice, step: int) -> Draws:
        """Optimizer step `step`'s sigmas and noise for `part` (and with model.audio the audio noise and independent
        audio sigmas, and the spec's own generators), each from its sample's key (parallel/batching.py)."""
        flow, seed = self.flow, self.config.train.seed
        latent_shape = part.tensors["latents"].shape[1:]
        levels = self.spec.noise_levels(latent_shape)  # > 1: a sigma per latent frame
        shift = self.shift(latent_shape)
        density = dict(logit_mean=flow.logit_mean, logit_std=flow.logit_std, mode_scale=flow.mode_scale)
        sigmas, noise = draw_inputs(
            part, seed, step, flow.sigma_sampling, shift, self.spec.sigma_range(), levels, **density
        )
        draws = Draws(sigmas, noise, spec_generators(part, seed, step))
        if "audio_latents" in part.tensors:
            draws.audio_noise = draw_audio_noise(part, seed, step)
            if self.spec.audio_timesteps == "independent":
                shift = self.config.model.audio_shift or self.spec.sound.default_shift or shift
                draws.audio_sigmas = draw_audio_sigmas(part, seed, step, flow.sigma_sampling, shift, **density)
        return draws

    def losses(self, model: torch.nn.Module, part: Slice, draws: Draws) -> Iterator[tuple]:
        """(loss, audio loss or None, real rows) of each route of `part`, lazily: a caller's backward of one route
        runs before the next route's forward."""
        tensors = {k: v.to(self.device, non_blocking=True) for k, v in part.tensors.items()}  # pinned on CUDA
        sigmas, noise, generators, audio_sigmas = draws.sigmas, draws.noise, draws.generators, draws.audio_sigmas
        if draws.audio_noise is not None:
            tensors["audio_noise"] = draws.audio_noise.to(self.device)
        if audio_sigmas is not None:
            tensors["audio_sigmas"] = audio_sigmas.to(self.device)
        models = expert_modules(model)
        forward = self.parts.forward(self.spec.forward, self.run)  # guided targets with guidance.scale
        weighting = self.flow.loss_weighting
        for route in routes(self.spec, sigmas, part.count):
            rows = slice(None) if route.expert is None else route.rows
            with (
                torch.autocast(
                    self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None
                ),
                self.parts.forward_context(),
            ):
                out = forward(
                    models[route.expert],
                    {k: v[rows] for k, v in tensors.items()},
                    sigmas[rows].to(self.device),
                    noise[rows].to(self.device),
                    generators=generators if route.expert is None else [generators[row] for row in route.rows.tolist()],
                )
            weights = loss_weights(sigmas[rows], weighting)  # None: unweighted
            audio_weights = None if audio_sigmas is None else loss_weights(audio_sigmas[rows], weighting)
            loss, audio_loss = joint_loss(
                out,
                self.config.model.audio_weight,
                None if weights is None else weights.to(self.device),
                None if audio_weights is None else audio_weights.to(self.device),
            )
            yield loss, audio_loss, route.count
