"""Wan 2.2 TI2V-5B: one Wan transformer over a 48-channel VAE, text- and image-to-video with one set of weights.

What is particular to it, and why: docs/families.md, "Wan 2.2".
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.models.wan import WanSpec, _latent_stats


class Wan22TI2VSpec(WanSpec):
    family: ClassVar[str] = "wan2.2-ti2v"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    example_hub_id: ClassVar[str] = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    clip_image_conditioning: ClassVar[bool] = False
    task_components: ClassVar[dict[str, dict[str, str]]] = {}  # no CLIP image encoder

    def pipeline_options(self) -> dict[str, Any]:
        return {"expand_timesteps": True}

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """Both tasks take the latents alone: in_channels = the VAE's z_dim, no image projections."""
        found = {key: transformer.get(key) for key in ("in_channels", "image_dim")}
        if found["in_channels"] != g.channels or found["image_dim"]:
            raise UserError(f"family {self.family!r} needs a TI2V-5B transformer (in_channels = the VAE's z_dim "
                             f"{g.channels}, no image_dim); the one at {self.source('transformer')[0]!r} has {found}")

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Normalised latents (posterior mode) for both tasks: an i2v condition is their first frame."""
        self._check_video(video)
        latents = self._vae_mode(encoders["vae"], video)
        mean, std = _latent_stats(encoders["vae"], latents)
        return {"latents": ((latents - mean) / std).float()}

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """The latents alone, for both tasks (an i2v condition is their first frame)."""
        return ModelSpec.condition_shapes(self, bucket)

    def token_timesteps(self, sigmas: Tensor, latents: Tensor, clean_first_frame: bool) -> Tensor:
        """The pipeline's per-token timesteps (B, F * H/p * W/p), frame-major: sigma * 1000 everywhere,
        0 on the first frame's tokens when it is the clean condition."""
        batch, _, frames, height, width = latents.shape
        patch = self.geometry.patch
        per_frame = torch.ones(batch, frames, (height // patch) * (width // patch), device=latents.device)
        if clean_first_frame:
            per_frame[:, 0] = 0
        return (per_frame * (sigmas * NUM_TRAIN_TIMESTEPS).view(-1, 1, 1)).flatten(1)

    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        i2v = self.config.task == "i2v"
        weight = None
        if i2v:  # frame 0 is the clean image latent, left out of the loss
            noisy = torch.cat([x0[:, :, :1], noisy[:, :, 1:]], dim=2)
            weight = torch.ones(1, 1, x0.shape[2], 1, 1, device=x0.device)
            weight[:, :, 0] = 0
        prediction = transformer(
            hidden_states=noisy.to(input_dtype(transformer)),
            timestep=self.token_timesteps(sigmas, x0, clean_first_frame=i2v),
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, input_dtype(transformer)),
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)
