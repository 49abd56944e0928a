"""The wan22_ti2v family's tiny preset (vt.shared.models.tiny): `parts(task)`, the pipeline's arguments."""

from __future__ import annotations

from typing import Any

import torch

from vt.shared.models.components import load_class
from vt.shared.models.presets.wan import flow_unipc_scheduler, tiny_wan_transformer, tiny_wan_vae
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """A 2-layer 48-channel transformer, a 3-level residual 48-channel VAE (patch 2: x16 space, x4 time, non-trivial
    latent statistics) and UMT5; the checkpoint's scheduler (shift 5)."""
    z_dim = 48
    stats = torch.rand(2, z_dim)
    vae = tiny_wan_vae(
        z_dim,
        in_channels=12,
        out_channels=12,
        is_residual=True,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=(stats[0] - 0.5).tolist(),
        latents_std=(stats[1] + 0.5).tolist(),
    )
    transformer = tiny_wan_transformer(in_channels=z_dim, out_channels=z_dim)
    return dict(
        tokenizer=build_t5_tokenizer(),
        text_encoder=tiny_t5_encoder(umt5=True),
        vae=vae,
        scheduler=flow_unipc_scheduler(5.0),
        transformer=transformer,
        expand_timesteps=True,
    )


def pipeline(task: str) -> type:
    """WanPipeline for both tasks, as the TI2V-5B checkpoint saves it (i2v loads it as WanImageToVideoPipeline)."""
    return load_class("diffusers:WanPipeline")
