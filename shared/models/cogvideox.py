"""CogVideoX 1.0 and 1.5 (THUDM / zai-org, text- and image-to-video): T5 text encoder, causal video VAE
(x4 time, x8 space), a DiT over the joint [text, video] sequence, v-prediction on a DDPM schedule.

What is particular to it, and why: docs/families.md, "CogVideoX".
"""

from __future__ import annotations

from functools import cached_property
from types import SimpleNamespace
from typing import ClassVar

import torch
from torch import Tensor

from vt.shared.buckets import Bucket
from vt.shared.errors import UserError
from vt.shared.models.flow import FlowRecipe, Prediction, input_dtype
from vt.shared.models.plans import TensorParallelPlan
from vt.shared.models.spec import ModelSpec, VaeGeometry


class CogVideoXSpec(ModelSpec):
    family: ClassVar[str] = "cogvideox"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    # No ComfyUI key table, `original_names` (the base class warns, writes the diffusers file): docs/families.md.
    example_hub_id: ClassVar[str] = "THUDM/CogVideoX-5b"
    # diffusers' examples/cogvideo and zai-org/CogVideo's finetune trainers: uniform integer timesteps (uniform
    # sigmas here: t = floor(1000 sigma)), no shift; their x0 loss weighted 1 / (1 - alphas_cumprod[t]) is the
    # unweighted v loss `forward` returns, so no weighting on top (docs/families.md).
    flow_recipe: ClassVar[FlowRecipe] = FlowRecipe("uniform", 1.0, "none")
    components: ClassVar[dict[str, str]] = {
        "text_encoder": "transformers:T5EncoderModel",
        "vae": "diffusers:AutoencoderKLCogVideoX",
        "transformer": "diffusers:CogVideoXTransformer3DModel",
    }
    pipelines: ClassVar[dict[str, str]] = {
        "t2v": "diffusers:CogVideoXPipeline",
        "i2v": "diffusers:CogVideoXImageToVideoPipeline",
    }

    @cached_property
    def _transformer_config(self) -> dict:
        return self.load_config("transformer")

    def _geometry_from_config(self) -> VaeGeometry:
        vae, transformer = self.load_config("vae"), self._transformer_config
        i2v = bool(self.frame_conditions)
        if transformer.get("in_channels") != vae["latent_channels"] * (2 if i2v else 1):
            found = (
                f"the {self.family} transformer at {self.source('transformer')[0]!r} takes "
                f"{transformer.get('in_channels')} input channels for {vae['latent_channels']} latent channels"
            )
            raise UserError(
                f'{found}, but model.task = "i2v" needs an image-to-video transformer (twice as many, '
                f"e.g. THUDM/CogVideoX-5b-I2V)"
                if i2v
                else f'{found}: an image-to-video transformer? Set model.task = "i2v", or use a t2v '
                f"checkpoint (e.g. {self.example_hub_id})"
            )
        self._check_text_length()
        # As CogVideoXPipeline computes its vae_scale_factor_spatial / _temporal.
        return VaeGeometry(
            temporal=int(vae["temporal_compression_ratio"]),
            channels=vae["latent_channels"],
            spatial=2 ** (len(vae["block_out_channels"]) - 1),
            patch=transformer.get("patch_size", 2),
        )

    def _check_text_length(self) -> None:
        """Sincos (and learned) positional embeddings span exactly max_text_seq_length text tokens."""
        config = self._transformer_config
        learned = config.get("use_learned_positional_embeddings")
        positional = not config.get("use_rotary_positional_embeddings") or learned
        expected = config.get("max_text_seq_length", 226)
        if positional and self.max_text_tokens != expected:
            given = (
                f"model.max_text_tokens = {self.max_text_tokens}"
                if self.config.max_text_tokens
                else f"model.max_text_tokens unset ({self.max_text_tokens}, the pipeline's default)"
            )
            raise UserError(
                f"{given} does not fit this {self.family} transformer: its sincos positional embedding "
                f"covers exactly max_text_seq_length = {expected} text tokens. Set "
                f"model.max_text_tokens = {expected}"
            )

    def check_bucket(self, bucket: Bucket) -> None:
        super().check_bucket(bucket)
        config, spatial = self._transformer_config, self.geometry.spatial
        if config.get("use_learned_positional_embeddings"):  # the transformer raises on any other size
            size = (config.get("sample_height", 60) * spatial, config.get("sample_width", 90) * spatial)
            if (bucket.height, bucket.width) != size:
                raise UserError(
                    f"bucket {bucket.name}: this {self.family} transformer's learned positional embedding "
                    f"covers exactly {size[0]}x{size[1]} pixels (CogVideoX-5b-I2V); change buckets.sizes "
                    f"to {bucket.frames}x{size[0]}x{size[1]}"
                )
        # Latent frames per token: 1 for CogVideoX 1.0, `patch_size_t` (2) for 1.5.
        p_t, temporal = config.get("patch_size_t") or 1, self.geometry.temporal
        if p_t > 1 and ((bucket.frames - 1) // temporal + 1) % p_t:
            first = temporal * (p_t - 1) + 1
            raise UserError(
                f"bucket {bucket.name}: this {self.family} transformer folds {p_t} latent frames into a "
                f"token (patch_size_t), so frames must be {temporal * p_t}k+{first} (e.g. "
                f"{first + temporal * p_t} or {first + 10 * temporal * p_t}); change buckets.sizes"
            )

    def tokens_per_sample(self, latent_shape: tuple[int, ...]) -> int:
        """Video tokens only (not the text's); CogVideoX 1.5 also folds patch_size_t frames."""
        _, frames, height, width = latent_shape
        patch = self.geometry.patch
        return frames // (self._transformer_config.get("patch_size_t") or 1) * (height // patch) * (width // patch)

    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        self._check_text_length()
        embeds, _ = self._encode_prompt(encoders, captions, do_classifier_free_guidance=False)
        return {"prompt_embeds": embeds.float()}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """i2v adds `image_latents` (B, C, 1, H, W): the first frame encoded alone, scaled as `prepare_latents`."""
        out = super().encode_video(encoders, video)
        if self.frame_conditions:
            vae = encoders["vae"]
            latents = self.vae_mode(vae, self.frame_conditions.first(video)).float()
            factor = vae.config.scaling_factor
            out["image_latents"] = latents / factor if vae.config.get("invert_scale_latents") else latents * factor
        return out

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = super().condition_shapes(bucket)
        if self.frame_conditions:  # the first frame encoded alone
            shapes["image_latents"] = self.frame_conditions.frame_shape(shapes["latents"])
        return shapes

    @cached_property
    def _alphas_cumprod(self) -> Tensor:
        """The scheduler's alphas_cumprod (float64, CPU): snr_shift_scale and zero-terminal-SNR included."""
        scheduler = self.load_scheduler()
        prediction = scheduler.config.get("prediction_type")
        if prediction != "v_prediction" or not hasattr(scheduler, "alphas_cumprod"):
            raise UserError(
                f"{self.family} trains v-prediction on a DDPM schedule, but the scheduler of "
                f"{self.source('scheduler')[0]!r} is {type(scheduler).__name__} with prediction_type "
                f"{prediction!r}; use the checkpoint's CogVideoXDDIMScheduler / CogVideoXDPMScheduler "
                f"(model.components.scheduler)"
            )
        return scheduler.alphas_cumprod.to(torch.float64).clone()

    def forward(
        self,
        transformer,
        batch: dict[str, Tensor],
        sigmas: Tensor,
        noise: Tensor,
        generators: list[torch.Generator] | None = None,
    ) -> Prediction:
        """v-prediction at the DDPM timestep floor(sigma * N) (at most N - 1); the transformer takes (B, F, C, H, W)."""
        x0 = batch["latents"].float()
        noise = noise.to(x0)
        steps = len(self._alphas_cumprod)
        # The timestep from sigma in float32, as sigma * 1000 reads; int64, as the pipeline passes the scheduler's.
        t = (sigmas.flatten().detach().float() * steps).floor().clamp(0, steps - 1).long().to(x0.device)
        alphas = self._alphas_cumprod.to(x0.device)[t]
        shape = (-1, *([1] * (x0.ndim - 1)))
        signal, sigma = alphas.sqrt().float().view(shape), (1 - alphas).sqrt().float().view(shape)
        noisy = signal * x0 + sigma * noise
        dtype = input_dtype(transformer)
        frames, height, width = x0.shape[2:]
        image = {}
        if self.frame_conditions:  # [noisy, image latents + zeros] on channels; 1.5 I2V: ofs 2.0
            self.frame_conditions.require(batch, "image_latents")
            first = batch["image_latents"].to(x0)
            condition = torch.cat([first, first.new_zeros(*first.shape[:2], frames - 1, height, width)], dim=2)
            noisy = torch.cat([noisy, condition], dim=1)
            if transformer.config.ofs_embed_dim is not None:
                image["ofs"] = torch.full((x0.shape[0],), 2.0, device=x0.device, dtype=dtype)
        out = transformer(
            hidden_states=noisy.transpose(1, 2).to(dtype),
            timestep=t,
            return_dict=False,
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            image_rotary_emb=self._rotary_embedding(transformer, frames, height, width, x0.device),
            **image,
        )[0]
        return Prediction(prediction=out.transpose(1, 2).float(), target=signal * noise - sigma * x0, weight=None)

    @cached_property
    def _rope_cache(self) -> dict:
        return {}

    def _rotary_embedding(self, transformer, frames: int, height: int, width: int, device) -> tuple | None:
        """(cos, sin) for a latent grid, from CogVideoXPipeline's own method; None without RoPE."""
        config = transformer.config
        if not config.use_rotary_positional_embeddings:
            return None
        cache, key = self._rope_cache, (frames, height, width, str(device))
        if key not in cache:
            spatial = self.geometry.spatial
            pipeline = SimpleNamespace(transformer=SimpleNamespace(config=config), vae_scale_factor_spatial=spatial)
            cache[key] = self.pipeline_class()._prepare_rotary_positional_embeddings(
                pipeline, height * spatial, width * spatial, frames, device
            )
        return cache[key]

    def tp_plan(self) -> TensorParallelPlan:
        """One joint self-attention per block: its per-head norms and rotary tables work unchanged on local heads."""
        return TensorParallelPlan(
            colwise=("attn1.to_q", "attn1.to_k", "attn1.to_v", "ff.net.0.proj"),
            rowwise=("attn1.to_out.0", "ff.net.2"),
            attention=("attn1",),
        )

    # No cp_plan (parallel.cp > 1 refused): the processor joins text and video tokens before q/k/v (docs/parallel.md).
