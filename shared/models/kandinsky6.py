"""Kandinsky 6 (Kandinsky Lab, text- and image-to-video with sound): Kandinsky 5's text encoders and VAE, MMAudio's
mel VAE and vocoder, a DiT of per-stream text blocks then fused video/audio blocks (docs/families.md, "Kandinsky 6")."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, flow_match_noisy, input_dtype
from vt.shared.models.hunyuan_video import PooledTextAndFirstFrame
from vt.shared.models.kandinsky5 import NEGATIVE_PROMPT
from vt.shared.models.kandinsky5_conditions import caption_lengths, channel_last, image_latents
from vt.shared.models.kandinsky6_sound import Kandinsky6Sound
from vt.shared.models.lora import lora_weight_name
from vt.shared.models.roles import SoundStream
from vt.shared.models.spec import ModelSpec, VaeGeometry

TAIL_TOKEN_TYPE = 1  # the appended image frame's token type (the pipeline's `visual_token_type_ids`)
_FUSED, _TEXT = r"visual_transformer_blocks\.(\d+)", r"(video|audio)_text_transformer_blocks\.(\d+)"
_HALF = rf"{_FUSED}\.(video|audio)_dec_block"  # a fused block's per-stream half


class Kandinsky6Spec(PooledTextAndFirstFrame, ModelSpec):
    family: ClassVar[str] = "kandinsky6"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    example_hub_id: ClassVar[str] = "kandinskylab/Kandinsky-6.0-Lite-5s-Diffusers"
    block_lists: ClassVar[tuple[str, ...]] = (
        "video_text_transformer_blocks",
        "audio_text_transformer_blocks",
        "visual_transformer_blocks",
    )
    pipeline_refusal: ClassVar[str] = (
        "its fused blocks take the video and audio tokens and, beside them, both text streams' output, so the last "
        "text block's output is not the next block's input, which is what a pipeline stage hands on"
    )
    negative_prompt: ClassVar[str] = NEGATIVE_PROMPT  # Kandinsky6TI2VAPipeline._DEFAULT_NEGATIVE_PROMPT
    sound_stream: ClassVar[type[SoundStream]] = Kandinsky6Sound
    # Every attention's q/k/v and output (the text blocks' `attn`, the fused blocks' self- and cross-attentions).
    default_lora_targets: ClassVar[list[str]] = [
        "to_query",
        "to_key",
        "to_value",
        "attn.out_layer",
        "self_attention.out_layer",
        "cross_attention.out_layer",
        "va_cross_attention.out_layer",
        "av_cross_attention.out_layer",
    ]
    excluded_modules_named: ClassVar[str] = "the audio stream (a video-only run: model.audio = false)"
    # ComfyUI's Kandinsky6 model (comfy/ldm/kandinsky6/model.py) keeps the original checkpoint's names.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        (rf"{_HALF}\.feed_forward\.net\.0\.proj", r"visual_blocks.\1.\2T.feed_forward.in_layer"),
        (rf"{_HALF}\.feed_forward\.net\.2", r"visual_blocks.\1.\2T.feed_forward.out_layer"),
        (rf"{_HALF}\.(.+)", r"visual_blocks.\1.\2T.\3"),
        (rf"{_FUSED}\.((?:va|av)_.+)", r"visual_blocks.\1.\2"),
        (rf"{_TEXT}\.attn\.(.+)", r"\1_text_transformer_blocks.\2.self_attention.\3"),
        (rf"{_TEXT}\.feed_forward\.net\.0\.proj", r"\1_text_transformer_blocks.\2.feed_forward.in_layer"),
        (rf"{_TEXT}\.feed_forward\.net\.2", r"\1_text_transformer_blocks.\2.feed_forward.out_layer"),
        (rf"{_TEXT}\.(text_modulation\..+)", r"\1_text_transformer_blocks.\2.\3"),
    )
    comfy_alpha: ClassVar[bool] = False  # the scale goes into lora_B
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:Qwen2_5_VLForConditionalGeneration",
        "text_encoder_2": "transformers:CLIPTextModel",
        "vae": "diffusers:AutoencoderKLHunyuanVideo",
        "audio_vae": "diffusers:MMAudioVAE",
        "vocoder": "diffusers:MMAudioVocoder",
        "transformer": "diffusers:Kandinsky6Transformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = dict.fromkeys(("t2v", "i2v"), "diffusers:Kandinsky6TI2VAPipeline")

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        patch = tuple(transformer.get("patch_size", (1, 2, 2)))
        if patch[0] != 1 or patch[1] != patch[2]:
            raise UserError(f"Kandinsky 6 transformers with patch_size {patch} are not supported; expected (1, p, p)")
        if transformer.get("in_visual_dim") != vae["latent_channels"]:
            raise UserError(
                f"the Kandinsky 6 transformer takes {transformer.get('in_visual_dim')} latent channels, "
                f"the VAE makes {vae['latent_channels']}: check model.components"
            )
        if self.frame_conditions and not transformer.get("visual_token_type_num_embeddings"):
            raise UserError(
                f'model.task = "i2v" needs a Kandinsky 6 transformer with image conditioning (token '
                f"types for the appended image frame); the one at {self.source('transformer')[0]!r} has "
                'none: use an image-to-video checkpoint or model.task = "t2v"'
            )
        return VaeGeometry(
            temporal=vae.get("temporal_compression_ratio", 4),
            channels=vae["latent_channels"],
            spatial=vae.get("spatial_compression_ratio", 8),
            patch=patch[1],
        )

    def lora_exclusions(self, transformer) -> str | None:
        return None if self.config.audio else rf".*(?:{self.sound.parameters}).*"

    def pipeline_parts(self) -> list[str]:
        parts = super().pipeline_parts()
        return parts if self.config.audio else [p for p in parts if p not in ("audio_vae", "vocoder")]

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """The pipeline's own `_get_prompt_embeds` at L = max_text_tokens (its padding, its mask)."""
        text_encoder = encoders["text_encoder"]
        embeds, pooled, mask = self.pipeline_class()._get_prompt_embeds(
            list(captions),
            encoders["tokenizer"],
            text_encoder,
            encoders["tokenizer_2"],
            encoders["text_encoder_2"],
            self.max_text_tokens,
            text_encoder.device,
        )
        mask = torch.ones(embeds.shape[:2], device=embeds.device) if mask is None else mask.float()
        return {
            "prompt_embeds": embeds.float() * mask[..., None],
            "prompt_attention_mask": mask,
            "pooled_prompt_embeds": pooled.float(),
        }

    @torch.no_grad()
    def encode_validation_text(self, encoders, prompt: str) -> dict[str, Tensor]:
        """The prompt's own rows (1, n, D) and its pooled embedding (the pipeline's call takes no mask)."""
        stored = self.encode_text(encoders, [prompt])
        rows = caption_lengths(stored["prompt_attention_mask"])[0]
        return {
            "prompt_embeds": stored["prompt_embeds"][:, :rows],
            "pooled_prompt_embeds": stored["pooled_prompt_embeds"],
        }

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """The pipeline's transformer call, i2v's image a clean tail frame, the text cut to the longest caption."""
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype, device = input_dtype(transformer), x0.device
        i2v, frames = bool(self.frame_conditions), x0.shape[2]
        video = torch.cat([noisy, image_latents(batch, self.frame_conditions).to(noisy)], dim=2) if i2v else noisy
        hidden = channel_last(transformer, video, -1 if i2v else None).to(dtype)
        rows = max(caption_lengths(batch["prompt_attention_mask"]))
        kwargs = dict(
            encoder_hidden_states=batch["prompt_embeds"][:, :rows].to(device, dtype),
            encoder_attention_mask=batch["prompt_attention_mask"][:, :rows].to(device).bool(),
            pooled_projections=batch["pooled_prompt_embeds"].to(device, dtype),
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,
            return_dict=False,
        )
        if i2v:  # the tail frame at temporal RoPE position 0, with its own token type
            patch = self.geometry.patch
            kwargs["visual_rope_pos"] = (
                torch.arange(frames + 1, device=device) % frames,
                *(torch.arange(n // patch, device=device) for n in hidden.shape[2:4]),
            )
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
            audio = out[1].permute(0, 2, 1).float()
            result.audio = Prediction(prediction=audio, target=audio_noise - audio_x0, weight=None)
        return result

    def load_lora(self, pipeline, folder, weight_name: str | None = None, expert: str | None = None) -> None:
        """The pipeline has no LoRA loader: the transformer's own `load_lora_adapter` reads the diffusers file."""
        pipeline.transformer.load_lora_adapter(
            str(folder), weight_name=weight_name or lora_weight_name(expert), prefix="transformer"
        )

    def inference_settings(self) -> dict[str, Any]:
        return {**super().inference_settings(), "frame_rate": self.frame_rate}  # the audio length follows it

    def pipeline_inputs(
        self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None, last_image=None, control=None
    ) -> dict[str, Any]:
        return {
            **super().pipeline_inputs(prompt, bucket, steps, seed, image, last_image, control),
            "sample_audio": self.config.audio,
        }
