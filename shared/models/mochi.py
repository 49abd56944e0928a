"""Mochi 1 (Genmo, text-to-video): T5-XXL, asymmetric video VAE (x6 time, x8 space, 12 channels) and DiT.

What is particular to it, and why: docs/families.md, "Mochi".
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, FlowRecipe, Prediction, flow_inputs, input_dtype
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.weights import comfy

# MochiPipeline's hard-coded VAE ratios (vae_temporal/spatial_scale_factor): it cannot sample other latents.
PIPELINE_TEMPORAL, PIPELINE_SPATIAL = 6, 8
# SwiGLU input projections: diffusers' rows are [linear half, SiLU half], genmo's [SiLU half, linear half].
SWIGLU_INPUTS = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.0\.proj"


class MochiSpec(ModelSpec):
    family: ClassVar[str] = "mochi"
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # attention drops the rest
    example_hub_id: ClassVar[str] = "genmo/mochi-1-preview"
    # genmoai/mochi's demos/fine_tuner: uniform sigmas, no shift, an unweighted MSE (docs/families.md).
    flow_recipe: ClassVar[FlowRecipe] = FlowRecipe("uniform", 1.0, "none")
    # The blocks' video attention; "attn1." keeps peft off the caption pooler's `to_q` (no original name).
    default_lora_targets: ClassVar[list[str]] = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"]
    # Original (genmo) module names, which ComfyUI loads (`diffusion_model.` + these).
    original_names: ClassVar[tuple[tuple[str, str], ...]] = tuple(
        (rf"transformer_blocks\.(\d+)\.{ours}", rf"blocks.\1.{theirs}")
        for ours, theirs in (
            (r"attn1\.to_out\.0", "attn.proj_x"),
            (r"attn1\.to_add_out", "attn.proj_y"),
            (r"ff\.net\.0\.proj", "mlp_x.w1"),
            (r"ff\.net\.2", "mlp_x.w2"),
            (r"ff_context\.net\.0\.proj", "mlp_y.w1"),
            (r"ff_context\.net\.2", "mlp_y.w2"),
        )
    )
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = (
        comfy.Fused(r"transformer_blocks\.(\d+)\.attn1", ("to_q", "to_k", "to_v"), r"blocks.\1.attn.qkv_x"),
        comfy.Fused(
            r"transformer_blocks\.(\d+)\.attn1", ("add_q_proj", "add_k_proj", "add_v_proj"), r"blocks.\1.attn.qkv_y"
        ),
    )
    comfy_alpha: ClassVar[bool] = False  # ranks differ between fused and plain modules: scale baked into lora_B
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:T5EncoderModel",
        "vae": "diffusers:AutoencoderKLMochi",
        "transformer": "diffusers:MochiTransformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:MochiPipeline"}

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        temporal = int(torch.tensor(vae.get("temporal_expansions", (1, 2, 3))).prod())
        spatial = int(torch.tensor(vae.get("spatial_expansions", (2, 2, 2))).prod())
        if (temporal, spatial) != (PIPELINE_TEMPORAL, PIPELINE_SPATIAL):
            raise UserError(
                f"the {self.family} VAE at {self.source('vae')[0]!r} compresses x{temporal} in time and "
                f"x{spatial} in space, but MochiPipeline assumes x{PIPELINE_TEMPORAL} and "
                f"x{PIPELINE_SPATIAL}; use Mochi's own VAE (e.g. {self.example_hub_id})"
            )
        return VaeGeometry(
            temporal=temporal,
            spatial=spatial,
            channels=vae.get("latent_channels", 12),
            patch=transformer.get("patch_size", 2),
        )

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        if len(captions) > 1 and "" in captions:  # one by one: MochiPipeline zeroes a batch whose last prompt is ""
            parts = [self.encode_text(encoders, [caption]) for caption in captions]
            return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        return self._prompt_and_mask(encoders, captions)

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """{"latents": (posterior mode - latents_mean) / latents_std * scaling_factor}, float32."""
        self._check_video(video)
        vae = encoders["vae"]
        latents = self.vae_mode(vae, video).float()
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1).to(latents)
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1).to(latents)
        return {"latents": ((latents - mean) / std * vae.config.scaling_factor).float()}

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """Timestep (1 - sigma) * 1000 and target x0 - noise: Mochi's inverted flow time."""
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            timestep=(1 - sigmas) * NUM_TRAIN_TIMESTEPS,  # float32; the pipeline passes the inverted timesteps
            encoder_attention_mask=batch["prompt_attention_mask"].to(x0.device) > 0.5,  # bool, as the pipeline
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=x0 - noise, weight=None)

    def tp_plan(self) -> TensorParallelPlan:
        """The joint attention only (the last block has no text output); the SwiGLU FFNs stay whole."""
        qkv = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
        return TensorParallelPlan(
            colwise=tuple(f"attn1.{p}" for p in qkv),
            rowwise=("attn1.to_out.0", "attn1.to_add_out"),
            attention=("attn1",),
            optional=("attn1.to_add_out",),
            rope_heads={"rope": -2},
        )

    def cp_plan(self) -> ContextParallelPlan:
        """The video tokens split at the first block; the joint attention's text whole on each rank."""
        return ContextParallelPlan(
            split_inputs={"transformer_blocks.0": {"hidden_states": 1}},
            gather_output="proj_out",
            self_attention=("attn1",),
            sequence_to_heads=("to_q", "to_k", "to_v"),
            replicated_to_heads=("add_q_proj", "add_k_proj", "add_v_proj"),
            replicated_from_heads="to_add_out",
            rope_heads={"rope": -2},
        )

    def pipeline_inputs(self, prompt: str, bucket, steps: int, seed: int, image=None) -> dict:
        if steps < 2:  # MochiPipeline's linear_quadratic_schedule divides by zero below 2 steps
            raise UserError(f"MochiPipeline needs at least 2 steps, got {steps}; set validation.steps >= 2")
        return super().pipeline_inputs(prompt, bucket, steps, seed, image)

    def comfy_out_features(self, module: str) -> int:  # any q/k/v, video or text side, of any block count
        config = self.load_config("transformer")
        return config.get("num_attention_heads", 24) * config.get("attention_head_dim", 128)

    def comfy_tensors(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """SwiGLU lora_B halves in genmo's order (q/k/v fuse into `qkv_x` / `qkv_y` by `comfy_fused`)."""
        return {
            key: swap_halves(value) if re.fullmatch(SWIGLU_INPUTS + r"\.lora_B\.weight", key) else value
            for key, value in tensors.items()
        }


def swap_halves(weight: Tensor) -> Tensor:
    """The two halves of the rows swapped: a SwiGLU input projection in diffusers' order <-> genmo's."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)
