"""Flow matching: reproducible noise and sigmas, timestep shift, the weighted loss.

Randomness is keyed, never carried: the trainer draws each sample's sigma and noise from a generator
seeded by (seed, step, index of the sample in the step) (`parallel/batching.py`), so a resumed run,
any parallel layout and any accumulation setting draw exactly what one uninterrupted process draws.
`step_generator` (seed, step, micro-step, data-parallel rank) feeds only the spec's own draws (the LTX
first-frame noise).
"""

from __future__ import annotations

import torch

from vt.shared.models.flow import Prediction
from vt.shared.runtime import keyed_generator


def step_generator(seed: int, step: int, micro: int = 0, rank: int = 0) -> torch.Generator:
    return keyed_generator(seed, step, micro, rank)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """The resolution shift of rectified-flow models: pushes sigmas towards 1 (more noise) for shift > 1."""
    if shift == 1.0:
        return sigmas
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def sample_sigmas(n: int, scheme: str, shift: float, generator: torch.Generator) -> torch.Tensor:
    if scheme == "logit_normal":
        sigmas = torch.sigmoid(torch.randn(n, generator=generator))
    elif scheme == "uniform":
        sigmas = torch.rand(n, generator=generator)
    else:
        raise ValueError(f"unknown sigma sampling {scheme!r}; use logit_normal or uniform")
    return shift_sigmas(sigmas, shift)


def sample_noise(like: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(like.shape, generator=generator, dtype=torch.float32).to(like.device, like.dtype)


def joint_loss(out: Prediction, audio_weight: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(loss, audio loss or None): the video loss plus `audio_weight` x the audio stream's (model.audio)."""
    if out.audio is None:
        return flow_matching_loss(out), None
    audio = flow_matching_loss(out.audio)
    return flow_matching_loss(out) + audio_weight * audio, audio


def flow_matching_loss(out: Prediction) -> torch.Tensor:
    """Mean squared error over the elements the spec keeps (weight > 0), in fp32."""
    error = (out.prediction.float() - out.target.float()) ** 2
    if out.weight is None:
        return error.mean()
    weight = out.weight.float().expand_as(error)
    return (error * weight).sum() / weight.sum().clamp_min(1e-8)
