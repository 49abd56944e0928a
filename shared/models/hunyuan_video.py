"""HunyuanVideo (Tencent, text- and image-to-video): Llama (I2V: Llava) + CLIP text encoders, causal video VAE, a DiT
of double- then single-stream blocks, a guidance embedding. Particulars and why: docs/families.md, "HunyuanVideo"."""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, FlowRecipe, Prediction, flow_inputs, input_dtype
from vt.shared.models.pipeline import frames_to_pil, to_pil_image
from vt.shared.models.plans import ContextParallelPlan, Unplanned
from vt.shared.models.roles import TextWithImage
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.weights import comfy

# The template for a tokenizer that lacks the Llama-3 chat header tokens: the bare caption, nothing cropped.
BARE_TEMPLATE: dict[str, Any] = {"template": "{}", "crop_start": 0}
REFINER = r".*context_embedder\.token_refiner\..*"  # never LoRA-targeted (peft exclude_modules)
# I2V: the image tokens the pipeline keeps, every n-th, by the transformer's image_condition_type (its __call__).
IMAGE_EMBED_INTERLEAVE = {"latent_concat": 2, "token_replace": 4}
# The Llama-3 chat tokens HunyuanVideoImageToVideoPipeline's template and prompt crop rely on, then Llava's image token.
LLAVA_CHAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>")
# A double block's diffusers modules -> the original (Tencent) ones ComfyUI loads (1.5's too); `{}` the block index.
DOUBLE_BLOCK_NAMES: tuple[tuple[str, str], ...] = tuple(
    (f"transformer_blocks.{{}}.{ours}", f"double_blocks.{{}}.{theirs}")
    for ours, theirs in (
        ("attn.to_out.0", "img_attn_proj"),
        ("attn.to_add_out", "txt_attn_proj"),
        ("ff.net.0.proj", "img_mlp.fc1"),
        ("ff.net.2", "img_mlp.fc2"),
        ("ff_context.net.0.proj", "txt_mlp.fc1"),
        ("ff_context.net.2", "txt_mlp.fc2"),
    )
)
# Each stream's q/k/v: one module in ComfyUI's model (comfy/ldm/flux/layers.py DoubleStreamBlock `img_attn.qkv`).
DOUBLE_BLOCK_QKV: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("transformer_blocks.{}.attn", ("to_q", "to_k", "to_v"), "double_blocks.{}.img_attn_qkv"),
    ("transformer_blocks.{}.attn", ("add_q_proj", "add_k_proj", "add_v_proj"), "double_blocks.{}.txt_attn_qkv"),
)
# Every block's attention is joint over [video, text] (1.5's too): the video tokens split, the text whole on each rank.
JOINT_CP_PLAN = ContextParallelPlan(
    split_inputs={"transformer_blocks.0": {"hidden_states": 1}},
    gather_output="proj_out",
    self_attention=("attn",),
    sequence_to_heads=("to_q", "to_k", "to_v"),
    replicated_to_heads=("add_q_proj", "add_k_proj", "add_v_proj"),
    replicated_from_heads="to_add_out",
)


class PooledTextAndFirstFrame:
    """Mixed in before ModelSpec (HunyuanVideo, Kandinsky 5 and 6): a masked text and CLIP's pooled one and, for i2v,
    `image_latents` (B, C, 1, H, W), the first frame encoded alone (the VAE's group norms span all frames)."""

    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae")
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # rows past it are padding

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = {**super().condition_shapes(bucket), "pooled_prompt_embeds": (self.text_width("text_encoder_2"),)}
        if self.frame_conditions:
            shapes["image_latents"] = self.frame_conditions.frame_shape(shapes["latents"])
        return shapes

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        out = super().encode_video(encoders, video)
        if self.frame_conditions:
            vae = encoders["vae"]
            out["image_latents"] = (
                self.vae_mode(vae, self.frame_conditions.first(video)) * vae.config.scaling_factor
            ).float()
        return out


