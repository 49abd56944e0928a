"""MiniMax H3 (MiniMax, audio + video): Qwen3-VL conditioner (hidden state 50), a video VAE of ImageNet-normalised
pixels (17n+5 frames -> 5n+2 latent frames, x16 space, 24 channels), a mono audio VAE (32 kHz, 40 latents/s, stereo
as two channels) and one DiT over a single packed sequence [text | audio | video] (no cross-attention).
What is particular to it, and why: docs/families.md, "MiniMax H3 (audio + video)"."""

from __future__ import annotations

import math
import re
from functools import cached_property
from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.caption_table import mask_rows
from vt.shared.errors import UserError
from vt.shared.models.flow import Prediction, flow_inputs, flow_match_noisy
from vt.shared.models.minimax_h3_layout import (
    TextTokenTypes,
    normalise_pixels,
    packed_layout,
    pipeline_constants,
    unpatchify,
)
from vt.shared.models.minimax_h3_sound import STEREO, MiniMaxH3Sound
from vt.shared.models.plans import ContextParallelPlan
from vt.shared.models.roles import SoundStream
from vt.shared.models.spec import ModelSpec, VaeGeometry
from vt.shared.weights import comfy

TEXT_LAYER = 50  # MiniMaxH3ModularPipeline.text_encoder_layer
# The joint blocks and the text refiner's, whose modules are named alike: (diffusers name, original name) templates.
STACKS = (("transformer_blocks.{}", "blocks.{}"), ("token_refiner.refiner_blocks.{}", "token_refiner.blocks.{}"))
SWIGLU_INPUTS = r"(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.ff\.net\.0\.proj"


