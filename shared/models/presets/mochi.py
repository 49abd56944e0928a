"""The mochi family's tiny preset (vt.shared.models.tiny): `parts(task)`, the pipeline's arguments."""

from __future__ import annotations

from typing import Any

import torch

from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """diffusers' test sizes (2 layers, 2 heads of 16 channels); the real VAE layout (x6 time, x8 space) and latent
    statistics at 32 channels per level without encoder attention (the slowest part on a CPU); a 2-layer T5; the
    checkpoint's scheduler (flow-match Euler, inverted sigmas); MochiPipeline layout."""
    from diffusers import AutoencoderKLMochi, FlowMatchEulerDiscreteScheduler, MochiTransformer3DModel

    transformer = MochiTransformer3DModel(
        patch_size=2,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=2,
        pooled_projection_dim=16,
        in_channels=12,
        qk_norm="rms_norm",
        text_embed_dim=64,
        time_embed_dim=32,
        activation_fn="swiglu",
        max_sequence_length=256,
    )
    with torch.no_grad():  # a fresh transformer's rotary frequencies are all zero: the rotary embedding unchecked
        transformer.pos_frequencies.normal_(std=0.5)
    vae = AutoencoderKLMochi(
        latent_channels=12,
        out_channels=3,
        encoder_block_out_channels=(32,) * 4,
        decoder_block_out_channels=(32,) * 4,
        layers_per_block=(1,) * 5,
        add_attention_block=(False,) * 5,
    )
    return dict(
        scheduler=FlowMatchEulerDiscreteScheduler(invert_sigmas=True),
        vae=vae,
        text_encoder=tiny_t5_encoder(),
        tokenizer=build_t5_tokenizer(model_max_length=256),
        transformer=transformer,
    )
