"""HunyuanVideo 1.5 (Tencent, text- and image-to-video): Qwen2.5-VL and ByT5 glyph text encoders, a causal video VAE,
a DiT of double-stream blocks. Particulars and why: docs/families.md, "HunyuanVideo 1.5"."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, FlowRecipe, Prediction, flow_inputs, input_dtype
from vt.shared.models.hunyuan_video import JOINT_CP_PLAN, REFINER
from vt.shared.models.hunyuan_video15_lora import FUSED_QKV, NAMES, load_lora
from vt.shared.models.lora import lora_weight_name
from vt.shared.models.pipeline import frames_to_pil, to_pil_image
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.roles import ImageConditions
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.weights import comfy

PIPELINE_TEXT_TOKENS = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length (set in its __init__)
PROMPT_TEMPLATE_TOKENS = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx: tokens cropped
IMAGE_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: zero image embeddings for t2v
GLYPH_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length: the quoted text's tokens


class HunyuanVideo15Spec(ModelSpec):
    family: ClassVar[str] = "hunyuan-video-1.5"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    example_hub_id: ClassVar[str] = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
    # Tencent-Hunyuan/HunyuanVideo-1.5's train.py: logit-normal ("lognorm") timesteps at its training shift 3 (it
    # samples validation at 5), an unweighted MSE (docs/families.md).
    flow_recipe: ClassVar[FlowRecipe] = FlowRecipe("logit_normal", 3.0, "none")
    original_names: ClassVar[tuple[tuple[str, str], ...]] = comfy.templated(NAMES)
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = comfy.fused_templates(FUSED_QKV)
    excluded_modules_named: ClassVar[str] = "the text token refiner"
    comfy_alpha: ClassVar[bool] = False  # the scale goes into lora_B: every loader then applies 1
    text_masks: ClassVar[dict[str, str]] = {
        "prompt_embeds": "prompt_attention_mask",
        "prompt_embeds_2": "prompt_attention_mask_2",
    }
    pipeline_text_names: ClassVar[dict[str, str]] = {
        "prompt_attention_mask": "prompt_embeds_mask",
        "prompt_attention_mask_2": "prompt_embeds_mask_2",
    }
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae")
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:Qwen2_5_VLTextModel",
        "text_encoder_2": "transformers:T5EncoderModel",
        "vae": "diffusers:AutoencoderKLHunyuanVideo15",
        "transformer": "diffusers:HunyuanVideo15Transformer3DModel",
        "guider": "diffusers:ClassifierFreeGuidance",
    }
    # i2v adds the SigLIP image encoder and its processor (FLUX.1-Redux's, in the i2v checkpoints).
    task_components: ClassVar[dict[str, dict[str, str]]] = {
        "i2v": {
            "image_encoder": "transformers:SiglipVisionModel",
            "feature_extractor": "transformers:SiglipImageProcessor",
        }
    }
    pipelines: ClassVar[dict[str, str]] = {
        "t2v": "diffusers:HunyuanVideo15Pipeline",
        "i2v": "diffusers:HunyuanVideo15ImageToVideoPipeline",
    }

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise UserError(
                f"HunyuanVideo 1.5 transformers with patch_size_t {transformer['patch_size_t']} are not "
                "supported; expected 1"
            )
        if transformer.get("use_meanflow"):
            raise UserError(
                "this HunyuanVideo 1.5 transformer is a step-distilled (meanflow) one (use_meanflow): it "
                "is trained on pairs of timesteps, which vt does not do; use the 480p/720p i2v or t2v "
                "checkpoints (e.g. hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v)"
            )
        if transformer.get("in_channels") != 2 * vae["latent_channels"] + 1:
            raise UserError(
                f"the HunyuanVideo 1.5 transformer takes {transformer.get('in_channels')} channels, "
                f"expected 2 x {vae['latent_channels']} latent channels + 1 mask: check model.components"
            )
        return VaeGeometry(
            temporal=vae.get("temporal_compression_ratio", 4),
            channels=vae["latent_channels"],
            spatial=vae.get("spatial_compression_ratio", 16),
            patch=transformer.get("patch_size", 1),
        )

    def pipeline_default(self, argument: str) -> Any:
        """Also the text length the pipeline encodes (an attribute, not a call argument)."""
        return PIPELINE_TEXT_TOKENS if argument == "max_sequence_length" else super().pipeline_default(argument)

    def _text_pipeline(self, encoders: dict[str, Any]):
        pipeline = super()._text_pipeline(encoders)
        pipeline.tokenizer_max_length = self.max_text_tokens
        return pipeline

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = {
            **super().condition_shapes(bucket),
            "prompt_embeds_2": (GLYPH_TOKENS, self.text_width("text_encoder_2")),
            "prompt_attention_mask_2": (GLYPH_TOKENS,),
        }
        if self.frame_conditions:
            vision = self.load_config("image_encoder")  # SigLIP: one token per patch, no class token
            shapes["image_latents"] = self.frame_conditions.frame_shape(shapes["latents"])
            shapes["image_embeds"] = ((vision.image_size // vision.patch_size) ** 2, vision.hidden_size)
        return shapes

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """Qwen's text and ByT5's (GLYPH_TOKENS rows), each with its mask, right padded."""
        embeds, mask, embeds_2, mask_2 = self._text_pipeline(encoders).encode_prompt(
            list(captions), device=encoders["text_encoder"].device, dtype=torch.float32, batch_size=len(captions)
        )
        return {
            "prompt_embeds": embeds.float(),
            "prompt_attention_mask": mask.float(),
            "prompt_embeds_2": embeds_2.float(),
            "prompt_attention_mask_2": mask_2.float(),
        }

    @staticmethod
    def vae_mode(vae, video: Tensor) -> Tensor:
        # One sample at a time: the VAE's mid-block attention fails for a batch > 1 (diffusers 0.42.1).
        return torch.cat([ModelSpec.vae_mode(vae, video[i : i + 1]) for i in range(video.shape[0])])

    @torch.no_grad()
    def encode_video(self, encoders: dict[str, Any], video: Tensor) -> dict[str, Tensor]:
        """i2v adds the first frame encoded alone (`_get_image_latents`) and its SigLIP tokens (`_get_image_embeds`)."""
        out = super().encode_video(encoders, video)
        if self.frame_conditions:
            vae = encoders["vae"]
            out["image_latents"] = (
                self.vae_mode(vae, self.frame_conditions.first(video)) * vae.config.scaling_factor
            ).float()
            out["image_embeds"] = _siglip(encoders, frames_to_pil(video[:, :, 0]))
        return out

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """The pipeline's call, less the tokens its masks drop (zero image tokens, text padding): the same output."""
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        condition, image_embeds = self._image_condition(transformer, batch, x0)
        text, mask = _trim(batch["prompt_embeds"], batch["prompt_attention_mask"])
        text_2, mask_2 = _trim(batch["prompt_embeds_2"], batch["prompt_attention_mask_2"])
        prediction = transformer(
            hidden_states=torch.cat([noisy, condition], dim=1).to(dtype),
            timestep=(sigmas * NUM_TRAIN_TIMESTEPS).to(dtype),  # as the pipeline: in the latents' dtype
            encoder_hidden_states=text.to(x0.device, dtype),
            encoder_attention_mask=mask.to(x0.device, dtype),
            encoder_hidden_states_2=text_2.to(x0.device, dtype),
            encoder_attention_mask_2=mask_2.to(x0.device, dtype),
            image_embeds=image_embeds.to(x0.device, dtype),
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=None)

    def _image_condition(self, transformer, batch: dict[str, Tensor], x0: Tensor) -> tuple[Tensor, Tensor]:
        """(condition channels (B, C + 1, F, H, W), image tokens) as the pipeline makes them (t2v: zeros, none)."""
        b, c, f, h, w = x0.shape
        if not self.frame_conditions:
            return (
                torch.zeros(b, c + 1, f, h, w, device=x0.device),
                torch.zeros(b, 0, transformer.config.image_embed_dim, device=x0.device),
            )
        self.frame_conditions.require(batch, "image_latents", "image_embeds")
        latents = torch.cat([batch["image_latents"].to(x0), torch.zeros_like(x0[:, :, 1:])], dim=2)
        mask = torch.zeros(b, 1, f, h, w, device=x0.device)
        mask[:, :, 0] = 1.0
        return torch.cat([latents, mask], dim=1), batch["image_embeds"]

    def lora_exclusions(self, transformer) -> str:
        return f"(?:{REFINER})|(?:{dead_modules(transformer)})"

    def full_trainable(self, transformer) -> None:
        dead = re.compile(dead_modules(transformer))
        for name, param in transformer.named_parameters():
            param.requires_grad_(not dead.fullmatch(name.rpartition(".")[0]))  # the parameter's module

    def tp_plan(self) -> TensorParallelPlan:
        return TensorParallelPlan(
            colwise=(
                "attn.to_q",
                "attn.to_k",
                "attn.to_v",
                "attn.add_q_proj",
                "attn.add_k_proj",
                "attn.add_v_proj",
                "ff.net.0.proj",
                "ff_context.net.0.proj",
            ),
            rowwise=("attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2"),
            attention=("attn",),
        )

    def cp_plan(self) -> ContextParallelPlan:
        return JOINT_CP_PLAN  # the text streams (image, ByT5, Qwen) whole on every rank

    def inference_settings(self) -> dict[str, Any]:
        return {}  # the pipeline takes no text-length argument (build_pipeline sets its attribute instead)

    def pipeline_inputs(self, prompt, bucket, steps, seed, image=None, **kwargs) -> dict[str, Any]:
        """i2v: the pipeline takes no height or width; it sizes the video from the image (`output_size`)."""
        inputs = super().pipeline_inputs(prompt, bucket, steps, seed, image, **kwargs)
        if self.frame_conditions:
            del inputs["height"], inputs["width"]
        return inputs

    def output_size(self, image) -> tuple[int, int]:
        """(height, width) the i2v pipeline generates for `image`: the `target_size` crop size nearest its aspect."""
        image = to_pil_image(image)
        return self._frame_processor().calculate_default_height_width(
            image.size[1], image.size[0], self.load_config("transformer")["target_size"]
        )

    def _frame_processor(self):
        """The i2v pipeline's own image processor (its `video_processor`)."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        return HunyuanVideo15ImageProcessor(
            vae_scale_factor=self.geometry.spatial, do_resize=False, do_convert_rgb=True
        )

    @property
    def image_conditions(self) -> ImageConditions | None:
        return ImageConditions(self._validation_image_embeds) if self.frame_conditions else None

    @torch.no_grad()
    def _validation_image_embeds(self, encoders, image) -> dict[str, Tensor]:
        """The pipeline's `encode_image`: resized and cropped to `output_size` first, then SigLIP's tokens."""
        height, width = self.output_size(image)
        resized = self._frame_processor().resize(to_pil_image(image), height=height, width=width, resize_mode="crop")
        return {"image_embeds": _siglip(encoders, resized)}

    def pipeline_conditions(self, pipeline, conditions: dict[str, Tensor]) -> dict[str, Tensor]:
        """The pipeline takes no `image_embeds`: its `encode_image` hands it the stored tokens instead."""
        conditions = dict(conditions)
        embeds = conditions.pop("image_embeds", None)
        if embeds is not None:
            pipeline.encode_image = lambda image, batch_size, device, dtype: embeds.repeat(batch_size, 1, 1).to(
                device=device, dtype=dtype
            )
        return conditions

    def pipeline_attributes(self) -> dict[str, Any]:
        return {"tokenizer_max_length": self.max_text_tokens}  # the text length training used

    def inference_mismatches(self) -> list[str]:
        if self.max_text_tokens == PIPELINE_TEXT_TOKENS:
            return []
        return [
            f"{self.family} trains with max_sequence_length={self.max_text_tokens} but "
            f"{self.pipeline_class().__name__} uses {PIPELINE_TEXT_TOKENS} by default (its tokenizer_max_length): "
            f"set pipeline.tokenizer_max_length = {self.max_text_tokens} when sampling with the trained weights "
            "(only captions longer than that are cut differently)"
        ]

    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """diffusers has no LoRA loader for HunyuanVideo15Pipeline: vt's own `load_lora`."""
        load_lora(pipeline, Path(folder) / (weight_name or lora_weight_name(expert)))


def _siglip(encoders: dict[str, Any], images) -> Tensor:
    """float32 SigLIP last hidden states of `images` (PIL), by the i2v pipeline's `_get_image_embeds`."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline as I2V

    encoder = encoders["image_encoder"]
    return I2V._get_image_embeds(encoder, encoders["feature_extractor"], images, encoder.device).float()


def dead_modules(transformer) -> str:
    """Regex (matched whole) of the last block's text-stream output, which never reaches the loss (text dropped)."""
    last = transformer.config.num_layers - 1
    return rf"transformer_blocks\.{last}\.(?:attn\.to_add_out|ff_context(?:\..*)?)"


def _trim(embeds: Tensor, mask: Tensor, multiple: int = 64) -> tuple[Tensor, Tensor]:
    """`embeds` (B, L, D), `mask` (B, L) cut after the last unmasked row, rounded up to `multiple` (fewer compiles)."""
    kept = mask.flatten(1).ne(0).any(0).nonzero()
    length = 0 if kept.numel() == 0 else min(mask.shape[1], -(-(int(kept.max()) + 1) // multiple) * multiple)
    return embeds[:, :length], mask[:, :length]
