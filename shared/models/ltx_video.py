"""LTX-Video (Lightricks): T5 text encoder, causal video VAE (x8 time, x32 space), packed-token DiT.

What is particular to it, and why: docs/families.md, "LTX-Video".
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from vt.shared.errors import UserError
from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS, Prediction, flow_match_noisy, input_dtype
from vt.shared.models.plans import ContextParallelPlan, TensorParallelPlan
from vt.shared.models.spec import ModelSpec, VaeGeometry


class LTXVideoSpec(ModelSpec):
    family: ClassVar[str] = "ltx-video"
    tasks: ClassVar[tuple[str, ...]] = ("t2v", "i2v")
    block_lists: ClassVar[tuple[str, ...]] = ("transformer_blocks",)
    text_masks: ClassVar[dict[str, str]] = {"prompt_embeds": "prompt_attention_mask"}  # attention masks the rest
    # The original LTX-Video checkpoint (and ComfyUI) use diffusers' module names; diffusers' LTX
    # conversion takes lora_A/lora_B without `.alpha`, so the scale goes into lora_B.
    original_names: ClassVar[tuple[tuple[str, str], ...]] = ((r"(transformer_blocks\..+)", r"\1"),)
    comfy_alpha: ClassVar[bool] = False
    noisy_first_frame: ClassVar[bool] = True  # i2v may noise the conditioning frame lightly
    example_hub_id: ClassVar[str] = "Lightricks/LTX-Video"

    components: ClassVar[dict[str, str]] = {"text_encoder": "transformers:T5EncoderModel",
                                            "vae": "diffusers:AutoencoderKLLTXVideo",
                                            "transformer": "diffusers:LTXVideoTransformer3DModel"}
    pipelines: ClassVar[dict[str, str]] = {"t2v": "diffusers:LTXPipeline", "i2v": "diffusers:LTXImageToVideoPipeline"}

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self._vae_without_weights()
        transformer = self.load_config("transformer")
        if transformer.get("patch_size_t", 1) != 1:
            raise UserError("LTX transformers with patch_size_t > 1 are not supported")
        return VaeGeometry(temporal=vae.temporal_compression_ratio, spatial=vae.spatial_compression_ratio,
                           channels=vae.config.latent_channels, patch=transformer.get("patch_size", 1))

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, L, D), "prompt_attention_mask": (B, L)} float32, L = the spec's max_text_tokens."""
        return self._prompt_and_mask(encoders, captions)

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Normalised latents (posterior mode: stage 1 is deterministic); i2v adds the first frame's."""
        self._check_video(video)
        vae = encoders["vae"]
        out = {"latents": self._encode(vae, video)}
        if self.config.task == "i2v":
            # The i2v pipeline encodes the conditioning image alone, as a one-frame video.
            out["first_frame_latents"] = self._encode(vae, video[:, :, :1])
        return out

    def condition_shapes(self, bucket) -> dict[str, tuple[int, ...]]:
        shapes = super().condition_shapes(bucket)
        if self.config.task == "i2v":  # the first frame encoded alone
            shapes["first_frame_latents"] = (shapes["latents"][0], 1, *shapes["latents"][2:])
        return shapes

    @staticmethod
    def _encode(vae, video: Tensor) -> Tensor:
        from diffusers import LTXPipeline

        latents = ModelSpec._vae_mode(vae, video)
        latents = LTXPipeline._normalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return latents.float()

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generators: list[torch.Generator] | None = None) -> Prediction:
        """Flow matching on (B, C, F, H, W) latents; the prediction is unpacked back to that layout."""
        from diffusers import LTXPipeline

        x0 = batch["latents"].float()
        noise = noise.to(x0)
        sigmas = sigmas.to(x0).flatten()
        frames, height, width = x0.shape[2:]
        g = self.geometry
        grid = (frames, height // g.patch, width // g.patch)
        if self.config.task == "i2v":
            # Per latent frame sigmas: frame 0 gets its own, fed to the transformer per token.
            x0, frame_sigmas, weight = self._condition_first_frame(batch, x0, sigmas, generators)
            noisy = flow_match_noisy(x0, noise, frame_sigmas[:, None, :, None, None])
            timestep = frame_sigmas[:, :, None].expand(-1, -1, grid[1] * grid[2]).flatten(1)  # frame-major tokens
        else:
            noisy, timestep, weight = flow_match_noisy(x0, noise, sigmas), sigmas, None
        dtype = input_dtype(transformer)
        tokens = LTXPipeline._pack_latents(noisy, g.patch, 1).to(dtype)
        out = transformer(
            hidden_states=tokens,
            encoder_hidden_states=batch["prompt_embeds"].to(tokens.device, dtype),
            timestep=(timestep * NUM_TRAIN_TIMESTEPS).to(tokens.device),  # float32, as the pipeline passes it
            encoder_attention_mask=batch["prompt_attention_mask"].to(tokens.device),
            num_frames=grid[0], height=grid[1], width=grid[2],
            rope_interpolation_scale=(g.temporal / self.frame_rate, g.spatial, g.spatial),  # as the pipeline
            return_dict=False,
        )[0]
        prediction = LTXPipeline._unpack_latents(out, *grid, g.patch, 1)
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=weight)

    def _condition_first_frame(self, batch, x0, sigmas, generators):
        """Frame 0 becomes the conditioning latent, with its own sigma and zero loss weight.

        Its sigma is drawn from [0, first_frame_noise] (from each sample's own generator, so every layout
        draws the same) and never exceeds the sample's own sigma: the conditioning frame is never noisier
        than the frames it conditions.
        """
        if "first_frame_latents" not in batch:
            raise KeyError("task i2v needs batch['first_frame_latents']; precompute the shards with model.task = \"i2v\"")
        x0 = torch.cat([batch["first_frame_latents"].to(x0), x0[:, :, 1:]], dim=2)
        batch_size, frames = x0.shape[0], x0.shape[2]
        first_sigma = torch.zeros_like(sigmas)
        if self.config.first_frame_noise > 0:
            draw = (torch.stack([torch.rand((), generator=g) for g in generators]) if generators is not None
                    else torch.rand(batch_size))
            first_sigma = torch.minimum(draw.to(sigmas) * self.config.first_frame_noise, sigmas)
        frame_sigmas = sigmas[:, None].repeat(1, frames)
        frame_sigmas[:, 0] = first_sigma
        weight = torch.ones(batch_size, 1, frames, 1, 1, device=x0.device, dtype=x0.dtype)
        weight[:, :, 0] = 0.0
        return x0, frame_sigmas, weight

    # ----------------------------------------------------------------------------- validation
    def inference_settings(self) -> dict[str, Any]:
        """RoPE's temporal scale depends on the frame rate: sample at the rate frames were sampled at."""
        return {**super().inference_settings(), "frame_rate": self.frame_rate}

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> TensorParallelPlan:
        """q/k/v and the FFN's first layer column-wise, attention outputs and the FFN's second row-wise.

        LTX applies its rotary tables to the flat (B, S, heads * head_dim) queries, so each rank
        keeps the rope channels of its heads (`channel_rope`).
        """
        return TensorParallelPlan(
            colwise=(*(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")), "ff.net.0.proj"),
            rowwise=("attn1.to_out.0", "attn2.to_out.0", "ff.net.2"),
            attention=("attn1", "attn2"),
            head_norms=tuple(f"{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")),
            channel_rope="rope",
        )

    def cp_plan(self) -> ContextParallelPlan:
        """Split the packed tokens and per-token timesteps (i2v) at the input, gather after proj_out.

        The rotary tables are computed from the grid size, for the full sequence, which is what
        the self-attention sees once Ulysses has moved it to "all tokens, my heads".
        """
        return ContextParallelPlan(
            split_inputs={"": {"hidden_states": 1, "timestep": 1}},
            gather_output="proj_out",
            self_attention=("attn1",),
            rope_heads={"rope": -1},
        )
