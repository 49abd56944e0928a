"""Kandinsky 6 (Kandinsky Lab, text- and image-to-video with sound; Lite 3B and Pro 29B differ in config only):
Qwen2.5-VL + CLIP text encoders, HunyuanVideo's causal VAE (x4 time, x8 space), MMAudio's mel VAE and BigVGAN
vocoder (44.1 kHz mono), and a DiT of text blocks per stream then fused video/audio blocks (each stream
cross-attends to its text, then to the other stream), patch (1, 2, 2), channel-last latents.

What is particular to it, and why: docs/families.md, "Kandinsky 6".
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, flow_match_noisy, input_dtype
from vt.shared.models.kandinsky5_conditions import caption_lengths, pooled_and_image_shapes, with_image_latents
from vt.shared.models.kandinsky6_sound import Kandinsky6Sound
from vt.shared.models.lora import lora_weight_name
from vt.shared.models.roles import SoundStream
from vt.shared.models.spec import ModelSpec, VaeGeometry

NEGATIVE_PROMPT = ("Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, ugly, "
                   "deformed, walking backwards")  # Kandinsky6TI2VAPipeline._DEFAULT_NEGATIVE_PROMPT
TAIL_TOKEN_TYPE = 1  # the appended image frame's token type (the pipeline's `visual_token_type_ids`)
_FUSED, _TEXT = r"visual_transformer_blocks\.(\d+)", r"(video|audio)_text_transformer_blocks\.(\d+)"


class Kandinsky6Spec(ModelSpec):
    family: ClassVar[str] = "kandinsky6"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    example_hub_id: ClassVar[str] = "kandinskylab/Kandinsky-6.0-Lite-5s-Diffusers"
    # Each stream's text blocks run first, then the fused blocks: FSDP keeps the last fused block gathered.
    block_lists: ClassVar[tuple[str, ...]] = ("video_text_transformer_blocks", "audio_text_transformer_blocks",
                                              "visual_transformer_blocks")
    pipeline_refusal: ClassVar[str] = (
        "its fused blocks take the video and audio tokens and, beside them, both text streams' output, so the last "
        "text block's output is not the next block's input, which is what a pipeline stage hands on")
    stage1_base: ClassVar[tuple[str, ...]] = ("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae")
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}
    negative_prompt: ClassVar[str] = NEGATIVE_PROMPT
    sound_stream: ClassVar[type[SoundStream]] = Kandinsky6Sound
    # Every attention's q/k/v and output (the text blocks' `attn`, the fused blocks' self- and cross-attentions);
    # the audio stream's are left out of a video-only run by `lora_exclusions`.
    default_lora_targets: ClassVar[list[str]] = [
        "to_query", "to_key", "to_value", "attn.out_layer", "self_attention.out_layer", "cross_attention.out_layer",
        "va_cross_attention.out_layer", "av_cross_attention.out_layer"]
    excluded_modules_named: ClassVar[str] = "the audio stream (a video-only run: model.audio = false)"
    # ComfyUI's Kandinsky6 model (comfy/ldm/kandinsky6/model.py) keeps the original checkpoint's names: fused blocks
    # `visual_blocks.N` with per-stream halves `videoT` / `audioT`, text blocks built from Kandinsky 5's (their
    # attention `self_attention`), FFNs `in_layer` / `out_layer`; its LoRA loader reads `diffusion_model.<name>`.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        (rf"{_FUSED}\.(video|audio)_dec_block\.feed_forward\.net\.0\.proj", r"visual_blocks.\1.\2T.feed_forward.in_layer"),
        (rf"{_FUSED}\.(video|audio)_dec_block\.feed_forward\.net\.2", r"visual_blocks.\1.\2T.feed_forward.out_layer"),
        (rf"{_FUSED}\.(video|audio)_dec_block\.(.+)", r"visual_blocks.\1.\2T.\3"),
        (rf"{_FUSED}\.((?:va|av)_.+)", r"visual_blocks.\1.\2"),
        (rf"{_TEXT}\.attn\.(.+)", r"\1_text_transformer_blocks.\2.self_attention.\3"),
        (rf"{_TEXT}\.feed_forward\.net\.0\.proj", r"\1_text_transformer_blocks.\2.feed_forward.in_layer"),
        (rf"{_TEXT}\.feed_forward\.net\.2", r"\1_text_transformer_blocks.\2.feed_forward.out_layer"),
        (rf"{_TEXT}\.(text_modulation\..+)", r"\1_text_transformer_blocks.\2.\3"),
    )
    comfy_alpha: ClassVar[bool] = False  # the scale goes into lora_B
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration", "text_encoder_2": "transformers:CLIPTextModel",
        "vae": "diffusers:AutoencoderKLHunyuanVideo", "audio_vae": "diffusers:MMAudioVAE",
        "vocoder": "diffusers:MMAudioVocoder", "transformer": "diffusers:Kandinsky6Transformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:Kandinsky6TI2VAPipeline",
                                           "i2v": "diffusers:Kandinsky6TI2VAPipeline"}

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        patch = tuple(transformer.get("patch_size", (1, 2, 2)))
        if patch[0] != 1 or patch[1] != patch[2]:
            raise UserError(f"Kandinsky 6 transformers with patch_size {patch} are not supported; expected (1, p, p)")
        if transformer.get("in_visual_dim") != vae["latent_channels"]:
            raise UserError(f"the Kandinsky 6 transformer takes {transformer.get('in_visual_dim')} latent channels, "
                             f"the VAE makes {vae['latent_channels']}: check model.components")
        if self.config.task == "i2v" and not transformer.get("visual_token_type_num_embeddings"):
            raise UserError(f"model.task = \"i2v\" needs a Kandinsky 6 transformer with image conditioning (token types "
                             f"for the appended image frame); the one at {self.source('transformer')[0]!r} has none: "
                             "use an image-to-video checkpoint or model.task = \"t2v\"")
        return VaeGeometry(temporal=vae.get("temporal_compression_ratio", 4),
                           spatial=vae.get("spatial_compression_ratio", 8), channels=vae["latent_channels"],
                           patch=patch[1])

    def lora_exclusions(self, transformer) -> str | None:
        """The sound stream's modules (`Kandinsky6Sound.parameters`) in a video-only run (it never trains there)."""
        return None if self.config.audio else rf".*(?:{self.sound.parameters}).*"

    def pipeline_parts(self) -> list[str]:
        """As the base; a video-only run leaves the audio VAE and vocoder out (the pipeline samples no sound)."""
        parts = super().pipeline_parts()
        return parts if self.config.audio else [p for p in parts if p not in ("audio_vae", "vocoder")]

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """float32 {"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L), "pooled_prompt_embeds": (B, P)}:
        the pipeline's own `_get_prompt_embeds` at L = max_text_tokens (its padding, its mask)."""
        text_encoder = encoders["text_encoder"]
        embeds, pooled, mask = self.pipeline_class()._get_prompt_embeds(
            list(captions), encoders["tokenizer"], text_encoder, encoders["tokenizer_2"], encoders["text_encoder_2"],
            self.max_text_tokens, text_encoder.device)
        mask = torch.ones(embeds.shape[:2], device=embeds.device) if mask is None else mask.float()
        return {"prompt_embeds": embeds.float() * mask[..., None], "prompt_attention_mask": mask,
                "pooled_prompt_embeds": pooled.float()}

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        return pooled_and_image_shapes(self, super().condition_shapes(bucket))

    @torch.no_grad()
    def encode_validation_text(self, encoders, prompt: str) -> dict[str, Tensor]:
        """The prompt's own rows (1, n, D) and its pooled embedding: what the pipeline's mask leaves of its padded
        encoding (its call takes no mask for given embeddings)."""
        stored = self.encode_text(encoders, [prompt])
        rows = caption_lengths(stored["prompt_attention_mask"])[0]
        return {"prompt_embeds": stored["prompt_embeds"][:, :rows],
                "pooled_prompt_embeds": stored["pooled_prompt_embeds"]}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """{"latents": mode x scaling_factor}; i2v adds `image_latents`, the first frame encoded alone."""
        return with_image_latents(self, encoders, video, super().encode_video(encoders, video))

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """The pipeline's transformer call (docs/families.md, Kandinsky 6): channel-last video with its condition
        channels (i2v: the clean image as a tail frame), the padded text cut to the batch's longest caption with its
        mask, and with `model.audio` the noised audio at the same sigma; predictions as (B, C, F, H, W) / (B, C, N)."""
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype, device = input_dtype(transformer), x0.device
        i2v = self.config.task == "i2v"
        frames = x0.shape[2]
        video = noisy
        if i2v:
            if "image_latents" not in batch:
                raise KeyError("task i2v needs batch['image_latents']; precompute the shards with model.task = \"i2v\"")
            video = torch.cat([noisy, batch["image_latents"].to(noisy)], dim=2)
        hidden = self._visual_input(transformer, video, tail=i2v).to(dtype)
        rows = max(caption_lengths(batch["prompt_attention_mask"]))
        kwargs = dict(encoder_hidden_states=batch["prompt_embeds"][:, :rows].to(device, dtype),
                      encoder_attention_mask=batch["prompt_attention_mask"][:, :rows].to(device).bool(),
                      pooled_projections=batch["pooled_prompt_embeds"].to(device, dtype),
                      timestep=sigmas * NUM_TRAIN_TIMESTEPS, return_dict=False)
        if i2v:
            g = self.geometry
            _, _, height, width, _ = hidden.shape
            kwargs["visual_rope_pos"] = (torch.cat([torch.arange(frames, device=device), torch.zeros(1, dtype=torch.long,
                                                                                                      device=device)]),
                                         torch.arange(height // g.patch, device=device),
                                         torch.arange(width // g.patch, device=device))
            types = torch.zeros(x0.shape[0], frames + 1, dtype=torch.long, device=device)
            types[:, -1] = TAIL_TOKEN_TYPE
            kwargs["visual_token_type_ids"] = types
        if self.config.audio:
            audio_x0 = batch["audio_latents"].float().to(device)
            audio_noise = batch["audio_noise"].to(audio_x0)
            kwargs["audio_hidden_states"] = flow_match_noisy(audio_x0, audio_noise, sigmas).permute(0, 2, 1).to(dtype)
        out = transformer(hidden_states=hidden, **kwargs)
        prediction = out[0][:, :frames].permute(0, 4, 1, 2, 3).float()
        result = Prediction(prediction=prediction, target=noise - x0, weight=None)
        if self.config.audio:
            result.audio = Prediction(prediction=out[1].permute(0, 2, 1).float(), target=audio_noise - audio_x0,
                                      weight=None)
        return result

    @staticmethod
    def _visual_input(transformer, latents: Tensor, tail: bool) -> Tensor:
        """(B, C, F, H, W) -> the pipeline's channel-last input; with `visual_cond` [latents, zeros, mask], the mask
        1 on the appended image frame (`tail`) and 0 elsewhere."""
        latents = latents.permute(0, 2, 3, 4, 1)
        if not transformer.config.visual_cond:
            return latents
        mask = latents.new_zeros(*latents.shape[:-1], 1)
        if tail:
            mask[:, -1] = 1.0
        return torch.cat([latents, torch.zeros_like(latents), mask], dim=-1)

    # ----------------------------------------------------------------------------- export
    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """Kandinsky6TI2VAPipeline has no LoRA loader: the transformer's own (`load_lora_adapter`) reads the file's
        `transformer.` keys and its adapter metadata."""
        pipeline.transformer.load_lora_adapter(str(folder), weight_name=weight_name or lora_weight_name(expert),
                                               prefix="transformer")

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """The audio length follows the frame rate: sample at the rate frames were sampled at."""
        return {**super().inference_settings(), "frame_rate": self.frame_rate}

    def pipeline_inputs(self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None,
                        last_image=None, control=None) -> dict[str, Any]:
        """As the base, sampling sound only where the run trains it."""
        return {**super().pipeline_inputs(prompt, bucket, steps, seed, image, last_image, control),
                "sample_audio": self.config.audio}
