"""HunyuanVideo (Tencent, text- and image-to-video): Llama (I2V: Llava) + CLIP text encoders, causal video
VAE (x4 time, x8 space), a DiT of double-stream then single-stream blocks with a guidance embedding.

What is particular to it, and why: docs/families.md, "HunyuanVideo".
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models import comfy
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.pipeline import frames_to_pil, to_pil_image
from vt.shared.models.plans import ContextParallelPlan, Unplanned
from vt.shared.models.roles import TextWithImage
from vt.shared.models.spec import ModelSpec, VaeGeometry

# The template for a tokenizer that lacks the Llama-3 chat header tokens: the bare caption, nothing cropped.
BARE_TEMPLATE: dict[str, Any] = {"template": "{}", "crop_start": 0}
REFINER = r".*context_embedder\.token_refiner\..*"  # never LoRA-targeted (peft exclude_modules)
# I2V: the image tokens the pipeline keeps, every n-th, by the transformer's image_condition_type (its __call__).
IMAGE_EMBED_INTERLEAVE = {"latent_concat": 2, "token_replace": 4}
# The Llama-3 chat tokens HunyuanVideoImageToVideoPipeline's template and prompt crop rely on, then Llava's image token.
LLAVA_CHAT_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<image>")


class HunyuanVideoSpec(ModelSpec):
    family: ClassVar[str] = "hunyuan-video"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    # Double-stream blocks, then single-stream ones: every parallel strategy and checkpointing walks both.
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks", "single_transformer_blocks")
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # attention masks the rest
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

    # Both text encoders and the VAE; i2v adds its image parts (task_components).
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae")
    components: ClassVar[dict[str, str]] = {"text_encoder": "transformers:LlamaModel",
                                            "text_encoder_2": "transformers:CLIPTextModel",
                                            "vae": "diffusers:AutoencoderKLHunyuanVideo",
                                            "transformer": "diffusers:HunyuanVideoTransformer3DModel"}
    # I2V: the Llava text encoder (Llama-3 with a CLIP vision tower) and its image processor.
    task_components: ClassVar[dict[str, dict[str, str]]] = {
        "i2v": {"text_encoder": "transformers:LlavaForConditionalGeneration",
                "image_processor": "transformers:CLIPImageProcessor"}}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:HunyuanVideoPipeline",
                                           "i2v": "diffusers:HunyuanVideoImageToVideoPipeline"}


    def _geometry_from_config(self) -> VaeGeometry:
        vae = self.load_config("vae")
        transformer = self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise UserError(f"HunyuanVideo transformers with patch_size_t {transformer['patch_size_t']} are not "
                             "supported; expected 1")
        self._check_task_fits(transformer, vae["latent_channels"])
        return VaeGeometry(temporal=vae.get("temporal_compression_ratio", 4),
                           spatial=vae.get("spatial_compression_ratio", 8),
                           channels=vae["latent_channels"], patch=transformer.get("patch_size", 2))

    def _check_task_fits(self, transformer: dict, channels: int) -> None:
        """i2v needs an I2V transformer (`image_condition_type` latent_concat with 2C + 1 input channels, or
        token_replace with C), t2v one without."""
        kind, found = transformer.get("image_condition_type"), transformer.get("in_channels")
        where = self.source("transformer")[0]
        if self.config.task != "i2v":
            if kind is not None:
                raise UserError(f"the transformer at {where!r} is an image-to-video one (image_condition_type "
                                 f"{kind!r}): set model.task = \"i2v\"")
            return
        expected = {"latent_concat": 2 * channels + 1, "token_replace": channels}
        if kind not in expected or found != expected[kind]:
            raise UserError(
                f"model.task = \"i2v\" needs a HunyuanVideo image-to-video transformer (image_condition_type "
                f"\"token_replace\" with {channels} input channels, hunyuanvideo-community/HunyuanVideo-I2V, or "
                f"\"latent_concat\" with {2 * channels + 1}, hunyuanvideo-community/HunyuanVideo-I2V-33ch); the one "
                f"at {where!r} has image_condition_type {kind!r} and in_channels {found}")

    # ----------------------------------------------------------------------------- text
    @cached_property
    def prompt_template(self) -> dict[str, Any]:
        """The pipeline's Llama-3 chat template if the tokenizer has its header tokens, else the bare caption;
        i2v: the I2V pipeline's template with the image token's place measured (`_i2v_template`)."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        if self.config.task == "i2v":
            return self._i2v_template()
        tokenizer = self.load_component("tokenizer")
        header = "<|start_header_id|>"
        known = header in tokenizer.get_vocab() or header in getattr(tokenizer, "added_tokens_encoder", {})
        return DEFAULT_PROMPT_TEMPLATE if known else BARE_TEMPLATE

    def _i2v_template(self) -> dict[str, Any]:
        """HunyuanVideoImageToVideoPipeline's DEFAULT_PROMPT_TEMPLATE for the checkpoint's vision tower (576
        image tokens); for another (the tiny preset's) the same template with its positions measured as the
        pipeline's were: `<image>`'s index in the tokenized template, the vision tower's token count, the
        caption's first index (`crop_start`). The pipeline's crop finds the turns by the Llama-3 header tokens."""
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_image2video import DEFAULT_PROMPT_TEMPLATE

        tokenizer, config = self.load_component("tokenizer"), self.load_config("text_encoder")
        vocab = {**tokenizer.get_vocab(), **getattr(tokenizer, "added_tokens_encoder", {})}
        missing = [token for token in LLAVA_CHAT_TOKENS[:3] if token not in vocab]
        if missing:
            raise UserError(f"HunyuanVideo I2V's prompt crop needs the Llava tokenizer's Llama-3 chat tokens; the "
                             f"tokenizer at {self.source('tokenizer')[0]!r} lacks {missing}: use the checkpoint's")
        vision = config.vision_config
        length = (vision.image_size // vision.patch_size) ** 2 + (config.vision_feature_select_strategy == "full")
        if length == DEFAULT_PROMPT_TEMPLATE["image_emb_len"]:
            return DEFAULT_PROMPT_TEMPLATE
        prefix = tokenizer(DEFAULT_PROMPT_TEMPLATE["template"].split("{}")[0]).input_ids
        if config.image_token_index not in prefix:
            raise UserError(f"the tokenizer at {self.source('tokenizer')[0]!r} does not make `<image>` the text "
                             f"encoder's image token ({config.image_token_index}); use the checkpoint's tokenizer")
        start = prefix.index(config.image_token_index)
        return {**DEFAULT_PROMPT_TEMPLATE, "crop_start": len(prefix), "image_emb_start": start,
                "image_emb_end": start + length, "image_emb_len": length}

    @property
    def image_embed_interleave(self) -> int:
        """I2V: every n-th image token is kept (HunyuanVideoImageToVideoPipeline's rule for its transformer)."""
        return IMAGE_EMBED_INTERLEAVE[self.load_config("transformer")["image_condition_type"]]

    @property
    def guidance(self) -> float:
        """The guidance scale fed to the guidance embedding in training (`train_guidance`)."""
        if self.train_guidance is not None:
            return self.train_guidance
        return float(self.pipeline_default("guidance_scale"))

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L), "pooled_prompt_embeds": (B, P)},
        L = the spec's max_text_tokens, right padded. i2v: CLIP's pooled output only (the Llava text reads
        the first frame too: `text_with_image`)."""
        if self.config.task == "i2v":
            pooled = self._text_pipeline(encoders)._get_clip_prompt_embeds(list(captions),
                                                                           device=encoders["text_encoder_2"].device)
            return {"pooled_prompt_embeds": pooled.float()}
        embeds, pooled, mask = self._encode_prompt(encoders, captions, prompt_template=self.prompt_template)
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float(),
                "pooled_prompt_embeds": pooled.float()}

    @property
    def text_with_image(self) -> TextWithImage | None:
        """I2V: Llava reads each caption with the clip's first frame (its vision tokens inside the prompt)."""
        return TextWithImage(self._llava_texts, self._llava_validation_text) if self.config.task == "i2v" else None

    @torch.no_grad()
    def _llava_texts(self, encoders, captions: list[str], images: Tensor) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, N + L - 4, D), "prompt_attention_mask"}: the I2V pipeline's
        `_get_llama_prompt_embeds` of each caption with its frame (uint8 as decoded), one at a time: N kept
        image tokens, then the caption cropped out of the chat template (L = max_text_tokens), right padded."""
        parts = [self._llava_text(encoders, caption, image) for caption, image in zip(captions, frames_to_pil(images))]
        return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}

    @torch.no_grad()
    def _llava_validation_text(self, encoders, prompt: str, image) -> dict[str, Tensor]:
        """The pipeline's own Llava encoding of a validation prompt with its image (`prompt_embeds`, mask)."""
        return self._llava_text(encoders, prompt, to_pil_image(image))

    def _llava_text(self, encoders, caption: str, image) -> dict[str, Tensor]:
        embeds, mask = self._text_pipeline(encoders)._get_llama_prompt_embeds(
            image, [caption], self.prompt_template, device=encoders["text_encoder"].device,
            max_sequence_length=self.max_text_tokens, image_embed_interleave=self.image_embed_interleave)
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float()}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Latents = posterior mode x scaling_factor; i2v adds `image_latents` (B, C, 1, H, W), the first frame
        encoded alone, as the I2V pipeline's `prepare_latents` encodes its image."""
        out = super().encode_video(encoders, video)
        if self.config.task == "i2v":
            vae = encoders["vae"]
            out["image_latents"] = (self._vae_mode(vae, video[:, :, :1]) * vae.config.scaling_factor).float()
        return out

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """Llama's text and mask, and CLIP's pooled embedding; i2v: Llava's text (the kept image tokens, then
        the caption less the 4 assistant-header tokens the crop drops) and the first frame's latents."""
        shapes = {**super().condition_shapes(bucket), "pooled_prompt_embeds": (self.text_width("text_encoder_2"),)}
        if self.config.task == "i2v":
            image_tokens = -(-self.prompt_template["image_emb_len"] // self.image_embed_interleave)
            length = image_tokens + self.max_text_tokens - 4
            shapes.update(prompt_embeds=(length, self.text_width()), prompt_attention_mask=(length,),
                          image_latents=(shapes["latents"][0], 1, *shapes["latents"][2:]))
        return shapes

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        guidance = None
        if transformer.config.guidance_embeds:  # as the pipeline: (B,) in the transformer's dtype, scale * 1000
            guidance = torch.full((x0.shape[0],), self.guidance * 1000.0, device=x0.device, dtype=dtype)
        weight = None
        if self.config.task == "i2v":
            noisy, weight = self._image_condition(transformer, batch, noisy)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,  # float32, as the pipeline passes it
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            encoder_attention_mask=batch["prompt_attention_mask"].to(x0.device, dtype),
            pooled_projections=batch["pooled_prompt_embeds"].to(x0.device, dtype),
            guidance=guidance,
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)

    def _image_condition(self, transformer, batch: dict[str, Tensor], noisy: Tensor) -> tuple[Tensor, Tensor | None]:
        """(transformer input, loss weight) as the I2V pipeline conditions on its image: token_replace puts
        the clean image latent in place of the first latent frame (weight 0 there: the pipeline discards
        its prediction); latent_concat appends [image latent then zeros, mask 1 on the first frame] to the
        noisy latents on the channel axis (every frame trained)."""
        if "image_latents" not in batch or "prompt_attention_mask" not in batch:
            raise KeyError("task i2v needs batch['image_latents'] and the Llava text of each sample; precompute the "
                           "shards with model.task = \"i2v\"")
        image = batch["image_latents"].to(noisy)
        if transformer.config.image_condition_type == "token_replace":
            weight = torch.ones(noisy.shape[0], 1, noisy.shape[2], 1, 1, device=noisy.device)
            weight[:, :, 0] = 0.0
            return torch.cat([image, noisy[:, :, 1:]], dim=2), weight
        condition = torch.zeros_like(noisy)
        condition[:, :, :1] = image
        mask = torch.zeros_like(noisy[:, :1])
        mask[:, :, 0] = 1.0
        return torch.cat([noisy, condition, mask], dim=1), None

    def cp_plan(self) -> ContextParallelPlan:
        """Split the video tokens where the first double block receives them, gather after proj_out.

        Every attention is joint over [video, text] (the single blocks' processor joins them before q/k/v):
        the text stays whole on each rank, which keeps its heads' q/k/v and gathers its heads' output; the
        joint padding mask and the rotary tables are built for the whole sequence outside the blocks.
        i2v token_replace is refused: its blocks modulate the first `first_frame_num_tokens` tokens they
        hold as the clean frame, which under CP would be every rank's first tokens."""
        if self.config.task == "i2v" and self.load_config("transformer")["image_condition_type"] == "token_replace":
            raise Unplanned("hunyuan-video i2v (token_replace) has no CP plan: its blocks treat the first frame's "
                            "tokens apart, which context parallel would split; set parallel.cp = 1")
        return ContextParallelPlan(
            split_inputs={"transformer_blocks.0": {"hidden_states": 1}}, gather_output="proj_out",
            self_attention=("attn",), sequence_to_heads=("to_q", "to_k", "to_v"),
            replicated_to_heads=("add_q_proj", "add_k_proj", "add_v_proj"), replicated_from_heads="to_add_out")

    def lora_exclusions(self, transformer) -> str:
        """The text token refiner: its original q/k/v are one fused module ComfyUI's key table lacks."""
        return REFINER

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """The text length, and the prompt template where it is not the pipeline's (tiny tokenizers)."""
        settings = super().inference_settings()
        if self.prompt_template != self.pipeline_default("prompt_template"):
            settings["prompt_template"] = dict(self.prompt_template)
        return settings
