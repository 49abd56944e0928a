"""SkyReels V2 (Skywork): Wan 2.1's UMT5, VAE and DiT, text- and image-to-video, and diffusion forcing.

What is particular to it, and why: docs/families.md, "SkyReels V2".
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.errors import UserError
from vt.shared.models.components import load_class
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_match_noisy
from vt.shared.models.frame_conditions import task_of
from vt.shared.models.plans import ContextParallelPlan
from vt.shared.models.roles import PerFrameNoise
from vt.shared.models.spec import VaeGeometry
from vt.shared.models.wan import WanSpec

DF_PIPELINES = {
    "t2v": "diffusers:SkyReelsV2DiffusionForcingPipeline",
    "i2v": "diffusers:SkyReelsV2DiffusionForcingImageToVideoPipeline",
}
FPS_INDEX_0_RATE = 16  # the DF pipelines' `fps` embedding: index 0 at exactly this rate, 1 at any other


class SkyReelsV2Spec(WanSpec):
    family: ClassVar[str] = "skyreels-v2"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    example_hub_id: ClassVar[str] = "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers"
    components: ClassVar[dict[str, str]] = {
        **WanSpec.components,
        "transformer": "diffusers:SkyReelsV2Transformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = {
        "t2v": "diffusers:SkyReelsV2Pipeline",
        "i2v": "diffusers:SkyReelsV2ImageToVideoPipeline",
    }

    @property
    def forcing(self) -> bool:  # `model.diffusion_forcing`: a noise level per latent frame, the DF pipelines
        return self.config.diffusion_forcing

    # Under diffusion forcing i2v conditions on a clean first latent frame alone: no CLIP, no condition frames.
    @property
    def clip_image_conditioning(self) -> bool:  # type: ignore[override]
        return not self.forcing

    @property
    def condition_frames(self) -> bool:
        return super().condition_frames and not self.forcing

    @property
    def task_components(self) -> dict[str, dict[str, str]]:  # type: ignore[override]
        return {} if self.forcing else WanSpec.task_components

    def pipeline_class(self) -> type:
        return load_class((DF_PIPELINES if self.forcing else self.pipelines)[task_of(self.config)])

    @cached_property
    def causal_block(self) -> int:
        """Latent frames per causal block (the transformer's `num_frame_per_block`): they share a noise level."""
        return int(self.load_config("transformer").get("num_frame_per_block") or 1)

    @cached_property
    def sample_info(self) -> bool:
        """Whether the transformer embeds the frame rate (`inject_sample_info`: SkyReels-V2-DF-1.3B)."""
        return bool(self.load_config("transformer").get("inject_sample_info"))

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """Wan's; diffusion forcing takes the t2v transformer for both tasks, and alone one embedding the frame rate."""
        where = self.source("transformer")[0]
        if not self.forcing:
            if transformer.get("inject_sample_info"):
                raise UserError(
                    f"the transformer at {where!r} embeds the frame rate (inject_sample_info, a "
                    "SkyReels-V2-DF checkpoint), which only the diffusion-forcing pipelines feed: set "
                    "model.diffusion_forcing = true"
                )
            return super()._check_task_fits(transformer, g)
        found = {key: transformer.get(key) for key in ("in_channels", "image_dim")}
        if found["in_channels"] != g.channels or found["image_dim"]:
            raise UserError(
                f"model.diffusion_forcing = true needs a text-to-video SkyReels V2 transformer "
                f"(in_channels {g.channels}, no image_dim; e.g. Skywork/SkyReels-V2-DF-1.3B-540P-"
                f"Diffusers), for i2v too; the one at {where!r} has {found}"
            )

    def check_bucket(self, bucket: Bucket) -> None:
        """Diffusion forcing: whole causal blocks only (the transformer builds its causal mask per block)."""
        super().check_bucket(bucket)
        frames = (bucket.frames - 1) // self.geometry.temporal + 1
        if self.forcing and frames % self.causal_block:
            raise UserError(
                f"bucket {bucket.name}: {frames} latent frames do not make whole causal blocks of "
                f"{self.causal_block} (the transformer's num_frame_per_block); change buckets.sizes"
            )

    @property
    def per_frame_noise(self) -> PerFrameNoise:  # type: ignore[override]  # one sigma per causal block
        return PerFrameNoise(lambda latent_shape: latent_shape[1] // self.causal_block)

    def frame_sigmas(self, sigmas: Tensor, frames: int) -> Tensor:
        """(B, frames) sigmas from (B,) (every frame alike: the synchronous schedule) or (B, causal blocks)."""
        if sigmas.ndim == 1:
            return sigmas[:, None].expand(-1, frames).clone()
        if sigmas.shape[1] * self.causal_block != frames:
            raise ValueError(
                f"diffusion forcing got {sigmas.shape[1]} noise levels per sample for {frames} latent "
                f"frames in causal blocks of {self.causal_block}; draw spec.noise_levels(latent shape)"
            )
        return sigmas.repeat_interleave(self.causal_block, dim=1)

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """Wan's; under diffusion forcing the DF pipelines' call, a timestep per frame."""
        if not self.forcing:
            return super().forward(transformer, batch, sigmas, noise, generators)
        x0 = batch["latents"].float()
        noise = noise.to(x0)
        per_frame = self.frame_sigmas(sigmas.to(x0), x0.shape[2])
        i2v = bool(self.frame_conditions)
        if i2v:  # the clean image latent at timestep 0, left out of the loss
            per_frame[:, 0] = 0
        noisy = flow_match_noisy(x0, noise, per_frame[:, None, :, None, None])
        # One fps index for the batch: diffusers' DF forward broadcasts the fps projection over it only from one.
        fps = {"fps": [0 if round(self.frame_rate) == FPS_INDEX_0_RATE else 1]} if self.sample_info else {}
        return self._predict(
            transformer,
            batch,
            x0,
            noise,
            noisy,
            per_frame * NUM_TRAIN_TIMESTEPS,
            clean_first_frame=i2v,
            enable_diffusion_forcing=True,
            **fps,
        )

    def inference_settings(self) -> dict[str, Any]:
        """The text length, and the frame rate as the DF pipelines' integer `fps` where the transformer embeds it."""
        fps = {"fps": round(self.frame_rate)} if self.forcing and self.sample_info else {}
        return {**super().inference_settings(), **fps}

    def pipeline_inputs(
        self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None, **kwargs
    ) -> dict[str, Any]:
        """The DF pipelines denoise the bucket's frames in one window (`base_num_frames`), as training saw them."""
        inputs = super().pipeline_inputs(prompt, bucket, steps, seed, image, **kwargs)
        if self.forcing:
            inputs["base_num_frames"] = bucket.frames
        return inputs

    def cp_plan(self) -> ContextParallelPlan:
        """Wan's; under diffusion forcing each block's modulations (`temb`) split too, gathered after the last block."""
        if not self.forcing:
            return super().cp_plan()
        layers = int(self.load_config("transformer")["num_layers"])
        split = {f"blocks.{index}": {"temb": 2} for index in range(layers)}
        split["blocks.0"] = {"hidden_states": 1, "temb": 2}
        return ContextParallelPlan(split_inputs=split, gather_output=f"blocks.{layers - 1}", self_attention=("attn1",))
