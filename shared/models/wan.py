"""Wan 2.1 (text-to-video): UMT5 text encoder, causal video VAE (x4 time, x8 space), DiT on (B, C, F, H, W).

What is particular to Wan:
- latents are normalised per channel with the VAE config's `latents_mean` / `latents_std` lists,
  (z - mean) / std: the inverse of what WanPipeline does before decoding;
- text embeddings are zero beyond each caption's length (no attention mask): WanPipeline's own
  `encode_prompt` does that, and we call it;
- the transformer patchifies internally (patch (1, 2, 2)), so latent height and width must be even;
- the scheduler is UniPC in flow-prediction mode, whose timesteps are sigma * 1000.
Image-to-video (Wan 2.1 I2V, CLIP image encoder) is not supported yet.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from vt.shared.models.spec import (NUM_TRAIN_TIMESTEPS, ContextParallelPlan, ModelSpec, Prediction, input_dtype,
                                   TensorParallelPlan, VaeGeometry, flow_match_noisy)
from vt.shared.models.tiny import build_t5_tokenizer, seeded


class WanSpec(ModelSpec):
    family: ClassVar[str] = "wan"
    tasks: ClassVar[tuple[str, ...]] = ("t2v",)
    blocks_attr: ClassVar[str] = "blocks"
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

    @staticmethod
    def component_classes() -> dict[str, type]:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel
        from transformers import UMT5EncoderModel

        return {"text_encoder": UMT5EncoderModel, "vae": AutoencoderKLWan, "transformer": WanTransformer3DModel}

    def pipeline_class(self) -> type:
        from diffusers import WanPipeline

        return WanPipeline

    def _geometry_from_config(self) -> VaeGeometry:
        vae = self.load_config("vae")
        patch = tuple(self.load_config("transformer").get("patch_size", (1, 2, 2)))
        if patch[0] != 1 or patch[1] != patch[2]:
            raise ValueError(f"Wan transformer patch_size {patch} is not supported; expected (1, p, p)")
        return VaeGeometry(temporal=vae.get("scale_factor_temporal") or 2 ** sum(vae["temperal_downsample"]),
                           spatial=vae.get("scale_factor_spatial") or 2 ** len(vae["temperal_downsample"]),
                           channels=vae["z_dim"], patch=patch[1])

    # ----------------------------------------------------------------------------- stage 1
    @torch.no_grad()
    def encode_text(self, encoders, captions: list[str]) -> dict[str, Tensor]:
        """{"prompt_embeds": (B, L, D)} float32, zero past each caption's tokens; L = the spec's max_text_tokens."""
        pipeline = self._text_pipeline(encoders)
        embeds, _ = pipeline.encode_prompt(
            list(captions), do_classifier_free_guidance=False, max_sequence_length=self.max_text_tokens,
            device=encoders["text_encoder"].device,
        )
        return {"prompt_embeds": embeds.float()}

    @torch.no_grad()
    def encode_video(self, encoders, video: Tensor) -> dict[str, Tensor]:
        """Normalised latents from the posterior mode (deterministic, as WanImageToVideoPipeline encodes)."""
        self._check_video(video)
        vae = encoders["vae"]
        latents = vae.encode(video.to(vae.device, vae.dtype)).latent_dist.mode()
        mean, std = _latent_stats(vae, latents)
        return {"latents": ((latents - mean) / std).float()}

    # ----------------------------------------------------------------------------- stage 2
    def forward(self, transformer, batch: dict[str, Tensor], sigmas: Tensor, noise: Tensor,
                generator: torch.Generator | None = None) -> Prediction:
        x0 = batch["latents"].float()
        noise = noise.to(x0)
        sigmas = sigmas.to(x0).flatten()
        dtype = input_dtype(transformer)
        noisy = flow_match_noisy(x0, noise, sigmas)
        prediction = transformer(
            hidden_states=noisy.to(dtype),
            timestep=sigmas * NUM_TRAIN_TIMESTEPS,  # float32, as the pipeline passes it
            encoder_hidden_states=batch["prompt_embeds"].to(x0.device, dtype),
            return_dict=False,
        )[0]
        return Prediction(prediction=prediction.float(), target=noise - x0, weight=None)

    # ----------------------------------------------------------------------------- parallel plans
    def tp_plan(self) -> TensorParallelPlan:
        """q/k/v and the FFN's first layer column-wise, attention outputs and the FFN's second row-wise.

        Wan's rotary tables span one head and are broadcast over heads, so they need no change.
        """
        return TensorParallelPlan(
            colwise=(*(f"{a}.{p}" for a in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v")), "ffn.net.0.proj"),
            rowwise=("attn1.to_out.0", "attn2.to_out.0", "ffn.net.2"),
            attention=("attn1", "attn2"),
            head_norms=tuple(f"{a}.{n}" for a in ("attn1", "attn2") for n in ("norm_q", "norm_k")),
        )

    def cp_plan(self) -> ContextParallelPlan:
        """Split the tokens where the first block receives them (Wan patchifies inside its forward)
        and per-token timesteps (Wan 2.2 style) at the input; gather after proj_out."""
        return ContextParallelPlan(
            split_inputs={"": {"timestep": 1}, "blocks.0": {"hidden_states": 1}},
            gather_output="proj_out",
            self_attention=("attn1",),
        )

    # ----------------------------------------------------------------------------- tiny preset
    @classmethod
    def make_tiny(cls, out_dir, seed: int = 0) -> Path:
        """2-layer transformer, 3-level VAE (x4 time, x8 space), 2-layer UMT5; WanPipeline layout."""
        from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
        from transformers import UMT5Config, UMT5EncoderModel

        with seeded(seed):
            vae = AutoencoderKLWan(base_dim=16, z_dim=16, dim_mult=[1, 1, 2, 2], num_res_blocks=1,
                                   temperal_downsample=[False, True, True])
            transformer = WanTransformer3DModel(
                patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=16, in_channels=16,
                out_channels=16, text_dim=64, freq_dim=256, ffn_dim=128, num_layers=2, rope_max_seq_len=64,
            )
            text_encoder = UMT5EncoderModel(UMT5Config(vocab_size=1000, d_model=64, d_kv=16, d_ff=128,
                                                       num_layers=2, num_heads=4))
        # Wan2.1-T2V-1.3B-Diffusers' scheduler: UniPC on flow sigmas with shift 3.
        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                            num_train_timesteps=NUM_TRAIN_TIMESTEPS, flow_shift=3.0)
        pipeline = WanPipeline(tokenizer=build_t5_tokenizer(), text_encoder=text_encoder, vae=vae,
                               scheduler=scheduler, transformer=transformer)
        out = Path(out_dir)
        pipeline.save_pretrained(out, safe_serialization=True)
        return out


def _latent_stats(vae, like: Tensor) -> tuple[Tensor, Tensor]:
    """The VAE config's per-channel mean and std, shaped (1, C, 1, 1, 1) like `like`."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(shape).to(like)
    std = torch.tensor(vae.config.latents_std).view(shape).to(like)
    return mean, std
