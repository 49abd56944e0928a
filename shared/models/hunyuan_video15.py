"""HunyuanVideo 1.5 (Tencent, text- and image-to-video): a Qwen2.5-VL text encoder plus a ByT5 glyph
encoder, a causal video VAE (32 channels, x4 time, x16 space), and a DiT of 54 double-stream blocks (patch 1).

What is particular to it, and why: docs/families.md, "HunyuanVideo 1.5".
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models import comfy
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.hunyuan_video15_lora import FUSED_QKV, NAMES, load_lora
from vt.shared.models.lora import lora_weight_name
from vt.shared.models.pipeline import frames_to_pil, to_pil_image
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.roles import ImageConditions
from vt.shared.models.spec import ModelSpec, VaeGeometry

PIPELINE_TEXT_TOKENS = 1000  # HunyuanVideo15Pipeline.tokenizer_max_length (set in its __init__)
PROMPT_TEMPLATE_TOKENS = 108  # HunyuanVideo15Pipeline.prompt_template_encode_start_idx: tokens cropped
IMAGE_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens: zero image embeddings for t2v
GLYPH_TOKENS = 256  # HunyuanVideo15Pipeline.tokenizer_2_max_length: the quoted text's tokens
IMAGE_PARTS = ("image_encoder", "feature_extractor")  # i2v: SigLIP and its processor (stage 1)
REFINER = r".*context_embedder\.token_refiner\..*"  # never LoRA-targeted (peft exclude_modules)

class HunyuanVideo15Spec(ModelSpec):
    family: ClassVar[str] = "hunyuan-video-1.5"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    example_hub_id: ClassVar[str] = "hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v"
    original_names: ClassVar[tuple[tuple[str, str], ...]] = comfy.templated(NAMES)
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = comfy.fused_templates(FUSED_QKV)
    excluded_modules_named: ClassVar[str] = "the text token refiner"
    comfy_alpha: ClassVar[bool] = False  # the scale goes into lora_B: every loader then applies 1
    # Both texts are masked in the joint attention: rows past a mask's last one need not be stored.
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask",
                                            "prompt_embeds_2": "prompt_attention_mask_2"}
    pipeline_text_names: ClassVar[dict[str, str]] = {"prompt_attention_mask": "prompt_embeds_mask",
                                                     "prompt_attention_mask_2": "prompt_embeds_mask_2"}

    # Both text encoders and the VAE; i2v adds its image parts (task_components).
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae")
    components: ClassVar[dict[str, str]] = {"text_encoder": "transformers:Qwen2_5_VLTextModel",
                                            "text_encoder_2": "transformers:T5EncoderModel",
                                            "vae": "diffusers:AutoencoderKLHunyuanVideo15",
                                            "transformer": "diffusers:HunyuanVideo15Transformer3DModel",
                                            "guider": "diffusers:ClassifierFreeGuidance"}
    # i2v adds the SigLIP image encoder and its processor (FLUX.1-Redux's, in the i2v checkpoints).
    task_components: ClassVar[dict[str, dict[str, str]]] = {
        "i2v": {"image_encoder": "transformers:SiglipVisionModel",
                "feature_extractor": "transformers:SiglipImageProcessor"}}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:HunyuanVideo15Pipeline",
                                           "i2v": "diffusers:HunyuanVideo15ImageToVideoPipeline"}


    def _geometry_from_config(self) -> VaeGeometry:
        vae = self.load_config("vae")
        transformer = self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise UserError(f"HunyuanVideo 1.5 transformers with patch_size_t {transformer['patch_size_t']} are not "
                             "supported; expected 1")
        if transformer.get("use_meanflow"):
            raise UserError("this HunyuanVideo 1.5 transformer is a step-distilled (meanflow) one (use_meanflow): it "
                             "is trained on pairs of timesteps, which vt does not do; use the 480p/720p i2v or t2v "
                             "checkpoints (e.g. hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_i2v)")
        if transformer.get("in_channels") != 2 * vae["latent_channels"] + 1:
            raise UserError(f"the HunyuanVideo 1.5 transformer takes {transformer.get('in_channels')} channels, "
                             f"expected 2 x {vae['latent_channels']} latent channels + 1 mask: check model.components")
        return VaeGeometry(temporal=vae.get("temporal_compression_ratio", 4),
                           spatial=vae.get("spatial_compression_ratio", 16),
                           channels=vae["latent_channels"], patch=transformer.get("patch_size", 1))

    # ----------------------------------------------------------------------------- text
    def pipeline_default(self, argument: str) -> Any:
        """As the base, plus the text length the pipeline encodes (an attribute, not a call argument)."""
        if argument == "max_sequence_length":
            return PIPELINE_TEXT_TOKENS
        return super().pipeline_default(argument)

    def _text_pipeline(self, encoders: dict[str, Any]):
        pipeline = super()._text_pipeline(encoders)
        pipeline.tokenizer_max_length = self.max_text_tokens
        return pipeline

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """Qwen's text and the glyph encoder's (the pipeline's fixed GLYPH_TOKENS), each with its mask; i2v
        adds the first frame's latents (one latent frame) and SigLIP tokens (one per patch, no class token)."""
        shapes = {**super().condition_shapes(bucket),
                  "prompt_embeds_2": (GLYPH_TOKENS, self.text_width("text_encoder_2")),
                  "prompt_attention_mask_2": (GLYPH_TOKENS,)}
        if self.config.task == "i2v":
            vision = self.load_config("image_encoder")
            shapes["image_latents"] = (shapes["latents"][0], 1, *shapes["latents"][2:])
            shapes["image_embeds"] = ((vision.image_size // vision.patch_size) ** 2, vision.hidden_size)
        return shapes

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L), "prompt_embeds_2": (B, 256, D2),
        "prompt_attention_mask_2": (B, 256)}, L = the spec's max_text_tokens, right padded."""
        pipeline = self._text_pipeline(encoders)
        embeds, mask, embeds_2, mask_2 = pipeline.encode_prompt(
            list(captions), device=encoders["text_encoder"].device, dtype=torch.float32, batch_size=len(captions))
        return {"prompt_embeds": embeds.float(), "prompt_attention_mask": mask.float(),
                "prompt_embeds_2": embeds_2.float(), "prompt_attention_mask_2": mask_2.float()}

    @torch.no_grad()
    def encode_video(self, encoders: dict[str, Any], video: Tensor) -> dict[str, Tensor]:
        """{"latents": posterior mode x scaling_factor}, one sample at a time: the VAE's mid-block attention
        builds its causal mask as (B, S, S) against (B, 1, S, S) queries, which fails for a batch > 1
        (diffusers 0.42.1). i2v adds what the pipeline makes of the first frame (`encode_first_frame`)."""
        self._check_video(video)
        out = {"latents": self._encode_latents(encoders["vae"], video)}
        if self.config.task == "i2v":
            out.update(self.encode_first_frame(encoders, video))
        return out

    def _encode_latents(self, vae, video: Tensor) -> Tensor:
        modes = [self._vae_mode(vae, video[i:i + 1]) for i in range(video.shape[0])]
        return (torch.cat(modes) * vae.config.scaling_factor).float()

    @torch.no_grad()
    def encode_first_frame(self, encoders: dict[str, Any], video: Tensor) -> dict[str, Tensor]:
        """The first frame (at the bucket's size, as the pipeline resizes its image) as the i2v pipeline conditions on
        it, float32: `image_latents` (B, C, 1, H, W), the frame VAE-encoded alone (`_get_image_latents`), and
        `image_embeds` (B, N, D), SigLIP's last hidden states of it as a uint8 image (`_get_image_embeds`)."""
        from diffusers import HunyuanVideo15ImageToVideoPipeline as I2V

        first = video[:, :, :1]
        encoder = encoders["image_encoder"]
        embeds = I2V._get_image_embeds(encoder, encoders["feature_extractor"], frames_to_pil(first[:, :, 0]),
                                       encoder.device)
        return {"image_latents": self._encode_latents(encoders["vae"], first), "image_embeds": embeds.float()}

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """The pipeline's text-to-video call, less the tokens its masks drop: the transformer moves masked
        tokens to the end of the joint sequence and masks them, so the 729 zero image tokens and the text
        padding past the batch's longest caption change no output (tests/shared/test_hunyuan_video15.py)
        and are not fed."""
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
        """(condition channels (B, C + 1, F, H, W), image tokens) as the pipeline feeds them: t2v zeros and no image
        tokens (its 729 zero ones are masked out); i2v the first frame's latents and a mask 1 on the first latent
        frame (`prepare_cond_latents_and_mask`) with its SigLIP tokens, every frame noisy and in the loss."""
        b, c, f, h, w = x0.shape
        if self.config.task != "i2v":
            return (torch.zeros(b, c + 1, f, h, w, device=x0.device),
                    torch.zeros(b, 0, transformer.config.image_embed_dim, device=x0.device))
        if "image_latents" not in batch or "image_embeds" not in batch:
            raise KeyError("task i2v needs batch['image_latents'] and batch['image_embeds']; precompute the shards "
                           "with model.task = \"i2v\"")
        latents = torch.zeros_like(x0)
        latents[:, :, :1] = batch["image_latents"].to(x0)
        mask = torch.zeros(b, 1, f, h, w, device=x0.device)
        mask[:, :, 0] = 1.0
        return torch.cat([latents, mask], dim=1), batch["image_embeds"]

    def lora_exclusions(self, transformer) -> str:
        """The text token refiner (its original q/k/v are one fused module) and what never reaches the
        loss (`dead_modules`)."""
        return f"(?:{REFINER})|(?:{dead_modules(transformer)})"

    def full_trainable(self, transformer) -> None:
        """Everything but the last block's text-stream output (`dead_modules`), which gets no gradient
        (DDP would otherwise wait for it)."""
        dead = re.compile(dead_modules(transformer))
        for name, param in transformer.named_parameters():
            param.requires_grad_(not dead.fullmatch(name.rpartition(".")[0]))  # the parameter's module

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> TensorParallelPlan:
        """Per double block: both streams' q/k/v and FFN inputs column-wise, their outputs row-wise; the padding mask
        is per token and the q/k norms and rotary tables span one head, so the joint attention runs on local heads."""
        return TensorParallelPlan(
            colwise=("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj",
                     "attn.add_v_proj", "ff.net.0.proj", "ff_context.net.0.proj"),
            rowwise=("attn.to_out.0", "attn.to_add_out", "ff.net.2", "ff_context.net.2"),
            attention=("attn",),
        )

    def cp_plan(self) -> ContextParallelPlan:
        """Split the video tokens at the first block, gather after proj_out; the text streams (image, ByT5, Qwen) stay
        whole on every rank, keeping their heads' q/k/v and gathering their heads' output."""
        return ContextParallelPlan(
            split_inputs={"transformer_blocks.0": {"hidden_states": 1}}, gather_output="proj_out",
            self_attention=("attn",), sequence_to_heads=("to_q", "to_k", "to_v"),
            replicated_to_heads=("add_q_proj", "add_k_proj", "add_v_proj"), replicated_from_heads="to_add_out")

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """Nothing: the pipeline takes no text-length argument (build_pipeline sets its attribute instead)."""
        return {}

    def pipeline_inputs(self, prompt, bucket, steps, seed, image=None, **kwargs) -> dict[str, Any]:
        """i2v: HunyuanVideo15ImageToVideoPipeline takes no height or width; it sizes the video from the
        image's aspect ratio and the transformer's `target_size` (`output_size`)."""
        inputs = super().pipeline_inputs(prompt, bucket, steps, seed, image, **kwargs)
        if self.config.task == "i2v":
            del inputs["height"], inputs["width"]
        return inputs

    def output_size(self, image) -> tuple[int, int]:
        """(height, width) HunyuanVideo15ImageToVideoPipeline generates for `image` (PIL or (H, W, 3) uint8):
        the crop-size bucket of the transformer's `target_size` nearest the image's aspect ratio."""
        image = to_pil_image(image)
        return self._frame_processor().calculate_default_height_width(image.size[1], image.size[0],
                                                                      self.load_config("transformer")["target_size"])

    def _frame_processor(self):
        """The pipeline's own image processor (HunyuanVideo15ImageToVideoPipeline.video_processor)."""
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        return HunyuanVideo15ImageProcessor(vae_scale_factor=self.geometry.spatial, do_resize=False,
                                            do_convert_rgb=True)

    @property
    def image_conditions(self) -> ImageConditions | None:
        """i2v: validation images need SigLIP's tokens, which stage 1 makes."""
        return ImageConditions(self._validation_image_embeds) if self.config.task == "i2v" else None

    @torch.no_grad()
    def _validation_image_embeds(self, encoders, image) -> dict[str, Tensor]:
        """The pipeline's `encode_image` of a validation image: resized and cropped to `output_size` as the
        pipeline does first, then SigLIP's last hidden states (`image_embeds`)."""
        from diffusers import HunyuanVideo15ImageToVideoPipeline as I2V

        height, width = self.output_size(image)
        resized = self._frame_processor().resize(to_pil_image(image), height=height, width=width, resize_mode="crop")
        encoder = encoders["image_encoder"]
        return {"image_embeds": I2V._get_image_embeds(encoder, encoders["feature_extractor"], resized,
                                                      encoder.device).float()}

    def pipeline_conditions(self, pipeline, conditions: dict[str, Tensor]) -> dict[str, Tensor]:
        """The pipeline has no `image_embeds` argument, and runs its image encoder (left out of validation's
        pipeline) on the image: this pipeline object's `encode_image` hands it the stored tokens instead."""
        conditions = dict(conditions)
        embeds = conditions.pop("image_embeds", None)
        if embeds is not None:
            pipeline.encode_image = lambda image, batch_size, device, dtype: \
                embeds.repeat(batch_size, 1, 1).to(device=device, dtype=dtype)
        return conditions

    def pipeline_attributes(self) -> dict[str, Any]:
        return {"tokenizer_max_length": self.max_text_tokens}  # the text length training used

    def inference_mismatches(self) -> list[str]:
        if self.max_text_tokens == PIPELINE_TEXT_TOKENS:
            return []
        return [f"{self.family} trains with max_sequence_length={self.max_text_tokens} but "
                f"{self.pipeline_class().__name__} uses {PIPELINE_TEXT_TOKENS} by default (its tokenizer_max_length): "
                f"set pipeline.tokenizer_max_length = {self.max_text_tokens} when sampling with the trained weights "
                "(only captions longer than that are cut differently)"]

    # ----------------------------------------------------------------------------- export
    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """diffusers has no LoRA loader for HunyuanVideo15Pipeline: vt's own `load_lora`."""
        load_lora(pipeline, Path(folder) / (weight_name or lora_weight_name(expert)))


def dead_modules(transformer) -> str:
    """Regex (matched whole) of the last double block's text-stream output, `attn.to_add_out` and the
    text FFN `ff_context`: the transformer drops the text tokens after that block, so they never reach
    the loss; LoRA leaves them out and a full fine-tune freezes them."""
    last = transformer.config.num_layers - 1
    return rf"transformer_blocks\.{last}\.(?:attn\.to_add_out|ff_context(?:\..*)?)"


def _trim(embeds: Tensor, mask: Tensor, multiple: int = 64) -> tuple[Tensor, Tensor]:
    """`embeds` (B, L, D) and `mask` (B, L) cut after the batch's last unmasked row, rounded up to a
    `multiple` (fewer distinct shapes for torch.compile); all rows go when the mask has none."""
    kept = mask.flatten(1).ne(0).any(0).nonzero()
    length = 0 if kept.numel() == 0 else min(mask.shape[1], -(-(int(kept.max()) + 1) // multiple) * multiple)
    return embeds[:, :length], mask[:, :length]
