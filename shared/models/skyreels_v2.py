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
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_match_noisy, input_dtype
from vt.shared.models.plans import ContextParallelPlan
from vt.shared.models.roles import PerFrameNoise
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.models.wan import WanSpec, _latent_stats

DF_PIPELINES = {"t2v": "diffusers:SkyReelsV2DiffusionForcingPipeline",
                "i2v": "diffusers:SkyReelsV2DiffusionForcingImageToVideoPipeline"}
FPS_INDEX_0_RATE = 16  # the DF pipelines' `fps` embedding: index 0 at exactly this rate, 1 at any other


class SkyReelsV2Spec(WanSpec):
    family: ClassVar[str] = "skyreels-v2"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    example_hub_id: ClassVar[str] = "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers"
    components: ClassVar[dict[str, str]] = {**WanSpec.components,
                                            "transformer": "diffusers:SkyReelsV2Transformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:SkyReelsV2Pipeline",
                                           "i2v": "diffusers:SkyReelsV2ImageToVideoPipeline"}

    @property
    def forcing(self) -> bool:
        """`model.diffusion_forcing`: a noise level per latent frame, and the DF pipelines for validation."""
        return self.config.diffusion_forcing

    @property
    def clip_image_conditioning(self) -> bool:  # type: ignore[override]
        """CLIP image tokens for the I2V checkpoints; the DF image-to-video pipeline conditions on a clean
        first latent frame alone."""
        return not self.forcing

    @property
    def task_components(self) -> dict[str, dict[str, str]]:  # type: ignore[override]
        """Wan 2.1 i2v's CLIP image encoder and processor, but none under diffusion forcing."""
        return {} if self.forcing else WanSpec.task_components

    def pipeline_class(self) -> type:
        """SkyReelsV2Pipeline / ImageToVideoPipeline, or their diffusion-forcing pipelines."""
        return load_class((DF_PIPELINES if self.forcing else self.pipelines)[self.config.task])

    @cached_property
    def causal_block(self) -> int:
        """Latent frames per causal block (the transformer's `num_frame_per_block`): they share a noise level."""
        return int(self.load_config("transformer").get("num_frame_per_block") or 1)

    @cached_property
    def sample_info(self) -> bool:
        """Whether the transformer embeds the frame rate (`inject_sample_info`: SkyReels-V2-DF-1.3B)."""
        return bool(self.load_config("transformer").get("inject_sample_info"))

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """Wan's checks, except that diffusion forcing takes the text-to-video transformer for both tasks,
        and that only the diffusion-forcing pipelines feed a transformer that embeds the frame rate."""
        where = self.source("transformer")[0]
        if not self.forcing:
            if transformer.get("inject_sample_info"):
                raise UserError(f"the transformer at {where!r} embeds the frame rate (inject_sample_info, a "
                                 "SkyReels-V2-DF checkpoint), which only the diffusion-forcing pipelines feed: set "
                                 "model.diffusion_forcing = true")
            super()._check_task_fits(transformer, g)
            return
        found = {key: transformer.get(key) for key in ("in_channels", "image_dim")}
        if found["in_channels"] != g.channels or found["image_dim"]:
            raise UserError(f"model.diffusion_forcing = true needs a text-to-video SkyReels V2 transformer "
                             f"(in_channels {g.channels}, no image_dim; e.g. Skywork/SkyReels-V2-DF-1.3B-540P-"
                             f"Diffusers), for i2v too; the one at {where!r} has {found}")

    def check_bucket(self, bucket: Bucket) -> None:
        """Diffusion forcing with causal blocks of several latent frames: whole blocks only (the
        transformer's causal mask is built per block)."""
        super().check_bucket(bucket)
        frames = (bucket.frames - 1) // self.geometry.temporal + 1
        if self.forcing and frames % self.causal_block:
            raise UserError(f"bucket {bucket.name}: {frames} latent frames do not make whole causal blocks of "
                             f"{self.causal_block} (the transformer's num_frame_per_block); change buckets.sizes")

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Wan's; under diffusion forcing the latents alone, for both tasks (an i2v condition is their
        first frame)."""
        if not self.forcing:
            return super().encode_video(encoders, video)
        self._check_video(video)
        latents = self._vae_mode(encoders["vae"], video)
        mean, std = _latent_stats(encoders["vae"], latents)
        return {"latents": ((latents - mean) / std).float()}

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """Wan's; the latents alone under diffusion forcing (what `encode_video` stores)."""
        return ModelSpec.condition_shapes(self, bucket) if self.forcing else super().condition_shapes(bucket)

    # ----------------------------------------------------------------------------- stage 2
    @property
    def per_frame_noise(self) -> PerFrameNoise:  # type: ignore[override]
        """One sigma per causal block under diffusion forcing."""
        return PerFrameNoise(lambda latent_shape: latent_shape[1] // self.causal_block)

    def frame_sigmas(self, sigmas: Tensor, frames: int) -> Tensor:
        """(B, frames) sigmas from the trainer's (B,) (every frame alike: the pipeline's synchronous
        schedule) or (B, blocks) (each causal block's frames at its level)."""
        if sigmas.ndim == 1:
            return sigmas[:, None].expand(-1, frames).clone()
        if sigmas.shape[1] * self.causal_block != frames:
            raise ValueError(f"diffusion forcing got {sigmas.shape[1]} noise levels per sample for {frames} latent "
                             f"frames in causal blocks of {self.causal_block}; draw spec.noise_levels(latent shape)")
        return sigmas.repeat_interleave(self.causal_block, dim=1)

    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """Wan's forward; under diffusion forcing the DF pipelines' call (docs/families.md, SkyReels V2)."""
        if not self.forcing:
            return super().forward(transformer, batch, sigmas, noise, generators)
        x0 = batch["latents"].float()
        noise = noise.to(x0)
        batch_size, _, frames = x0.shape[:3]
        per_frame = self.frame_sigmas(sigmas.to(x0), frames)
        weight = None
        if self.config.task == "i2v":  # the clean image latent at timestep 0, left out of the loss
            per_frame[:, 0] = 0
            weight = torch.ones(1, 1, frames, 1, 1, device=x0.device)
            weight[:, :, 0] = 0
        noisy = flow_match_noisy(x0, noise, per_frame.view(batch_size, 1, frames, 1, 1))
        dtype = input_dtype(transformer)
        # One fps index for the whole batch: the run has one frame rate, and diffusers' DF forward adds the
        # fps projection repeated per frame, which broadcasts over the batch only from a single entry.
        fps = {"fps": [self.fps_index]} if self.sample_info else {}
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=per_frame * NUM_TRAIN_TIMESTEPS,  # (B, F) float32, per frame as the DF pipelines pass it
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            enable_diffusion_forcing=True,
            return_dict=False,
            **fps,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)

    @property
    def fps_index(self) -> int:
        """The DF pipelines' fps embedding index of the bucket frame rate (0 at 16 fps, else 1)."""
        return 0 if self.inference_fps == FPS_INDEX_0_RATE else 1

    @property
    def inference_fps(self) -> int:
        """The bucket frame rate as the DF pipelines' integer `fps` argument."""
        return round(self.frame_rate)

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """The text length, and the frame rate where the transformer embeds it (DF-1.3B)."""
        fps = {"fps": self.inference_fps} if self.forcing and self.sample_info else {}
        return {**super().inference_settings(), **fps}

    def pipeline_inputs(self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None,
                        **kwargs) -> dict[str, Any]:
        """The DF pipelines denoise the bucket's frames in one window (`base_num_frames`), as training saw
        them; a longer video would need its overlapping long-video mode."""
        inputs = super().pipeline_inputs(prompt, bucket, steps, seed, image, **kwargs)
        if self.forcing:
            inputs["base_num_frames"] = bucket.frames
        return inputs

    # ----------------------------------------------------------------------------- parallel plans
    def cp_plan(self) -> ContextParallelPlan:
        """Wan's plan; under diffusion forcing the per-frame modulations are split instead of the timestep.

        The DF transformer expands its (B, F) timestep to per-token modulations inside its forward
        (`temb` (B, 6, tokens, D) for each block, and (B, tokens, D) for the output norm), so each block's
        `temb` is cut along the tokens with the hidden states, and the sequence is gathered after the last
        block: the output norm and projection then run on every token on each cp rank (their gradient is
        the same on all of them, which the cp averaging keeps). Any token count cp divides works,
        whatever the frame count.
        """
        if not self.forcing:
            return super().cp_plan()
        layers = int(self.load_config("transformer")["num_layers"])
        split = {f"blocks.{index}": {"temb": 2} for index in range(layers)}
        split["blocks.0"] = {"hidden_states": 1, "temb": 2}
        return ContextParallelPlan(split_inputs=split, gather_output=f"blocks.{layers - 1}", self_attention=("attn1",))
