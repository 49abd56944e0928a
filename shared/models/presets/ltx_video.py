"""LTX-Video's tiny preset (`ltx_video.py`): `parts(task)`, the pipeline's arguments: real classes at a tiny size."""

from __future__ import annotations

from typing import Any

import torch

from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """2-layer transformer, 4-level VAE (x8 time, x32 space), 2-layer T5 (one preset for both tasks)."""
    from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXVideoTransformer3DModel

    vae = AutoencoderKLLTXVideo(
        latent_channels=16,
        block_out_channels=(16, 16, 32, 32),
        decoder_block_out_channels=(16, 16, 32, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True, False),
        decoder_spatio_temporal_scaling=(True, True, True, False),
        patch_size=4,
        patch_size_t=1,
    )
    # Non-trivial normalisation statistics, so a wrong normalisation cannot go unnoticed.
    vae.latents_mean.copy_(torch.randn(16) * 0.1)
    vae.latents_std.copy_(torch.rand(16) + 0.5)
    transformer = LTXVideoTransformer3DModel(
        in_channels=16,
        out_channels=16,
        num_attention_heads=4,
        attention_head_dim=16,
        cross_attention_dim=64,
        num_layers=2,
        caption_channels=64,
    )
    text_encoder = tiny_t5_encoder()
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX-Video 0.9.x schedule
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return dict(
        scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=build_t5_tokenizer(), transformer=transformer
    )
