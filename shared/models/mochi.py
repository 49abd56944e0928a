"""Mochi 1 (Genmo, text-to-video): T5-XXL text encoder, asymmetric video VAE (x6 time, x8 space, 12
channels), an asymmetric DiT over [video, text] with a text padding mask.

What is particular to it, and why: docs/families.md, "Mochi".
"""

from __future__ import annotations

import re
from typing import ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models import comfy
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.spec import ModelSpec, VaeGeometry

# What MochiPipeline hard-codes (vae_temporal_scale_factor, vae_spatial_scale_factor): a VAE with other
# ratios would train on latents the pipeline cannot sample.
PIPELINE_TEMPORAL, PIPELINE_SPATIAL = 6, 8
# SwiGLU input projections: diffusers' rows are [linear half, SiLU half], genmo's [SiLU half, linear half].
SWIGLU_INPUTS = r"transformer_blocks\.\d+\.(ff|ff_context)\.net\.0\.proj"


class MochiSpec(ModelSpec):
    family: ClassVar[str] = "mochi"
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # attention drops the rest
    example_hub_id: ClassVar[str] = "genmo/mochi-1-preview"
    # The blocks' video attention; "attn1." keeps peft's suffix match off the caption pooler's own
    # `time_embed.pooler.to_q` (which has no original name in the ComfyUI file).
    default_lora_targets: ClassVar[list[str]] = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0"]
    # Original (genmo) module names, which ComfyUI loads (`diffusion_model.` + these).
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"transformer_blocks\.(\d+)\.attn1\.to_out\.0", r"blocks.\1.attn.proj_x"),
        (r"transformer_blocks\.(\d+)\.attn1\.to_add_out", r"blocks.\1.attn.proj_y"),
        (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj", r"blocks.\1.mlp_x.w1"),
        (r"transformer_blocks\.(\d+)\.ff\.net\.2", r"blocks.\1.mlp_x.w2"),
        (r"transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj", r"blocks.\1.mlp_y.w1"),
        (r"transformer_blocks\.(\d+)\.ff_context\.net\.2", r"blocks.\1.mlp_y.w2"),
    )
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = (
        comfy.Fused(r"transformer_blocks\.(\d+)\.attn1", ("to_q", "to_k", "to_v"), r"blocks.\1.attn.qkv_x"),
        comfy.Fused(r"transformer_blocks\.(\d+)\.attn1", ("add_q_proj", "add_k_proj", "add_v_proj"),
                    r"blocks.\1.attn.qkv_y"),
    )
    comfy_alpha: ClassVar[bool] = False  # ranks differ between fused and plain modules: scale baked into lora_B

    components: ClassVar[dict[str, str]] = {"text_encoder": "transformers:T5EncoderModel",
                                            "vae": "diffusers:AutoencoderKLMochi",
                                            "transformer": "diffusers:MochiTransformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:MochiPipeline"}

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        temporal = int(torch.tensor(vae.get("temporal_expansions", (1, 2, 3))).prod())
        spatial = int(torch.tensor(vae.get("spatial_expansions", (2, 2, 2))).prod())
        if (temporal, spatial) != (PIPELINE_TEMPORAL, PIPELINE_SPATIAL):
            raise UserError(f"the {self.family} VAE at {self.source('vae')[0]!r} compresses x{temporal} in time and "
                             f"x{spatial} in space, but MochiPipeline assumes x{PIPELINE_TEMPORAL} and "
                             f"x{PIPELINE_SPATIAL}; use Mochi's own VAE (e.g. {self.example_hub_id})")
        return VaeGeometry(temporal=temporal, spatial=spatial, channels=vae.get("latent_channels", 12),
                           patch=transformer.get("patch_size", 2))

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L) 0/1}, T5 run with the mask.

        MochiPipeline zeroes the whole batch's tokens when its last prompt is empty (meant for a
        negative prompt); a batch holding an empty caption is encoded one caption at a time so only
        that caption is zeroed, as the pipeline would encode it alone."""
        if len(captions) > 1 and "" in captions:
            parts = [self.encode_text(encoders, [caption]) for caption in captions]
            return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
        return self._prompt_and_mask(encoders, captions)

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """{"latents": (posterior mode - latents_mean) / latents_std * scaling_factor}, float32."""
        self._check_video(video)
        vae = encoders["vae"]
        latents = self._vae_mode(vae, video).float()
        mean, std = latent_stats(vae, latents)
        return {"latents": ((latents - mean) / std * vae.config.scaling_factor).float()}

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """Timestep (1 - sigma) * 1000 and target x0 - noise: Mochi's inverted flow time (docs/families.md, Mochi)."""
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

    # ----------------------------------------------------------------------------- validation
    def tp_plan(self) -> TensorParallelPlan:
        """The joint attention only: both streams' q/k/v column-wise, their outputs row-wise (the last block has no
        text output); its per-head rotary tables cut to each rank's heads. The SwiGLU FFNs stay whole on every rank:
        their input projection holds [hidden, gate] in one Linear, which a contiguous shard would pair wrongly."""
        qkv = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
        return TensorParallelPlan(colwise=tuple(f"attn1.{p}" for p in qkv),
                                  rowwise=("attn1.to_out.0", "attn1.to_add_out"), attention=("attn1",),
                                  optional=("attn1.to_add_out",), rope_heads={"rope": -2})

    def cp_plan(self) -> ContextParallelPlan:
        """Split the video tokens where the first block receives them, gather after proj_out. The attention is
        joint over [video, that sample's unpadded text]: the text, whole on each rank, keeps its heads' q/k/v
        and gathers its heads' output; the rotary tables are per head (tokens, heads, D / 2): each rank keeps
        its heads' (`rope_heads`)."""
        return ContextParallelPlan(
            split_inputs={"transformer_blocks.0": {"hidden_states": 1}}, gather_output="proj_out",
            self_attention=("attn1",), sequence_to_heads=("to_q", "to_k", "to_v"),
            replicated_to_heads=("add_q_proj", "add_k_proj", "add_v_proj"), replicated_from_heads="to_add_out",
            rope_heads={"rope": -2})

    def pipeline_inputs(self, prompt: str, bucket, steps: int, seed: int, image=None) -> dict:
        """As the base class; MochiPipeline's sigma schedule (`linear_quadratic_schedule`) divides by
        zero below 2 steps, so fewer are refused here with the key to set."""
        if steps < 2:
            raise UserError(f"MochiPipeline samples with at least 2 steps, got {steps}; "
                             "set train.validation_steps >= 2")
        return super().pipeline_inputs(prompt, bucket, steps, seed, image)

    # ----------------------------------------------------------------------------- export
    def comfy_out_features(self, module: str) -> int:
        """Every q/k/v projection (video and text side) outputs heads x head_dim features."""
        config = self.load_config("transformer")
        return config.get("num_attention_heads", 24) * config.get("attention_head_dim", 128)

    def comfy_tensors(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """SwiGLU lora_B halves in genmo's order (q/k/v fuse into `qkv_x` / `qkv_y` by `comfy_fused`)."""
        return {key: swap_halves(value) if re.fullmatch(SWIGLU_INPUTS + r"\.lora_B\.weight", key) else value
                for key, value in tensors.items()}


def swap_halves(weight: Tensor) -> Tensor:
    """The two halves of the rows swapped: a SwiGLU input projection in diffusers' order <-> genmo's."""
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def latent_stats(vae, like: Tensor) -> tuple[Tensor, Tensor]:
    """The VAE config's per-channel latents_mean and latents_std, shaped (1, C, 1, 1, 1) like `like`."""
    shape = (1, -1, 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean).view(shape).to(like),
            torch.tensor(vae.config.latents_std).view(shape).to(like))