class MiniMaxH3Spec(ModelSpec):
    family: ClassVar[str] = "minimax-h3"
    example_hub_id: ClassVar[str] = "MiniMaxAI/MiniMax-H3"
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}
    single_frame: ClassVar[bool] = False  # frames 17n+5
    sound_stream: ClassVar[type[SoundStream]] = MiniMaxH3Sound
    default_lora_targets: ClassVar[list[str]] = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"]
    # The original checkpoint's module names, which ComfyUI's MiniMaxH3Model (comfy/ldm/minimax/model.py) has and
    # diffusers' own H3 LoRA reader converts back (`_convert_non_diffusers_minimax_h3_lora_to_diffusers`): q/k/v
    # fused into `qkv_proj` ([q; k; v]), `fc1` holding SwiGLU's halves as [gate; value] (`comfy_tensors`).
    original_names: ClassVar[tuple[tuple[str, str], ...]] = comfy.templated(
        [
            *(
                (f"{block}.{name}", f"{original}.{renamed}")
                for block, original in STACKS
                for name, renamed in (
                    ("attn.to_out.0", "attn.out_proj"),
                    ("ff.net.0.proj", "mlp.fc1"),
                    ("ff.net.2", "mlp.fc2"),
                )
            ),
            ("transformer_blocks.{}.adaln_proj.linear", "blocks.{}.adaln_proj.linear"),
            ("proj_in", "video_patch_proj"),
            ("audio_proj_in", "audio_patch_proj"),
            ("context_embedder", "condition_proj"),
            ("proj_out", "final_layer.video_out"),
            ("audio_proj_out", "final_layer.audio_out"),
            ("norm_out.linear", "final_layer.adaln_proj.linear"),
            ("time_embedder.linear_1", "time_embedder.proj_in"),
            ("time_embedder.linear_2", "time_embedder.proj_out"),
        ]
    )
    comfy_fused: ClassVar[tuple[comfy.Fused, ...]] = comfy.fused_templates(
        [(f"{block}.attn", ("to_q", "to_k", "to_v"), f"{original}.attn.qkv_proj") for block, original in STACKS]
    )
    comfy_alpha: ClassVar[bool] = False  # published H3 LoRAs carry none; the scale goes into lora_B
    components: ClassVar[dict[str, str]] = {  # no `processor`: `TextTokenTypes` stands in for it
        "text_encoder": "transformers:Qwen3VLForConditionalGeneration",
        "vae": "diffusers:AutoencoderKLMiniMaxH3",
        "audio_vae": "diffusers:AutoencoderKLMiniMaxH3Audio",
        "audio_scheduler": "diffusers:MiniMaxH3Scheduler",
        "transformer": "diffusers:MiniMaxH3Transformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = {"t2v": "vt.shared.models.minimax_h3_pipeline:MiniMaxH3Pipeline"}

    def __init__(self, config, frame_rate: float):
        super().__init__(config, frame_rate)
        fps = pipeline_constants().MINIMAX_H3_FPS
        if config.audio and frame_rate != fps:
            raise UserError(
                f"model.audio with {self.family} needs buckets.fps = {fps}: its audio and video rows share "
                f"one rotary clock at {fps} fps (40 audio latents per second), got {frame_rate:g}"
            )

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self._vae_without_weights()
        patch = tuple(self.load_config("transformer").get("patch_size", (1, 2, 2)))
        if patch[0] != 1 or patch[1] != patch[2]:
            raise UserError(f"MiniMax H3 transformers with patch_size {patch} are not supported; expected (1, p, p)")
        self._chunk = (vae.config.clip_length, vae.tokens_chunk_size)
        return VaeGeometry(
            temporal=vae.temporal_compression_ratio,
            spatial=vae.spatial_compression_ratio,
            channels=vae.config.latent_channels,
            patch=patch[1],
        )

    @property
    def frame_chunk(self) -> tuple[int, int]:
        """(pixel frames per VAE chunk, latent frames it keeps): 17n+5 frames encode to 5n+2 latent frames."""
        _ = self.geometry  # read with the VAE's config
        return self._chunk

    def check_bucket(self, bucket: Bucket) -> None:
        chunk, kept = self.frame_chunk
        if bucket.frames % chunk != kept:
            raise UserError(
                f"bucket {bucket.name}: {self.family} frames must be {chunk}k+{kept} (e.g. {kept} or "
                f"{chunk + kept}; the pipeline generates 5 to 15 s at 24 fps, e.g. 124); change "
                "buckets.sizes"
            )
        pixels = self.geometry.spatial * self.geometry.patch
        for side, value in (("height", bucket.height), ("width", bucket.width)):
            if value % pixels:
                raise UserError(
                    f"bucket {bucket.name}: {self.family} {side} must be a multiple of {pixels}; change "
                    f"buckets.sizes (e.g. {max(pixels, value // pixels * pixels)})"
                )

    def latent_shape(self, bucket: Bucket) -> tuple[int, ...]:
        channels, _, height, width = super().latent_shape(bucket)
        chunk, kept = self.frame_chunk
        return channels, (bucket.frames - kept) // chunk * kept + 2, height, width

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """Each caption encoded alone as MiniMaxH3TextEncoderStep encodes a prompt: max_text_tokens rows at most."""
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds

        text_encoder = encoders["text_encoder"]
        embeds = torch.zeros(len(captions), self.max_text_tokens, text_encoder.config.text_config.hidden_size)
        mask = torch.zeros(len(captions), self.max_text_tokens)
        for row, caption in enumerate(captions):
            ids = encoders["tokenizer"](caption, add_special_tokens=False)["input_ids"][: self.max_text_tokens]
            if not ids:  # an empty caption (caption dropout): no text rows
                continue
            hidden = get_qwen3vl_prompt_embeds(
                text_encoder,
                TextTokenTypes(),
                ids,
                {},
                text_encoder_layer=TEXT_LAYER,
                device=text_encoder.device,
                dtype=torch.float32,
            )
            embeds[row, : len(ids)] = hidden[0].cpu()
            mask[row, : len(ids)] = 1
        return {"prompt_embeds": embeds, "prompt_attention_mask": mask}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Latents normalised as the pipeline's decode step denormalises them, of pixels as its VAE takes them."""
        self._check_video(video)
        vae = encoders["vae"]
        pixels = normalise_pixels(video.to(vae.device, torch.float32))
        latents = vae.encode(pixels.to(vae.dtype)).latent_dist.mode().float()
        mean, std = (
            torch.tensor(vae.config[k], device=latents.device).view(1, -1, 1, 1, 1)
            for k in ("latents_mean", "latents_std")
        )
        return {"latents": ((latents - mean) / std).cpu()}

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """One transformer call per sample over its packed sequence; targets x0 - noise (the data-ward velocity)."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3SetTimestepsStep,
            patchify_video_latents,
        )

        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        audio = "audio_latents" in batch
        # the audio rows' sigma: paired with the video's by the two schedules, or its own (model.audio_timesteps)
        audio_sigmas = batch["audio_sigmas"].to(sigmas) if "audio_sigmas" in batch else self.audio_sigmas(sigmas)
        frames = 0
        if audio:
            audio_x0 = batch["audio_latents"].float().to(x0.device)
            audio_noise = batch["audio_noise"].to(audio_x0)
            audio_noisy = flow_match_noisy(audio_x0, audio_noise, audio_sigmas)
            frames = audio_x0.shape[-1]
        rows = mask_rows(batch["prompt_attention_mask"])
        patch = (1, self.geometry.patch, self.geometry.patch)
        video_out, audio_out = [], []
        for b in range(x0.shape[0]):
            position_ids, token_tags, video_indices, audio_indices, text_indices = (
                t.to(x0.device) for t in packed_layout(rows[b], x0.shape[1:], frames, patch)
            )
            video_rows = patchify_video_latents(noisy[b : b + 1], patch)
            audio_rows = (
                audio_noisy[b].permute(0, 2, 1).reshape(-1, audio_noisy.shape[2])
                if audio
                else x0.new_zeros(0, transformer.config.audio_in_channels)
            )
            # t = 1 - sigma per row (text rows at the video's), as the pipeline's set-timesteps step reduces them
            timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                video_indices.cpu(),
                audio_indices.cpu(),
                0,
                0,
                rows[b],
                float(1 - sigmas[b]),
                float(1 - audio_sigmas[b]),
                0.0,
                0.0,
            )
            video, sound = transformer(
                hidden_states=video_rows[None],
                audio_hidden_states=audio_rows[None],
                encoder_hidden_states=batch["prompt_embeds"][b : b + 1, : rows[b]].to(x0.device),
                timestep=timestep.to(x0.device),
                timestep_indices=timestep_indices.to(x0.device),
                token_tags=token_tags,
                position_ids=position_ids,
                video_indices=video_indices,
                audio_indices=audio_indices,
                text_indices=text_indices,
                return_dict=False,
            )
            video_out.append(unpatchify(video[0].float(), x0.shape[1:], patch))
            if audio:
                audio_out.append(sound[0].float().reshape(STEREO, frames, -1).permute(0, 2, 1))
        out = Prediction(prediction=torch.stack(video_out), target=x0 - noise, weight=None)
        if audio:
            out.audio = Prediction(prediction=torch.stack(audio_out), target=audio_x0 - audio_noise, weight=None)
        return out

    @cached_property
    def schedule_shifts(self) -> tuple[float, float]:
        """(video, audio) shifts of the pipeline's two schedulers (12 and 3 in the release)."""
        return float(self.load_config("scheduler")["shift"]), float(self.load_config("audio_scheduler")["shift"])

    def audio_sigmas(self, sigmas: Tensor) -> Tensor:
        """The audio rows' sigma for each video sigma: the audio schedule's value at the same point of the base grid
        (`sigma' = s b / (1 + (s - 1) b)` with each scheduler's shift), the pair every step of the pipeline feeds."""
        video, audio = self.schedule_shifts
        base = sigmas / (video - (video - 1) * sigmas)
        return audio * base / (1 + (audio - 1) * base)

    def comfy_tensors(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        """SwiGLU's lora_B halves in the original order: diffusers' [value; gate], the checkpoint's [gate; value]."""
        swiglu = re.compile(SWIGLU_INPUTS + r"\.lora_B\.weight")
        return {
            key: torch.cat(value.chunk(2)[::-1]) if swiglu.fullmatch(key) else value for key, value in tensors.items()
        }

    def cp_plan(self) -> ContextParallelPlan:
        """Ulysses over the packed rows, split at the first block with each block's AdaLN row indices, gathered after
        the last; chunks one row apart where cp does not divide the sequence (docs/parallel.md, `minimax-h3`)."""
        layers = int(self.load_config("transformer")["num_layers"])
        split = {f"transformer_blocks.{index}": {"adaln_indices": 0} for index in range(layers)}
        split["transformer_blocks.0"] = {"hidden_states": 1, "adaln_indices": 0}
        return ContextParallelPlan(
            split_inputs=split,
            gather_output=f"transformer_blocks.{layers - 1}",
            self_attention=("attn",),
            sequence_to_heads=("to_q", "to_k", "to_v"),
            uneven=True,
        )

    def pipeline_inputs(
        self, prompt: str, bucket: Bucket, steps: int, seed: int, image=None, last_image=None, control=None
    ) -> dict[str, Any]:
        """`num_frames`: the bucket's, or for a shorter bucket (which the pipeline refuses) its shortest video: 5 s at
        24 fps, 124 frames."""
        kwargs = super().pipeline_inputs(prompt, bucket, steps, seed, image, last_image, control)
        h3 = pipeline_constants()
        shortest = math.ceil(h3.MiniMaxH3ModularPipeline.min_duration.fget(None) * h3.MINIMAX_H3_FPS)
        return {**kwargs, "num_frames": h3.align_num_frames(max(bucket.frames, shortest), *self.frame_chunk)}

    def pipeline_conditions(self, pipeline, conditions: dict[str, Tensor]) -> dict[str, Tensor]:
        """The prompt's conditions only: the checkpoint is guidance-distilled (no negative prompt, one pass a step)."""
        return {name: value for name, value in conditions.items() if not name.startswith("negative_")}
