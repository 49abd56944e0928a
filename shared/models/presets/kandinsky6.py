"""Kandinsky 6's tiny preset (`kandinsky6.py`): `parts(task)`, the pipeline's arguments at a tiny config."""

from __future__ import annotations

from typing import Any


def parts(task: str) -> dict[str, Any]:
    """Kandinsky 5's tiny parts, two fused blocks with the release's switches, MMAudio's VAE and vocoder at 8 kHz with a
    mel hop of 64 (62.5 latents a second; the real one: 44.1 kHz, 43). One preset for both tasks."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6Transformer3DModel, MMAudioVAE, MMAudioVocoder
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE, _QWEN_CROP_START

    from vt.shared.models.presets.kandinsky5 import build_template_tokenizer
    from vt.shared.models.presets.kandinsky5 import parts as kandinsky5_parts

    shared = kandinsky5_parts(task)  # its VAE, CLIP and Qwen2.5-VL at the same tiny widths
    tokenizer = build_template_tokenizer(_PROMPT_TEMPLATE.split("{}")[0], _QWEN_CROP_START)
    text_encoder = shared["text_encoder"]
    text_encoder.resize_token_embeddings(len(tokenizer))
    latent = 4
    transformer = Kandinsky6Transformer3DModel(  # padded text, cross-stream RoPE and gates, two token types
        in_visual_dim=latent,
        out_visual_dim=latent,
        in_text_dim=16,
        in_text_dim2=8,
        time_dim=16,
        patch_size=(1, 2, 2),
        model_dim=16,
        ff_dim=32,
        num_text_blocks=1,
        num_visual_blocks=2,
        axes_dims=(2, 2, 4),
        visual_cond=True,
        in_audio_dim=latent,
        out_audio_dim=latent,
        model_dim_a=16,
        time_dim_a=16,
        ff_dim_a=32,
        axes_dims_a=(2, 2, 4),
        text_token_padding=True,
        ca_rope=True,
        cross_gates=True,
        fix_modulation=True,
        visual_token_type_num_embeddings=2,
    )
    audio_vae = MMAudioVAE(
        mel_bins=16,
        latent_channels=latent,
        hidden_channels=8,
        channel_multipliers=(1, 2),
        layers_per_block=1,
        sample_rate=8000,
        n_fft=256,
        hop_length=64,
    )
    vocoder = MMAudioVocoder(
        num_mels=16,
        upsample_initial_channel=16,
        upsample_rates=(4, 4, 4),
        upsample_kernel_sizes=(8, 8, 8),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
    )
    return dict(
        transformer=transformer,
        vae=shared["vae"],
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=shared["text_encoder_2"],
        tokenizer_2=shared["tokenizer_2"],
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        audio_vae=audio_vae,
        vocoder=vocoder,
    )
