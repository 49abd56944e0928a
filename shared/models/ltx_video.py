"""LTX-Video (Lightricks): T5 text encoder, causal video VAE (x8 time, x32 space), packed-token DiT.
What is particular to it, and why: docs/families.md, "LTX-Video"."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import (
    NUM_TRAIN_TIMESTEPS,
    FlowRecipe,
    Prediction,
    flow_inputs,
    flow_match_noisy,
    input_dtype,
)
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.spec import ModelSpec, VaeGeometry


class LTXVideoSpec(ModelSpec):
    family: ClassVar[str] = "ltx-video"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # attention masks the rest
    # The original LTX-Video checkpoint (and ComfyUI) use diffusers' module names; diffusers' LTX
    # conversion takes lora_A/lora_B without `.alpha`, so the scale goes into lora_B.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ((r"(transformer_blocks\..+)", r"\1"),)
    comfy_alpha: ClassVar[bool] = False
    noisy_first_frame: ClassVar[bool] = True  # i2v may noise the conditioning frame lightly
    example_hub_id: ClassVar[str] = "Lightricks/LTX-Video"
    # Lightricks/LTX-Video-Trainer: "shifted_logit_normal" (its default), a logit-normal whose mean grows with the
    # token count from 0.95 (1,024 tokens) to 2.05 (4,096), which is the logit-normal shifted by the scheduler's own
    # resolution shift ("auto"); an unweighted loss (docs/families.md).
    flow_recipe: ClassVar[FlowRecipe] = FlowRecipe("logit_normal", "auto", "none")
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:T5EncoderModel",
        "vae": "diffusers:AutoencoderKLLTXVideo",
        "transformer": "diffusers:LTXVideoTransformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:LTXPipeline", "i2v": "diffusers:LTXImageToVideoPipeline"}

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self._vae_without_weights()
        transformer = self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise UserError("LTX transformers with patch_size_t > 1 are not supported")
        return VaeGeometry(
            temporal=vae.temporal_compression_ratio,
            spatial=vae.spatial_compression_ratio,
            channels=vae.config.latent_channels,
            patch=transformer.get("patch_size", 1),
        )

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        return self._prompt_and_mask(encoders, captions)

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """i2v adds the first frame's latents, encoded alone as the i2v pipeline encodes its image."""
        self._check_video(video)
        out = {"latents": self._encode(encoders["vae"], video)}
        if self.frame_conditions:
            out["first_frame_latents"] = self._encode(encoders["vae"], self.frame_conditions.first(video))
        return out

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = super().condition_shapes(bucket)
        if self.frame_conditions:
            shapes["first_frame_latents"] = self.frame_conditions.frame_shape(shapes["latents"])
        return shapes

    @staticmethod
    def _encode(vae, video: Tensor) -> Tensor:
        from diffusers import LTXPipeline

        latents = ModelSpec.vae_mode(vae, video)
        return LTXPipeline._normalize_latents(
            latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        ).float()

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """Flow matching on the packed tokens; i2v: frame 0 is the conditioning latent, at its own sigma."""
        from diffusers import LTXPipeline

        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        g = self.geometry
        grid = (x0.shape[2], x0.shape[3] // g.patch, x0.shape[4] // g.patch)
        timestep, weight = sigmas, None
        if self.frame_conditions:
            x0, frame_sigmas, weight = self._condition_first_frame(batch, x0, sigmas, generators)
            noisy = flow_match_noisy(x0, noise, frame_sigmas[:, None, :, None, None])
            timestep = frame_sigmas[:, :, None].expand(-1, -1, grid[1] * grid[2]).flatten(1)  # per token, frame-major
        dtype = input_dtype(transformer)
        tokens = LTXPipeline._pack_latents(noisy, g.patch, 1).to(dtype)
        out = transformer(
            hidden_states=tokens,
            encoder_hidden_states=batch["prompt_embeds"].to(tokens.device, dtype),
            timestep=(timestep * NUM_TRAIN_TIMESTEPS).to(tokens.device),  # float32, as the pipeline passes it
            encoder_attention_mask=batch["prompt_attention_mask"].to(tokens.device),
            num_frames=grid[0],
            height=grid[1],
            width=grid[2],
            rope_interpolation_scale=(g.temporal / self.frame_rate, g.spatial, g.spatial),  # as the pipeline
            return_dict=False,
        )[0]
        prediction = LTXPipeline._unpack_latents(out, *grid, g.patch, 1)
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)

    def _condition_first_frame(self, batch, x0, sigmas, generators):
        """Frame 0: the conditioning latent, at sigma 0 or up to model.first_frame_noise (never above the sample's)."""
        self.frame_conditions.require(batch, "first_frame_latents")
        x0 = torch.cat([batch["first_frame_latents"].to(x0), x0[:, :, 1:]], dim=2)
        frame_sigmas = sigmas[:, None].repeat(1, x0.shape[2])
        frame_sigmas[:, 0] = 0
        if self.config.first_frame_noise > 0:  # each sample's own generator: every layout draws the same
            draw = (
                torch.stack([torch.rand((), generator=g) for g in generators])
                if generators is not None
                else torch.rand(x0.shape[0])
            )
            frame_sigmas[:, 0] = torch.minimum(draw.to(sigmas) * self.config.first_frame_noise, sigmas)
        weight = torch.ones(x0.shape[0], 1, x0.shape[2], 1, 1, device=x0.device, dtype=x0.dtype)
        weight[:, :, 0] = 0.0
        return x0, frame_sigmas, weight

    def inference_settings(self) -> dict[str, Any]:
        """RoPE's temporal scale depends on the frame rate: sample at the rate frames were sampled at."""
        return {**super().inference_settings(), "frame_rate": self.frame_rate}

    def tp_plan(self) -> TensorParallelPlan:
        return TensorParallelPlan(
            colwise=(*(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")), "ff.net.0.proj"),
            rowwise=("attn1.to_out.0", "attn2.to_out.0", "ff.net.2"),
            attention=("attn1", "attn2"),
            head_norms=tuple(f"{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")),
            channel_rope="rope",
        )  # rotary tables over the flat (B, S, heads x head_dim) queries: each rank's own

    def cp_plan(self) -> ContextParallelPlan:
        """The tokens and per-token timesteps (i2v) split; the rotary tables are the whole grid's, as Ulysses needs."""
        return ContextParallelPlan(
            split_inputs={"": {"hidden_states": 1, "timestep": 1}},
            gather_output="proj_out",
            self_attention=("attn1",),
            rope_heads={"rope": -1},
        )
