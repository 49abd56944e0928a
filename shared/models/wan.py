"""Wan 2.1 (text-to-video): UMT5 text encoder, causal video VAE (x4 time, x8 space), DiT on (B, C, F, H, W).

What is particular to it, and why: docs/families.md, "Wan 2.1".
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from vt.shared.config import ModelConfig
from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_inputs, input_dtype
from vt.shared.models.pipeline import frames_to_pil, to_pil_image
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.roles import ImageConditions
from vt.shared.models.spec import ModelSpec, VaeGeometry

I2V_TEXT_TOKENS = 512  # diffusers' WanAttnProcessor with image projections: the text is the context's last 512
IMAGE_TASKS = ("i2v", "flf2v")  # the tasks that condition on the clip's own frames


def block_names(blocks: str) -> tuple[tuple[str, str], ...]:
    """(diffusers name regex, original name) of the attention and FFN Linears of the Wan blocks in list `blocks`."""
    return (
        *(
            (rf"{blocks}\.(\d+)\.{attn}\.{ours}", rf"{blocks}.\1.{theirs}.{short}")
            for attn, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
            for ours, short in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), (r"to_out\.0", "o"))
        ),
        (rf"{blocks}\.(\d+)\.ffn\.net\.0\.proj", rf"{blocks}.\1.ffn.0"),
        (rf"{blocks}\.(\d+)\.ffn\.net\.2", rf"{blocks}.\1.ffn.2"),
    )


class WanSpec(ModelSpec):
    family: ClassVar[str] = "wan"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v", "flf2v")
    block_lists: ClassVar[tuple[str, ...]] = ("blocks",)
    # Original (Wan-AI) module names, which ComfyUI uses; diffusers' Wan LoRA conversion reads them back.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        *block_names("blocks"),
        (r"blocks\.(\d+)\.attn2\.add_k_proj", r"blocks.\1.cross_attn.k_img"),
        (r"blocks\.(\d+)\.attn2\.add_v_proj", r"blocks.\1.cross_attn.v_img"),
    )
    example_hub_id: ClassVar[str] = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:UMT5EncoderModel",
        "vae": "diffusers:AutoencoderKLWan",
        "transformer": "diffusers:WanTransformer3DModel",
    }
    # Wan 2.1 i2v and flf2v add the CLIP image encoder and its processor (Wan 2.2's I2V models have none).
    task_components: ClassVar[dict[str, dict[str, str]]] = {
        task: {
            "image_encoder": "transformers:CLIPVisionModelWithProjection",
            "image_processor": "transformers:CLIPImageProcessor",
        }
        for task in IMAGE_TASKS
    }
    pipelines: ClassVar[dict[str, str]] = {
        "t2v": "diffusers:WanPipeline",
        "i2v": "diffusers:WanImageToVideoPipeline",
        "flf2v": "diffusers:WanImageToVideoPipeline",
    }
    # Wan 2.1 I2V also conditions on CLIP image embeddings; Wan 2.2's I2V models only on the encoded frame.
    clip_image_conditioning: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, frame_rate: float):
        super().__init__(config, frame_rate)
        if self.image_tokens and self.max_text_tokens != I2V_TEXT_TOKENS:
            raise UserError(
                f"model.max_text_tokens = {self.max_text_tokens}, but Wan image-to-video needs exactly "
                f"{I2V_TEXT_TOKENS}: its cross-attention (diffusers' WanAttnProcessor) takes every "
                f"context token before the last {I2V_TEXT_TOKENS} to be an image token. Unset "
                f"model.max_text_tokens or set it to {I2V_TEXT_TOKENS}"
            )

    @property
    def condition_frames(self) -> bool:
        """Whether the transformer takes [mask, encoded condition frames] beside the noisy latents (i2v, flf2v)."""
        return self.frame_conditions

    @property
    def image_tokens(self) -> bool:
        """Whether this run feeds CLIP image embeddings (Wan 2.1 i2v, flf2v) beside the encoded frames."""
        return self.frame_conditions and self.clip_image_conditioning

    @property
    def default_lora_targets(self) -> list[str]:  # type: ignore[override]
        """With image tokens also `add_k_proj`, `add_v_proj` (peft matches by suffix: `to_k` misses them)."""
        extra = ["add_k_proj", "add_v_proj"] if self.image_tokens else []
        return [*ModelSpec.default_lora_targets, *extra]

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self.load_config("transformer")
        patch = tuple(transformer.get("patch_size", (1, 2, 2)))
        if patch[0] != 1 or patch[1] != patch[2]:
            raise UserError(f"Wan transformer patch_size {patch} is not supported; expected (1, p, p)")
        geometry = VaeGeometry(
            temporal=vae.get("scale_factor_temporal") or 2 ** sum(vae["temperal_downsample"]),
            spatial=vae.get("scale_factor_spatial") or 2 ** len(vae["temperal_downsample"]),
            channels=vae["z_dim"],
            patch=patch[1],
        )
        self._check_task_fits(transformer, geometry)
        return geometry

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """The transformer is the task's: Wan 2.1 I2V, FLF2V, Wan 2.2 I2V or t2v (each refuses the others')."""
        where = self.source("transformer")[0]
        found = {key: transformer.get(key) for key in ("in_channels", "image_dim", "added_kv_proj_dim")}
        frames, positions = self.frame_conditions, transformer.get("pos_embed_seq_len")
        conditioned = 2 * g.channels + g.temporal  # latents, condition mask, condition latents
        if frames and not frames.last and not self.clip_image_conditioning:
            if found["in_channels"] != conditioned or found["image_dim"]:
                raise UserError(
                    f'model.task = "i2v" on {self.family} needs a Wan 2.2 image-to-video transformer '
                    f"(in_channels {conditioned}, no image_dim, e.g. Wan-AI/Wan2.2-I2V-A14B-Diffusers); "
                    f"the one at {where!r} has {found}"
                )
        elif frames:
            if found["in_channels"] != conditioned or not found["image_dim"] or not found["added_kv_proj_dim"]:
                example = "FLF2V-14B-720P-diffusers" if frames.last else "I2V-14B-480P-Diffusers"
                raise UserError(
                    f'model.task = "{frames.name}" needs a Wan 2.1 image-to-video transformer (in_channels '
                    f"{conditioned}, image_dim and added_kv_proj_dim set, e.g. Wan-AI/Wan2.1-{example}); "
                    f"the one at {where!r} has {found}"
                )
            if frames.last and positions != (wanted := 2 * self.image_embeds_shape()[0]):
                raise UserError(
                    f'model.task = "flf2v" needs a Wan 2.1 first-and-last-frame transformer '
                    f"(pos_embed_seq_len {wanted}: both images' {wanted // 2} CLIP tokens, e.g. "
                    f"Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers); the one at {where!r} has pos_embed_seq_len "
                    f"{positions}"
                )
            if not frames.last and positions:
                raise UserError(
                    f"the transformer at {where!r} is a first-and-last-frame one (pos_embed_seq_len "
                    f'{positions}): set model.task = "flf2v"'
                )
        elif found["image_dim"] or found["in_channels"] != g.channels:
            raise UserError(
                f"the transformer at {where!r} is an image-to-video one ({found}): "
                'set model.task = "i2v"' + (' (or "flf2v": it takes two images)' if positions else "")
            )

    def image_embeds_shape(self) -> tuple[int, int]:
        """(tokens, width) of one image's CLIP embeddings: its patches plus the class token, from the config."""
        vision = self.load_config("image_encoder")
        return (vision.image_size // vision.patch_size) ** 2 + 1, vision.hidden_size

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        embeds, _ = self._encode_prompt(encoders, captions, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds.float()}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Normalised latents of the posterior mode; i2v, flf2v add `encode_condition_frames`."""
        self._check_video(video)
        out = {"latents": _normalised(encoders["vae"], self.vae_mode(encoders["vae"], video))}
        if self.condition_frames:
            out.update(self.encode_condition_frames(encoders, video))
        return out

    @torch.no_grad()
    def encode_condition_frames(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """WanImageToVideoPipeline's conditions of the first (flf2v: and last) frame: `condition_latents` as
        `prepare_latents`; with image tokens `image_embeds` (B, N, D), flf2v (B, 2, N, D) as [first, last]."""
        vae = encoders["vae"]
        frames = self.frame_conditions.frames(video)
        zeros = video.new_zeros(*video.shape[:2], video.shape[2] - len(frames), *video.shape[3:])
        condition = torch.cat([frames[0], zeros, *frames[1:]], dim=2)
        latents = {"condition_latents": _normalised(vae, self.vae_mode(vae, condition).float())}
        if not self.image_tokens:
            return latents
        # The frames as the uint8 images they were decoded from, sample by sample: first, (last,) of sample 0 ...
        images = frames_to_pil(torch.stack([frame[:, :, 0] for frame in frames], dim=1).flatten(0, 1))
        hidden = self._image_hidden_states(encoders, images)
        return {"image_embeds": hidden.unflatten(0, (video.shape[0], 2)) if len(frames) == 2 else hidden, **latents}

    @staticmethod
    @torch.no_grad()
    def _image_hidden_states(encoders, images: list) -> Tensor:
        """WanImageToVideoPipeline.encode_image: the image encoder's second-to-last hidden states, (N, T, D) float32."""
        encoder = encoders["image_encoder"]
        inputs = encoders["image_processor"](images=images, return_tensors="pt")
        return (
            encoder(pixel_values=inputs["pixel_values"].to(encoder.device, encoder.dtype), output_hidden_states=True)
            .hidden_states[-2]
            .float()
        )

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = super().condition_shapes(bucket)
        if self.condition_frames:
            shapes["condition_latents"] = shapes["latents"]
        if self.image_tokens:
            shapes["image_embeds"] = ((2,) if self.frame_conditions.last else ()) + self.image_embeds_shape()
        return shapes

    @property
    def image_conditions(self) -> ImageConditions | None:
        """With image tokens: a validation image's `image_embeds` (1, N, D), as the pipeline's `encode_image`."""
        if not self.image_tokens:
            return None
        return ImageConditions(
            lambda encoders, image: {"image_embeds": self._image_hidden_states(encoders, [to_pil_image(image)])}
        )

    def pipeline_conditions(self, pipeline, conditions: dict[str, Tensor]) -> dict[str, Tensor]:
        """Stored image embeddings go in through this pipeline's `encode_image` (its call refuses them with `image`)."""
        conditions = dict(conditions)
        embeds = conditions.pop("image_embeds", None)
        last = conditions.pop("last_image_embeds", None)
        if embeds is not None:
            both = embeds if last is None else torch.cat([embeds, last])
            pipeline.encode_image = lambda image, device: both.to(device)
        return conditions

    def condition_mask(self, latents: Tensor) -> Tensor:
        """WanImageToVideoPipeline's mask (B, T, F, H, W), T the VAE's time compression: 1 on latent frame 0
        (the first pixel frame, T copies), flf2v also on the last slot of the last latent frame, else 0."""
        mask = latents.new_zeros(latents.shape[0], self.geometry.temporal, *latents.shape[2:])
        mask[:, :, 0] = 1
        if self.frame_conditions.last:
            mask[:, -1, -1] = 1
        return mask

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        image = {}
        if self.condition_frames:  # [noisy, mask, condition] and the image tokens, as the pipeline
            needed = ("condition_latents", "image_embeds") if self.image_tokens else ("condition_latents",)
            self.frame_conditions.require(batch, *needed)
            noisy = torch.cat([noisy, self.condition_mask(x0), batch["condition_latents"].to(x0)], dim=1)
            if self.image_tokens:  # flf2v: (B, 2, N, D) -> [first, last] of each sample, (2B, N, D), as the pipeline
                embeds = batch["image_embeds"].flatten(0, 1) if self.frame_conditions.last else batch["image_embeds"]
                image["encoder_hidden_states_image"] = embeds.to(x0.device, input_dtype(transformer))
        return self._predict(transformer, batch, x0, noise, noisy, sigmas * NUM_TRAIN_TIMESTEPS, **image)

    def _predict(
        self,
        transformer,
        batch: dict[str, Tensor],
        x0: Tensor,
        noise: Tensor,
        noisy: Tensor,
        timestep: Tensor,
        clean_first_frame: bool = False,
        **inputs,
    ) -> Prediction:
        """The prediction of `noisy` at `timestep` (float32, as the pipelines pass it); target noise - x0."""
        dtype = input_dtype(transformer)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=timestep,
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            return_dict=False,
            **inputs,
        )[0]
        weight = None
        if clean_first_frame:  # the i2v condition: left out of the loss
            weight = (torch.arange(x0.shape[2], device=x0.device) > 0).float().view(1, 1, -1, 1, 1)
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)

    def tp_plan(self) -> TensorParallelPlan:
        """With image tokens also their keys/values, split by heads like the text's (key norm over all heads)."""
        image = ("attn2.add_k_proj", "attn2.add_v_proj") if self.image_tokens else ()
        return TensorParallelPlan(
            colwise=(
                *(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")),
                *image,
                "ffn.net.0.proj",
            ),
            rowwise=("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2"),
            attention=("attn1", "attn2"),
            head_norms=(
                *(f"{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")),
                *(("attn2.norm_added_k",) if image else ()),
            ),
        )

    def cp_plan(self) -> ContextParallelPlan:
        """The tokens split at the first block (Wan patchifies in its forward), per-token timesteps at the input."""
        return ContextParallelPlan(
            split_inputs={"": {"timestep": 1}, "blocks.0": {"hidden_states": 1}},
            gather_output="proj_out",
            self_attention=("attn1",),
        )


def _normalised(vae, latents: Tensor) -> Tensor:
    """(latents - mean) / std with the VAE config's per-channel lists, in the latents' dtype, as float32."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(latents)
    std = torch.tensor(vae.config.latents_std).view(shape).to(latents)
    return ((latents - mean) / std).float()
