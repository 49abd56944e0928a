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

# diffusers' WanAttnProcessor: with image key/value projections, the context's last 512 tokens are
# the text and everything before them the image.
I2V_TEXT_TOKENS = 512
IMAGE_PARTS = ("image_encoder", "image_processor")
IMAGE_TASKS = ("i2v", "flf2v")  # the tasks that condition on the clip's own frames


class WanSpec(ModelSpec):
    family: ClassVar[str] = "wan"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v", "flf2v")
    block_lists: ClassVar[tuple[str, ...]] = ("blocks",)
    # Original (Wan-AI) module names, which ComfyUI uses; diffusers' Wan LoRA conversion reads them back.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = (
        *((rf"blocks\.(\d+)\.{attn}\.{ours}", rf"blocks.\1.{theirs}.{short}")
          for attn, theirs in (("attn1", "self_attn"), ("attn2", "cross_attn"))
          for ours, short in (("to_q", "q"), ("to_k", "k"), ("to_v", "v"), (r"to_out\.0", "o"))),
        (r"blocks\.(\d+)\.attn2\.add_k_proj", r"blocks.\1.cross_attn.k_img"),
        (r"blocks\.(\d+)\.attn2\.add_v_proj", r"blocks.\1.cross_attn.v_img"),
        (r"blocks\.(\d+)\.ffn\.net\.0\.proj", r"blocks.\1.ffn.0"),
        (r"blocks\.(\d+)\.ffn\.net\.2", r"blocks.\1.ffn.2"),
    )
    example_hub_id: ClassVar[str] = "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"
    components: ClassVar[dict[str, str]] = {"text_encoder": "transformers:UMT5EncoderModel",
                                            "vae": "diffusers:AutoencoderKLWan",
                                            "transformer": "diffusers:WanTransformer3DModel"}
    # Wan 2.1 i2v and flf2v add the CLIP image encoder and its processor (Wan 2.2's I2V models have none).
    task_components: ClassVar[dict[str, dict[str, str]]] = {
        task: {"image_encoder": "transformers:CLIPVisionModelWithProjection",
               "image_processor": "transformers:CLIPImageProcessor"} for task in IMAGE_TASKS}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:WanPipeline", "i2v": "diffusers:WanImageToVideoPipeline",
                                           "flf2v": "diffusers:WanImageToVideoPipeline"}
    # Wan 2.1 I2V also conditions on CLIP image embeddings; Wan 2.2's I2V models only on the encoded frame.
    clip_image_conditioning: ClassVar[bool] = True

    def __init__(self, config: ModelConfig, frame_rate: float):
        super().__init__(config, frame_rate)
        if self.image_tokens and self.max_text_tokens != I2V_TEXT_TOKENS:
            raise UserError(
                f"model.max_text_tokens = {self.max_text_tokens}, but Wan image-to-video needs exactly "
                f"{I2V_TEXT_TOKENS}: its cross-attention (diffusers' WanAttnProcessor) takes every context token "
                f"before the last {I2V_TEXT_TOKENS} to be an image token. Unset model.max_text_tokens or set it "
                f"to {I2V_TEXT_TOKENS}")

    @property
    def image_tokens(self) -> bool:
        """Whether this run feeds CLIP image embeddings (Wan 2.1 i2v, flf2v) beside the encoded frames."""
        return self.config.task in IMAGE_TASKS and self.clip_image_conditioning


    @property
    def default_lora_targets(self) -> list[str]:  # type: ignore[override]
        """Attention q/k/v/out; i2v and flf2v also the cross-attention's image keys and values (`add_k_proj`,
        `add_v_proj`; peft matches by suffix, so `to_k` does not cover them)."""
        extra = ["add_k_proj", "add_v_proj"] if self.image_tokens else []
        return [*ModelSpec.default_lora_targets, *extra]

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self.load_config("vae")
        transformer = self.load_config("transformer")
        patch = tuple(transformer.get("patch_size", (1, 2, 2)))
        if patch[0] != 1 or patch[1] != patch[2]:
            raise UserError(f"Wan transformer patch_size {patch} is not supported; expected (1, p, p)")
        geometry = VaeGeometry(temporal=vae.get("scale_factor_temporal") or 2 ** sum(vae["temperal_downsample"]),
                               spatial=vae.get("scale_factor_spatial") or 2 ** len(vae["temperal_downsample"]),
                               channels=vae["z_dim"], patch=patch[1])
        self._check_task_fits(transformer, geometry)
        return geometry

    def _check_task_fits(self, transformer: dict, g: VaeGeometry) -> None:
        """An i2v run needs a Wan 2.1 I2V transformer (36 input channels, image projections), an flf2v run
        one whose image embedder also holds a position embedding over two images' tokens (FLF2V), and a
        t2v run a transformer without them (Wan 2.2 I2V: 36 channels, no image projections)."""
        where = self.source("transformer")[0]
        found = {key: transformer.get(key) for key in ("in_channels", "image_dim", "added_kv_proj_dim")}
        task = self.config.task
        if self.config.task == "i2v" and not self.clip_image_conditioning:
            if found["in_channels"] != 2 * g.channels + g.temporal or found["image_dim"]:
                raise UserError(
                    f"model.task = \"i2v\" on {self.family} needs a Wan 2.2 image-to-video transformer (in_channels "
                    f"{2 * g.channels + g.temporal}, no image_dim, e.g. Wan-AI/Wan2.2-I2V-A14B-Diffusers); the one at "
                    f"{where!r} has {found}")
        elif task in IMAGE_TASKS:
            expected = 2 * g.channels + g.temporal  # latents, condition mask, condition latents
            if found["in_channels"] != expected or not found["image_dim"] or not found["added_kv_proj_dim"]:
                example = "FLF2V-14B-720P-diffusers" if task == "flf2v" else "I2V-14B-480P-Diffusers"
                raise UserError(
                    f"model.task = \"{task}\" needs a Wan 2.1 image-to-video transformer (in_channels {expected}, "
                    f"image_dim and added_kv_proj_dim set, e.g. Wan-AI/Wan2.1-{example}); the one at {where!r} "
                    f"has {found}")
            self._check_image_positions(transformer.get("pos_embed_seq_len"), where)
        elif found["image_dim"] or found["in_channels"] != g.channels:
            raise UserError(f"the transformer at {where!r} is an image-to-video one ({found}): "
                             "set model.task = \"i2v\"" + (" (or \"flf2v\": it takes two images)"
                                                           if transformer.get("pos_embed_seq_len") else ""))

    def _check_image_positions(self, positions: int | None, where: str) -> None:
        """FLF2V's image embedder adds a learned position embedding over the first and the last image's
        tokens (`pos_embed_seq_len` = 2 x the image encoder's tokens) and so takes the images in pairs;
        I2V's has none and takes one. The task must be the transformer's."""
        if self.config.task == "flf2v":
            wanted = 2 * self.image_embeds_shape()[0]
            if positions != wanted:
                raise UserError(
                    f"model.task = \"flf2v\" needs a Wan 2.1 first-and-last-frame transformer (pos_embed_seq_len "
                    f"{wanted}: both images' {wanted // 2} CLIP tokens, e.g. Wan-AI/Wan2.1-FLF2V-14B-720P-diffusers); "
                    f"the one at {where!r} has pos_embed_seq_len {positions}")
        elif positions:
            raise UserError(f"the transformer at {where!r} is a first-and-last-frame one (pos_embed_seq_len "
                             f"{positions}): set model.task = \"flf2v\"")

    def image_embeds_shape(self) -> tuple[int, int]:
        """(tokens, width) of one image's CLIP embeddings: its patches plus the class token, from the config."""
        vision = self.load_config("image_encoder")
        return (vision.image_size // vision.patch_size) ** 2 + 1, vision.hidden_size

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, L, D)} float32, zero past each caption's tokens; L = the spec's max_text_tokens."""
        embeds, _ = self._encode_prompt(encoders, captions, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds.float()}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Normalised latents from the posterior mode (deterministic, as WanImageToVideoPipeline encodes);
        i2v and flf2v add what the pipeline makes of the conditioning frames (`encode_condition_frames`)."""
        self._check_video(video)
        vae = encoders["vae"]
        latents = self._vae_mode(vae, video)
        mean, std = _latent_stats(vae, latents)
        out = {"latents": ((latents - mean) / std).float()}
        if self.config.task in IMAGE_TASKS:
            out.update(self.encode_condition_frames(encoders, video))
        return out

    @torch.no_grad()
    def encode_condition_frames(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """The first frame (flf2v: and the last) as WanImageToVideoPipeline's conditioning images, float32:
        - `image_embeds` (Wan 2.1 only): the image encoder's second-to-last hidden states of each frame as a
          uint8 image through the image processor (`encode_image`): (B, N, D), for flf2v (B, 2, N, D) as
          [first, last] (the pipeline encodes `[image, last_image]`);
        - `condition_latents` (B, C, F, H, W): [the first frame, zeros for the other frames (flf2v: the
          last frame last)] VAE-encoded (mode) and normalised (`prepare_latents`). The mask it concatenates
          is `condition_mask`.
        """
        vae = encoders["vae"]
        frames = [video[:, :, :1], video[:, :, -1:]] if self.config.task == "flf2v" else [video[:, :, :1]]
        zeros = video.new_zeros(*video.shape[:2], video.shape[2] - len(frames), *video.shape[3:])
        condition = torch.cat([frames[0], zeros, *frames[1:]], dim=2)
        latents = self._vae_mode(vae, condition).float()
        mean, std = _latent_stats(vae, latents)
        condition_latents = {"condition_latents": ((latents - mean) / std).float()}
        if not self.image_tokens:
            return condition_latents
        # The frames as the uint8 images they were decoded from, sample by sample: first, (last,) of sample 0 ...
        images = frames_to_pil(torch.stack([frame[:, :, 0] for frame in frames], dim=1).flatten(0, 1))
        hidden = self._image_hidden_states(encoders, images)
        embeds = hidden.unflatten(0, (video.shape[0], 2)) if len(frames) == 2 else hidden
        return {"image_embeds": embeds, **condition_latents}

    @staticmethod
    def _image_hidden_states(encoders, images: list) -> Tensor:
        """WanImageToVideoPipeline.encode_image of `images`: the image encoder's second-to-last hidden
        states of the processed images, (len(images), N, D) float32."""
        encoder = encoders["image_encoder"]
        inputs = encoders["image_processor"](images=images, return_tensors="pt")
        return encoder(pixel_values=inputs["pixel_values"].to(encoder.device, encoder.dtype),
                       output_hidden_states=True).hidden_states[-2].float()

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        """i2v and flf2v add the encoded condition frames and, for Wan 2.1, the CLIP image tokens (two
        images' for flf2v)."""
        shapes = super().condition_shapes(bucket)
        if self.config.task in IMAGE_TASKS:
            shapes["condition_latents"] = shapes["latents"]
        if self.image_tokens:
            pair = (2,) if self.config.task == "flf2v" else ()
            shapes["image_embeds"] = (*pair, *self.image_embeds_shape())
        return shapes

    @property
    def image_conditions(self) -> ImageConditions | None:
        """Wan 2.1 i2v, flf2v: validation images need the CLIP image encoder's embeddings (stage 1 makes them)."""
        return ImageConditions(self._validation_image_embeds) if self.image_tokens else None

    @torch.no_grad()
    def _validation_image_embeds(self, encoders, image) -> dict[str, Tensor]:
        """WanImageToVideoPipeline.encode_image of one validation image (a first or a last frame), as its
        call's `image_embeds`: (1, N, D)."""
        return {"image_embeds": self._image_hidden_states(encoders, [to_pil_image(image)])}

    def pipeline_conditions(self, pipeline, conditions: dict[str, Tensor]) -> dict[str, Tensor]:
        """WanImageToVideoPipeline refuses `image` together with `image_embeds` (its check_inputs), yet needs
        the image for the VAE condition: this pipeline object's `encode_image` hands it the stored embeddings.
        flf2v: the last image's (`last_image_embeds`) follow the first's, as it encodes `[image, last_image]`."""
        conditions = dict(conditions)
        embeds = conditions.pop("image_embeds", None)
        last = conditions.pop("last_image_embeds", None)
        if embeds is not None:
            both = embeds if last is None else torch.cat([embeds, last])
            pipeline.encode_image = lambda image, device: both.to(device)
        return conditions

    def condition_mask(self, latents: Tensor) -> Tensor:
        """WanImageToVideoPipeline's mask for latents (B, C, F, H, W): (B, T, F, H, W) with T the VAE's time
        compression. The pipeline marks the given pixel frames and folds T of them into each latent frame,
        the first latent frame standing for the first frame alone (T copies): so 1 on all of latent frame
        0, for flf2v also on the last slot of the last latent frame (the last pixel frame), 0 elsewhere."""
        batch, _, frames, height, width = latents.shape
        mask = latents.new_zeros(batch, self.geometry.temporal, frames, height, width)
        mask[:, :, 0] = 1
        if self.config.task == "flf2v":
            mask[:, -1, -1] = 1
        return mask

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        x0, noise, sigmas, noisy = flow_inputs(batch, sigmas, noise)
        dtype = input_dtype(transformer)
        image = {}
        task = self.config.task
        if task in IMAGE_TASKS:  # [noisy, mask, condition] and the image tokens, as the pipeline
            needed = ("condition_latents", "image_embeds") if self.image_tokens else ("condition_latents",)
            if any(name not in batch for name in needed):
                raise KeyError(f"task {task} needs batch{[*needed]}; precompute the shards with "
                               f"model.task = \"{task}\"")
            noisy = torch.cat([noisy, self.condition_mask(x0), batch["condition_latents"].to(x0)], dim=1)
            if self.image_tokens:  # flf2v: (B, 2, N, D) -> [first, last] of each sample, (2B, N, D), as the pipeline
                embeds = batch["image_embeds"]
                embeds = embeds.flatten(0, 1) if task == "flf2v" else embeds
                image["encoder_hidden_states_image"] = embeds.to(x0.device, dtype)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,  # float32, as the pipeline passes it
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            return_dict=False,
            **image,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=None)

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> TensorParallelPlan:
        """q/k/v and the FFN's first layer column-wise, attention outputs and the FFN's second row-wise.

        Wan's rotary tables span one head and are broadcast over heads, so they need no change.
        i2v: the image keys/values (`add_k_proj`, `add_v_proj`) are split like the text ones, by
        heads, and their key norm spans all heads (`norm_added_k`); the image attention then runs on
        the local heads and adds to the text attention before the row-wise output projection.
        """
        image = ("attn2.add_k_proj", "attn2.add_v_proj") if self.image_tokens else ()
        return TensorParallelPlan(
            colwise=(*(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")), *image,
                     "ffn.net.0.proj"),
            rowwise=("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2"),
            attention=("attn1", "attn2"),
            head_norms=(*(f"{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")),
                        *(("attn2.norm_added_k",) if image else ())),
        )

    def cp_plan(self) -> ContextParallelPlan:
        """Split the tokens where the first block receives them (Wan patchifies inside its forward)
        and per-token timesteps (Wan 2.2 style) at the input; gather after proj_out. i2v, flf2v: the image
        tokens are prepended to the text, which is not split, so the plan is the same."""
        return ContextParallelPlan(
            split_inputs={"": {"timestep": 1}, "blocks.0": {"hidden_states": 1}},
            gather_output="proj_out",
            self_attention=("attn1",),
        )


def _latent_stats(vae, like: Tensor) -> tuple[Tensor, Tensor]:
    """The VAE config's per-channel mean and std, shaped (1, C, 1, 1, 1) like `like`."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like)
    return mean, std