class HunyuanVideoSpec(PooledTextAndFirstFrame, ModelSpec):
    family: ClassVar[str] = "hunyuan-video"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")
    example_hub_id: ClassVar[str] = "hunyuanvideo-community/HunyuanVideo"
    # Tencent-Hunyuan/HunyuanVideo-I2V's LoRA training (the authors' only published recipe for this family):
    # logit-normal ("lognorm") timesteps at flow shift 7, an unweighted velocity loss (docs/families.md).
    flow_recipe: ClassVar[FlowRecipe] = FlowRecipe("logit_normal", 7.0, "none")
    original_names: ClassVar[tuple[tuple[str, str], ...]] = comfy.templated(
        (*DOUBLE_BLOCK_NAMES, ("single_transformer_blocks.{}.proj_out", "single_blocks.{}.linear2"))
    )
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = comfy.fused_templates(
        (
            *DOUBLE_BLOCK_QKV,
            (
                "single_transformer_blocks.{}",
                ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
                "single_blocks.{}.linear1",
            ),
        )
    )
    excluded_modules_named: ClassVar[str] = "the text token refiner"
    comfy_alpha: ClassVar[bool] = False  # diffusers' HunyuanVideo conversion fails on `.alpha`
    exclusions_in_metadata: ClassVar[bool] = False  # diffusers' loader targets the file's keys: never the refiner
    # The guidance scale the transformer is trained at (fed as guidance * 1000); None: the pipeline's default.
    train_guidance: ClassVar[float | None] = 1.0
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:LlamaModel",
        "text_encoder_2": "transformers:CLIPTextModel",
        "vae": "diffusers:AutoencoderKLHunyuanVideo",
        "transformer": "diffusers:HunyuanVideoTransformer3DModel",
    }
    # I2V: the Llava text encoder (Llama-3 with a CLIP vision tower) and its image processor.
    task_components: ClassVar[dict[str, dict[str, str]]] = {
        "i2v": {
            "text_encoder": "transformers:LlavaForConditionalGeneration",
            "image_processor": "transformers:CLIPImageProcessor",
        }
    }
    pipelines: ClassVar[dict[str, str]] = {
        "t2v": "diffusers:HunyuanVideoPipeline",
        "i2v": "diffusers:HunyuanVideoImageToVideoPipeline",
    }

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise UserError(
                f"HunyuanVideo transformers with patch_size_t {transformer['patch_size_t']} are not "
                "supported; expected 1"
            )
        self._check_task_fits(transformer, vae["latent_channels"])
        return VaeGeometry(
            temporal=vae.get("temporal_compression_ratio", 4),
            channels=vae["latent_channels"],
            spatial=vae.get("spatial_compression_ratio", 8),
            patch=transformer.get("patch_size", 2),
        )

    def _check_task_fits(self, transformer: dict, channels: int) -> None:
        """i2v needs an I2V transformer (`image_condition_type`, with its input channels), t2v one without."""
        kind, found = transformer.get("image_condition_type"), transformer.get("in_channels")
        where = self.source("transformer")[0]
        if not self.frame_conditions and kind is not None:
            raise UserError(
                f"the transformer at {where!r} is an image-to-video one (image_condition_type "
                f'{kind!r}): set model.task = "i2v"'
            )
        expected = {"latent_concat": 2 * channels + 1, "token_replace": channels}
        if self.frame_conditions and (kind not in expected or found != expected[kind]):
            raise UserError(
                f'model.task = "i2v" needs a HunyuanVideo image-to-video transformer (image_condition_type '
                f'"token_replace" with {channels} input channels, hunyuanvideo-community/HunyuanVideo-I2V, or '
                f'"latent_concat" with {2 * channels + 1}, hunyuanvideo-community/HunyuanVideo-I2V-33ch); the one '
                f"at {where!r} has image_condition_type {kind!r} and in_channels {found}"
            )

    @cached_property
    def prompt_template(self) -> dict[str, Any]:
        """The pipeline's Llama-3 chat template if the tokenizer has its header tokens, else the bare caption."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        if self.frame_conditions:
            return self._i2v_template()
        tokenizer = self.load_component("tokenizer")
        known = LLAVA_CHAT_TOKENS[0] in {**tokenizer.get_vocab(), **getattr(tokenizer, "added_tokens_encoder", {})}
        return DEFAULT_PROMPT_TEMPLATE if known else BARE_TEMPLATE

    def _i2v_template(self) -> dict[str, Any]:
        """The I2V pipeline's template, its positions measured as the pipeline's were for another vision tower."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_image2video import DEFAULT_PROMPT_TEMPLATE

        tokenizer, config = self.load_component("tokenizer"), self.load_config("text_encoder")
        vocab = {**tokenizer.get_vocab(), **getattr(tokenizer, "added_tokens_encoder", {})}
        missing = [token for token in LLAVA_CHAT_TOKENS[:3] if token not in vocab]
        if missing:
            raise UserError(
                f"HunyuanVideo I2V's prompt crop needs the Llava tokenizer's Llama-3 chat tokens; the "
                f"tokenizer at {self.source('tokenizer')[0]!r} lacks {missing}: use the checkpoint's"
            )
        vision = config.vision_config
        length = (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")
        if length == DEFAULT_PROMPT_TEMPLATE["image_emb_len"]:
            return DEFAULT_PROMPT_TEMPLATE
        prefix = tokenizer(DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]).input_ids
        if config.image_token_index not in prefix:
            raise UserError(
                f"the tokenizer at {self.source('tokenizer')[0]!r} does not make `<image>` the text "
                f"encoder's image token ({config.image_token_index}); use the checkpoint's tokenizer"
            )
        start = prefix.index(config.image_token_index)
        return {
            **DEFAULT_PROMPT_TEMPLATE,
            "crop_start": len(prefix),
            "image_emb_start": start,
            "image_emb_end": start + length,
            "image_emb_len": length,
        }

    @property
    def image_embed_interleave(self) -> int:
        return IMAGE_EMBED_INTERLEAVE[self.load_config("transformer")["image_condition_type"]]

    @property
    def guidance(self) -> float:
        """The guidance scale fed to the guidance embedding in training (`train_guidance`)."""
        scale = self.train_guidance
        return scale if scale is not None else float(self.pipeline_default("guidance_scale"))

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """Llama's text, mask and CLIP's pooled text; i2v CLIP's only (Llava's reads the frame: `text_with_image`)."""
        if self.frame_conditions:
            pooled = self._text_pipeline(encoders)._get_clip_prompt_embeds(
                list(captions), device=encoders["text_encoder_2"].device
            )
            return {"pooled_prompt_embeds": pooled.float()}
        embeds, pooled, mask = self._encode_prompt(encoders, captions, prompt_template=self.prompt_template)
        return {
            "prompt_embeds": embeds.float(),
            "prompt_attention_mask": mask.float(),
            "pooled_prompt_embeds": pooled.float(),
        }

    @property
    def text_with_image(self) -> TextWithImage | None:
        return TextWithImage(self._llava_texts, self._llava_text) if self.frame_conditions else None

    def _llava_texts(self, encoders, captions: list[str], images: Tensor) -> dict[str, Tensor]:
        """Each caption with its first frame (uint8 as decoded), one at a time."""
        parts = [self._llava_text(encoders, caption, image) for caption, image in zip(captions, frames_to_pil(images))]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    @torch.no_grad()
    def _llava_text(self, encoders, caption: str, image) -> dict[str, Tensor]:
        """The I2V pipeline's `_get_llama_prompt_embeds`: the kept image tokens, then the cropped caption."""
        embeds, mask = self._text_pipeline(encoders)._get_llama_prompt_embeds(
            to_pil_image(image),
            [caption],
            self.prompt_template,
            device=encoders["text_encoder"].device,
            max_sequence_length=self.max_text_tokens,
            image_embed_interleave=self.image_embed_interleave,
        )
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float()}

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """i2v: Llava's text, the kept image tokens then the caption."""
        shapes = super().condition_shapes(bucket)
        if self.frame_conditions:
            image_tokens = -(-self.prompt_template["image_emb_len"] // self.image_embed_interleave)
            length = image_tokens + self.max_text_tokens - 4  # the crop drops the 4 assistant-header tokens
            shapes.update(prompt_embeds=(length, self.text_width()), prompt_attention_mask=(length,))
        return shapes

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        guidance = (
            torch.full((x0.shape[0],), self.guidance * 1000.0, device=x0.device, dtype=dtype)
            if transformer.config.guidance_embeds
            else None
        )  # as the pipeline: (B,) in the transformer's dtype
        noisy, weight = self._image_condition(transformer, batch, noisy) if self.frame_conditions else (noisy, None)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,  # float32, as the pipeline passes it
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            encoder_attention_mask=batch["prompt_attention_mask"].to(x0.device, dtype),
            guidance=guidance,
            pooled_projections=batch["pooled_prompt_embeds"].to(x0.device, dtype),
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)

    def _image_condition(self, transformer, batch: dict[str, Tensor], noisy: Tensor) -> tuple[Tensor, Tensor | None]:
        """(transformer input, loss weight) as the I2V pipeline conditions on its image (docs/families.md)."""
        what = "batch['image_latents'] and the Llava text of each sample"
        self.frame_conditions.require(batch, "image_latents", "prompt_attention_mask", what=what)
        image = batch["image_latents"].to(noisy)
        if transformer.config.image_condition_type == "token_replace":
            weight = torch.ones(noisy.shape[0], 1, noisy.shape[2], 1, 1, device=noisy.device)
            weight[:, :, 0] = 0.0
            return torch.cat([image, noisy[:, :, 1:]], dim=2), weight
        condition = torch.cat([image, torch.zeros_like(noisy[:, :, 1:])], dim=2)
        mask = torch.zeros_like(noisy[:, :1])
        mask[:, :, 0] = 1.0
        return torch.cat([noisy, condition, mask], dim=1), None

    def cp_plan(self) -> ContextParallelPlan:
        if self.frame_conditions and self.load_config("transformer")["image_condition_type"] == "token_replace":
            raise Unplanned(
                "hunyuan-video i2v (token_replace) has no CP plan: its blocks treat the first frame's "
                "tokens apart, which context parallel would split; set parallel.cp = 1"
            )
        return JOINT_CP_PLAN

    def lora_exclusions(self, transformer) -> str:
        return REFINER

    def inference_settings(self) -> dict[str, Any]:
        """The text length, and the prompt template where it is not the pipeline's (tiny tokenizers)."""
        settings = super().inference_settings()
        if self.prompt_template != self.pipeline_default("prompt_template"):
            settings["prompt_template"] = dict(self.prompt_template)
        return settings
