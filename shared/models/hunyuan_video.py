"""HunyuanVideo (Tencent, text-to-video): Llama + CLIP text encoders, causal video VAE (x4 time, x8
space), a DiT of double-stream then single-stream blocks with a guidance embedding.

What is particular to HunyuanVideo:
- two text encoders: the Llama encoder's third-to-last hidden states of the caption inside a chat
  template (`prompt_embeds`, with `prompt_attention_mask`, right padded: the transformer builds its
  joint mask assuming right padding) and CLIP's pooled output (`pooled_prompt_embeds`, fed as
  `pooled_projections`). HunyuanVideoPipeline's own `encode_prompt` does both and we call it. Its
  template crops 95 chat tokens counted with the real Llama-3 tokenizer; a tokenizer without the
  Llama-3 header tokens (the tiny preset's) encodes the bare caption (`prompt_template`), and
  validation passes the same template to the pipeline;
- latents are the VAE posterior mode times `scaling_factor` (the pipeline divides by it to decode);
- the checkpoint is guidance-distilled: the transformer takes the guidance scale * 1000 through its
  guidance embedding. Training feeds 1.0 (1000), as musubi-tuner and finetrainers train it, so the
  LoRA learns the data rather than one guidance strength; sampling still picks its own
  `guidance_scale` (the pipeline's default 6.0 in validation). `train_guidance` sets it;
- the timestep is sigma * 1000 (float, as the pipeline passes it), the target noise - x0;
- LoRA never goes into the text token refiner (`context_embedder.token_refiner`): diffusers' loader
  cannot read refiner q/k/v LoRAs in the original layout. Default targets (`to_q`, `to_k`, `to_v`,
  `to_out.0`, by suffix): attention q/k/v/out of the double blocks and q/k/v of the single blocks;
- the original (Tencent, and ComfyUI's "diffusion-pipe") names fuse q/k/v into one module
  (`double_blocks.N.img_attn_qkv`, and q/k/v + the MLP input into `single_blocks.N.linear1`): the
  ComfyUI export fuses those LoRAs (comfy.Fused) with the scale baked into lora_B, no `.alpha`.
  diffusers' conversion reads double blocks back exactly at any size; it splits `linear1` at a
  hard-coded hidden size 3072, so single blocks read back only at the real model's size.
No TP or CP plan (the base class refuses parallel.tp / parallel.cp > 1): the single blocks' output
projection `proj_out` takes [attention, MLP] concatenated, so its row-wise shard would be two
non-contiguous slices; diffusers has no `_cp_plan` for it, and every block's attention is joint over
[video, text] with a text padding mask, which Ulysses would have to split apart.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.models import comfy
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.models.tiny import build_clip_tokenizer, build_llama_tokenizer

# The template for a tokenizer that lacks the Llama-3 chat header tokens: the bare caption, nothing cropped.
BARE_TEMPLATE: dict[str, Any] = {"template": "{}", "crop_start": 0}
REFINER = r".*context_embedder\.token_refiner\..*"  # never LoRA-targeted (peft exclude_modules)


class HunyuanVideoSpec(ModelSpec):
    family: ClassVar[str] = "hunyuan-video"
    # Double-stream blocks, then single-stream ones: every parallel strategy and checkpointing walks both.
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # attention masks the rest
    stage1_components: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2",
                                                    "vae")
    example_hub_id: ClassVar[str] = "hunyuanvideo-community/HunyuanVideo"
    # Original (Tencent) module names, which ComfyUI loads; one diffusers module to one original module.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        (r"transformer_blocks\.(\d+)\.attn\.to_out\.0", r"double_blocks.\1.img_attn_proj"),
        (r"transformer_blocks\.(\d+)\.attn\.to_add_out", r"double_blocks.\1.txt_attn_proj"),
        (r"transformer_blocks\.(\d+)\.ff\.net\.0\.proj", r"double_blocks.\1.img_mlp.fc1"),
        (r"transformer_blocks\.(\d+)\.ff\.net\.2", r"double_blocks.\1.img_mlp.fc2"),
        (r"transformer_blocks\.(\d+)\.ff_context\.net\.0\.proj", r"double_blocks.\1.txt_mlp.fc1"),
        (r"transformer_blocks\.(\d+)\.ff_context\.net\.2", r"double_blocks.\1.txt_mlp.fc2"),
        (r"single_transformer_blocks\.(\d+)\.proj_out", r"single_blocks.\1.linear2"),
    )
    # Several diffusers modules that are one original module (outputs stacked in this order).
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = (
        comfy.Fused(r"transformer_blocks\.(\d+)\.attn", ("to_q", "to_k", "to_v"), r"double_blocks.\1.img_attn_qkv"),
        comfy.Fused(r"transformer_blocks\.(\d+)\.attn", ("add_q_proj", "add_k_proj", "add_v_proj"),
                    r"double_blocks.\1.txt_attn_qkv"),
        comfy.Fused(r"single_transformer_blocks\.(\d+)", ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
                    r"single_blocks.\1.linear1"),
    )
    excluded_modules_named: ClassVar[str] = "the text token refiner"
    comfy_alpha: ClassVar[bool] = False  # diffusers' HunyuanVideo conversion fails on `.alpha`
    exclusions_in_metadata: ClassVar[bool] = False  # diffusers' loader targets the file's keys: never the refiner
    # The guidance scale the transformer is trained at (fed as guidance * 1000); None: the pipeline's default.
    train_guidance: ClassVar[float | None] = 1.0

    components: ClassVar[dict[str, str]] = {"text_encoder": "transformers:LlamaModel",
                                            "text_encoder_2": "transformers:CLIPTextModel",
                                            "vae": "diffusers:AutoencoderKLHunyuanVideo",
                                            "transformer": "diffusers:HunyuanVideoTransformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:HunyuanVideoPipeline"}

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self.load_config("vae")
        transformer = self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise ValueError(f"HunyuanVideo transformers with patch_size_t {transformer['patch_size_t']} are not "
                             "supported; expected 1")
        return VaeGeometry(temporal=vae.get("temporal_compression_ratio", 4),
                           spatial=vae.get("spatial_compression_ratio", 8),
                           channels=vae["latent_channels"], patch=transformer.get("patch_size", 2))

    # ----------------------------------------------------------------------------- text
    @cached_property
    def prompt_template(self) -> dict[str, Any]:
        """The pipeline's Llama-3 chat template if the tokenizer has its header tokens, else the bare caption."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        tokenizer = self.load_component("tokenizer")
        header = "<|start_header_id|>"
        known = header in tokenizer.get_vocab() or header in getattr(tokenizer, "added_tokens_encoder", {})
        return DEFAULT_PROMPT_TEMPLATE if known else BARE_TEMPLATE

    @property
    def guidance(self) -> float:
        """The guidance scale fed to the guidance embedding in training (`train_guidance`)."""
        if self.train_guidance is not None:
            return self.train_guidance
        return float(self.pipeline_default("guidance_scale"))

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L), "pooled_prompt_embeds": (B, P)},
        L = the spec's max_text_tokens, right padded."""
        embeds, pooled, mask = self._encode_prompt(encoders, captions, prompt_template=self.prompt_template)
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float(),
                "pooled_prompt_embeds": pooled.float()}

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """Llama's text and mask, and CLIP's pooled embedding."""
        return {**super().condition_shapes(bucket), "pooled_prompt_embeds": (self.text_width("text_encoder_2"),)}

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generator: torch.Generator | None = None) -> Prediction:
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        guidance = None
        if transformer.config.guidance_embeds:  # as the pipeline: (B,) in the transformer's dtype, scale * 1000
            guidance = torch.full((x0.shape[0],), self.guidance * 1000.0, device=x0.device, dtype=dtype)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,  # float32, as the pipeline passes it
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            encoder_attention_mask=batch["prompt_attention_mask"].to(x0.device, dtype),
            pooled_projections=batch["pooled_prompt_embeds"].to(x0.device, dtype),
            guidance=guidance,
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=None)

    def lora_exclusions(self, transformer) -> str:
        """The text token refiner: its original q/k/v are one fused module ComfyUI's key table lacks."""
        return REFINER

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """The text length, and the prompt template where it is not the pipeline's (tiny tokenizers)."""
        settings = super().inference_settings()
        if self.prompt_template is BARE_TEMPLATE:
            settings["prompt_template"] = dict(BARE_TEMPLATE)
        return settings

    # ----------------------------------------------------------------------------- tiny preset
    @classmethod
    def tiny_parts(cls, task: str) -> dict[str, Any]:
        """diffusers' test sizes (1 double + 1 single block, 1 refiner layer, 2 heads x 10), patch 2;
        4-level VAE (x4 time, x8 space), 2-layer Llama and CLIP with locally built BPE tokenizers;
        HunyuanVideoPipeline layout with the checkpoint's scheduler (flow-match Euler, shift 7)."""
        from diffusers import AutoencoderKLHunyuanVideo, FlowMatchEulerDiscreteScheduler, HunyuanVideoTransformer3DModel
        from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

        tokenizer, tokenizer_2 = build_llama_tokenizer(), build_clip_tokenizer()
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
        )
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3, out_channels=3, latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
            act_fn="silu", norm_num_groups=4, scaling_factor=0.476986, spatial_compression_ratio=8,
            temporal_compression_ratio=4, mid_block_add_attention=True,
        )
        text_encoder = LlamaModel(LlamaConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, hidden_size=16, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, vocab_size=len(tokenizer), hidden_act="gelu"))
        text_encoder_2 = CLIPTextModel(CLIPTextConfig(
            bos_token_id=tokenizer_2.bos_token_id, eos_token_id=tokenizer_2.eos_token_id,
            pad_token_id=tokenizer_2.pad_token_id, hidden_size=8, intermediate_size=37, num_attention_heads=4,
            num_hidden_layers=2, vocab_size=len(tokenizer_2), hidden_act="gelu", projection_dim=32))
        scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)  # hunyuanvideo-community/HunyuanVideo's
        return dict(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae, scheduler=scheduler,
                    text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2)
