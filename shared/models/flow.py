"""What a flow-matching family's `forward` starts from and returns: the noisy input and the loss terms."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

NUM_TRAIN_TIMESTEPS = 1000  # flow-matching schedulers: timestep = sigma * 1000


@dataclass(frozen=True)
class FlowRecipe:
    """A family's defaults for the [flow] keys a config leaves unset: the timestep sampling, shift and loss weighting
    of its reference training recipe (the model authors' or diffusers' training script, cited in docs/families.md),
    or vt's own (logit-normal, no shift, unweighted) where none publishes one. Values as [flow] takes them."""

    sigma_sampling: str = "logit_normal"
    shift: float | str = 1.0  # a number, or "auto": the family scheduler's own at each bucket's token count
    loss_weighting: str = "none"


@dataclass
class Prediction:
    """What the loss needs: loss = mean(weight * (prediction - target) ** 2)."""

    prediction: Tensor  # model output, same shape as target
    target: Tensor
    weight: Tensor | None  # broadcastable to target; 0 leaves an element out; None = all ones
    # model.audio: the audio stream's own terms (same sigma per sample); the trainer adds
    # model.audio_weight x its loss to the video loss and logs it as `audio_loss`.
    audio: Prediction | None = None


def flow_match_noisy(x0: Tensor, noise: Tensor, sigmas: Tensor) -> Tensor:
    """Rectified-flow interpolation (1 - s) * x0 + s * noise.

    `sigmas` is (B,) (one per sample) or already broadcastable to x0 (e.g. one per latent frame).
    """
    s = sigmas.to(x0.dtype)
    if s.ndim == 1:
        s = s.view(-1, *([1] * (x0.ndim - 1)))
    return (1 - s) * x0 + s * noise


def flow_inputs(batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(x0, noise, sigmas (B,), noisy) in float32 on the latents' device: the batch's latents and their
    rectified-flow interpolation, what a flow-matching family's `forward` starts from."""
    x0 = batch["latents"].float()
    noise = noise.to(x0)
    sigmas = sigmas.to(x0).flatten()
    return x0, noise, sigmas, flow_match_noisy(x0, noise, sigmas)


_INPUT_DTYPES: "weakref.WeakKeyDictionary[nn.Module, torch.dtype]" = weakref.WeakKeyDictionary()


def input_dtype(transformer: nn.Module) -> torch.dtype:
    """The dtype to feed the transformer (diffusers' `.dtype`), looked up once per model: `.dtype`
    walks every submodule, which costs milliseconds per step on a large model."""
    dtype = _INPUT_DTYPES.get(transformer)
    if dtype is None:
        dtype = _INPUT_DTYPES[transformer] = transformer.dtype
    return dtype
