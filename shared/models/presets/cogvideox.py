"""The cogvideox family's tiny preset (vt.shared.models.tiny): `parts(task)`, the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder


def parts(task: str) -> dict[str, Any]:
    """2-layer RoPE transformer (the 5B's layout; RoPE takes any bucket and text length), 4-level VAE (x4 time,
    x8 space), 2-layer T5, the CogVideoX-5b scheduler; CogVideoXPipeline layout. i2v: CogVideoXImageToVideoPipeline's,
    the transformer taking twice the latent channels, without the 5B-I2V's learned positional embedding (it would
    tie the preset to one bucket size and the 226-token text; tests/shared/test_cogvideox.py checks that rule)."""
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXTransformer3DModel

    vae = AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 8, 8),
        latent_channels=16,
        layers_per_block=1,
        norm_num_groups=4,
        temporal_compression_ratio=4,
        sample_height=64,
        sample_width=96,
        scaling_factor=0.7,
    )
    transformer = CogVideoXTransformer3DModel(
        num_attention_heads=4,
        attention_head_dim=16,
        in_channels=32 if task == "i2v" else 16,
        out_channels=16,
        time_embed_dim=32,
        text_embed_dim=64,
        num_layers=2,
        sample_height=8,
        sample_width=12,
        sample_frames=9,
        patch_size=2,
        temporal_compression_ratio=4,
        use_rotary_positional_embeddings=True,
    )
    # THUDM/CogVideoX-5b's scheduler (the 2B differs only in snr_shift_scale = 3.0).
    scheduler = CogVideoXDDIMScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        clip_sample=False,
        set_alpha_to_one=True,
        steps_offset=0,
        prediction_type="v_prediction",
        timestep_spacing="trailing",
        rescale_betas_zero_snr=True,
        snr_shift_scale=1.0,
    )
    return dict(
        tokenizer=build_t5_tokenizer(model_max_length=226),
        text_encoder=tiny_t5_encoder(),
        vae=vae,
        transformer=transformer,
        scheduler=scheduler,
    )
