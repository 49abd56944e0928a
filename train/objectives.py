"""Flow matching: reproducible noise and sigmas, timestep shift, the weighted loss.

Randomness is keyed, never carried: the trainer draws each sample's sigma and noise from a generator
seeded by (seed, step, index of the sample in the step) (`parallel/batching.py`), so a resumed run,
any parallel layout and any accumulation setting draw exactly what one uninterrupted process draws; the
spec's own draws come from each sample's generator on a key of its own.
"""

from __future__ import annotations

import math

import torch

from vt.shared.errors import UserError
from vt.shared.models.flow import Prediction


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The resolution shift of rectified-flow models: pushes sigmas towards 1 (more noise) for shift > 1."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def scheduler_shift(scheduler: dict, tokens: int) -> float:
    """The shift a family's scheduler config (`spec.load_config("scheduler")`) samples a clip of `tokens` transformer
    tokens at: with `use_dynamic_shifting`, mu interpolated linearly in the token count between (base_image_seq_len,
    base_shift) and (max_image_seq_len, max_shift), as the pipelines' `calculate_shift` does, then exp(mu) (or mu for
    `time_shift_type = "linear"`), which `shift_sigmas` turns into the scheduler's `time_shift`; else its `shift` or
    `flow_shift` (1 where it has none)."""
    if scheduler.get("use_dynamic_shifting"):
        low, high = scheduler.get("base_image_seq_len", 256), scheduler.get("max_image_seq_len", 4096)
        base, top = scheduler.get("base_shift", 0.5), scheduler.get("max_shift", 1.15)
        mu = base + (top - base) / (high - low) * (tokens - low)
        return mu if scheduler.get("time_shift_type") == "linear" else math.exp(mu)
    return float(scheduler.get("shift") or scheduler.get("flow_shift") or 1.0)


def sample_sigmas(
    n: int,
    scheme: str,
    shift: float,
    generator: torch.Generator,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> torch.Tensor:
    """`n` sigmas in (0, 1) drawn by `scheme` (SD3's densities: logit-normal, uniform, "mode", "cosmap"), then
    shifted by `shift`; "stretched_logit_normal" shifts before it stretches (`stretched_logit_normal`)."""
    if scheme == "stretched_logit_normal":
        return stretched_logit_normal(n, shift, generator, logit_mean, logit_std)
    if scheme == "logit_normal":
        normal = torch.randn(n, generator=generator)
        sigmas = torch.sigmoid(normal if (logit_mean, logit_std) == (0.0, 1.0) else logit_mean + logit_std * normal)
    elif scheme == "uniform":
        sigmas = torch.rand(n, generator=generator)
    elif scheme == "mode":  # more weight on the middle sigmas for mode_scale > 0 (SD3's eq. 20)
        u = torch.rand(n, generator=generator)
        sigmas = 1 - u - mode_scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    elif scheme == "cosmap":
        u = torch.rand(n, generator=generator)
        sigmas = 1 - 1 / (torch.tan(math.pi * u / 2) + 1)
    else:
        raise UserError(
            f"unknown sigma sampling {scheme!r}; use logit_normal, stretched_logit_normal, uniform, mode or cosmap"
        )
    return shift_sigmas(sigmas, shift)


# stretched_logit_normal: the normal quantiles its stretch maps to 0 and 1 (0.5% and 99.9%), the floor small sigmas
# are reflected at, and the share of samples drawn uniformly instead (a reference recipe's: docs/families.md).
STRETCH_QUANTILES, STRETCH_FLOOR, STRETCH_UNIFORM = (-2.5758, 3.0902), 1e-3, 0.1


def stretched_logit_normal(
    n: int, shift: float, generator: torch.Generator, logit_mean: float = 0.0, logit_std: float = 1.0
) -> torch.Tensor:
    """A reference trainer's density (docs/families.md): the logit-normal shifted by `shift` (its mean moved by
    log(shift)), stretched so its 0.5% and 99.9% quantiles land on 0 and 1, values under the floor reflected above
    it and the rest clamped to [0, 1]; a tenth of the samples uniform over [floor, 1) instead."""
    normal = torch.randn(n, generator=generator)
    fallback = STRETCH_FLOOR + (1 - STRETCH_FLOOR) * torch.rand(n, generator=generator)
    pick = torch.rand(n, generator=generator)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return shift_sigmas(torch.sigmoid(logit_mean + logit_std * x), shift)

    low, high = shifted(torch.tensor(STRETCH_QUANTILES))
    stretched = (shifted(normal) - low) / (high - low)
    stretched = torch.where(stretched >= STRETCH_FLOOR, stretched, 2 * STRETCH_FLOOR - stretched).clamp(0, 1)
    return torch.where(pick > STRETCH_UNIFORM, stretched, fallback)


def loss_weights(sigmas: torch.Tensor, scheme: str) -> torch.Tensor | None:
    """Per-sample loss weights for `sigmas` (n,): None for "none"; "sigma_sqrt" sigma^-2 and "cosmap"
    2 / (pi (1 - 2 sigma + 2 sigma^2)), as SD3 weights its loss (diffusers' compute_loss_weighting_for_sd3)."""
    if scheme == "none":
        return None
    sigmas = sigmas.float()
    if scheme == "sigma_sqrt":
        return sigmas**-2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigmas + 2 * sigmas**2))
    raise UserError(f"unknown loss weighting {scheme!r}; use none, sigma_sqrt or cosmap")


def flow_settings(flow, spec):
    """[flow] as a run uses it: each of `sigma_sampling`, `shift` and `loss_weighting` the config leaves unset taken
    from the family's reference recipe (`spec.flow_recipe`, docs/families.md)."""
    recipe = spec.flow_recipe
    unset = {key: getattr(recipe, key) for key in ("sigma_sampling", "shift", "loss_weighting")}
    return flow.model_copy(update={key: value for key, value in unset.items() if getattr(flow, key) is None})


def sample_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(like.shape, generator=generator, dtype=torch.float32).to(like.device, like.dtype)


def joint_loss(
    out: Prediction,
    audio_weight: float,
    sample_weights: torch.Tensor | None = None,
    audio_sample_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, audio loss or None): the video loss plus `audio_weight` x the audio stream's (model.audio);
    `sample_weights` (n,) scale each sample's error (flow.loss_weighting), in the audio loss too unless it has its
    own (`audio_sample_weights`: its sigmas' weights, with independent audio timesteps)."""
    if out.audio is None:
        return flow_matching_loss(out, sample_weights), None
    audio = flow_matching_loss(out.audio, sample_weights if audio_sample_weights is None else audio_sample_weights)
    return flow_matching_loss(out, sample_weights) + audio_weight * audio, audio


def flow_matching_loss(out: Prediction, sample_weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error over the elements the spec keeps (weight > 0), in fp32; each sample's error times
    its `sample_weights` entry where given."""
    error = (out.prediction.float() - out.target.float()) ** 2
    if sample_weights is not None:
        error = error * sample_weights.to(error.device, torch.float32).view(-1, *[1] * (error.ndim - 1))
    if out.weight is None:
        return error.mean()
    weight = out.weight.float().expand_as(error)
    return (error * weight).sum() / weight.sum().clamp_min(1e-8)
