"""Wan 2.2 TI2V-5B: one Wan transformer over a 48-channel VAE, text- and image-to-video with one set of weights.

What is particular to it, and why: docs/families.md, "Wan 2.2".
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs
from vt.shared.models.spec import VaeGeometry
from vt.shared.models.wan import WanSpec


class Wan22TI2VSpec(WanSpec):
    family: ClassVar[str] = "wan2.2-ti2v"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    example_hub_id: ClassVar[str] = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"
    clip_image_conditioning: ClassVar[bool] = False
    task_components: ClassVar[dict[str, dict[str, str]]] = {}  # no CLIP image encoder
    condition_frames: ClassVar[bool] = False  # an i2v condition is the latents' first frame

    def pipeline_options(self) -> dict[str, Any]:
        return {"expand_timesteps": True}

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """Both tasks take the latents alone: in_channels = the VAE's z_dim, no image projections."""
        found = {key: transformer.get(key) for key in ("in_channels", "image_dim")}
        if found["in_channels"] != g.channels or found["image_dim"]:
            raise UserError(
                f"family {self.family!r} needs a TI2V-5B transformer (in_channels = the VAE's z_dim "
                f"{g.channels}, no image_dim); the one at {self.source('transformer')[0]!r} has {found}"
            )

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        i2v = bool(self.frame_conditions)
        batch_size, _, frames, height, width = x0.shape
        patch = self.geometry.patch
        # The pipeline's timestep per token (B, F * H/p * W/p), frame-major: 0 on a clean first frame's tokens.
        per_token = torch.ones(batch_size, frames, (height // patch) * (width // patch), device=x0.device)
        if i2v:  # frame 0 is the clean image latent, left out of the loss
            noisy = torch.cat([x0[:, :, :1], noisy[:, :, 1:]], dim=2)
            per_token[:, 0] = 0
        timestep = (per_token * (sigmas * NUM_TRAIN_TIMESTEPS).view(-1, 1, 1)).flatten(1)
        return self._predict(transformer, batch, x0, noise, noisy, timestep, clean_first_frame=i2v)
