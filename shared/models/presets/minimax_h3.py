"""MiniMax H3's tiny preset (`minimax_h3.py`): `parts(task)`, the pipeline's arguments: real classes at a tiny size."""

from __future__ import annotations

from typing import Any

from vt.shared.models.minimax_h3 import TEXT_LAYER
from vt.shared.models.tiny import build_qwen_tokenizer


def parts(task: str) -> dict[str, Any]:
    """Tiny real classes: a 51-layer Qwen3-VL of width 16 (the pipeline reads hidden state 50), a 4-level video VAE
    (x16 space, x4 time, 17-frame chunks, 4 channels), a 4-level audio VAE (hop 200 at 8 kHz, a rate AAC writes: 40
    latents/s as the real one), a 2-block DiT of width 32, the pipeline's two schedulers (shift 12 video, 3 audio)."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tokenizer = build_qwen_tokenizer(system="<|h3_system|>", header_tokens=8)
    vision = {
        "image_token_id": "<|image_pad|>",
        "video_token_id": "<|video_pad|>",
        "vision_start_token_id": "<|vision_start|>",
        "vision_end_token_id": "<|vision_end|>",
    }
    tokenizer.add_tokens(list(vision.values()), special_tokens=True)  # Qwen3-VL's, which the processor needs
    ids = {key: tokenizer.convert_tokens_to_ids(token) for key, token in vision.items()}
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=TEXT_LAYER + 1,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True},
                pad_token_id=tokenizer.pad_token_id,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=16,
                num_heads=2,
                out_hidden_size=16,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                deepstack_visual_indexes=[],
            ),
            **ids,
        )
    )
    latent = 4
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=latent,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2),
        temporal_downsample_factors=(1, 2, 2, 1),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=2,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=1,
        latents_mean=[0.1 * i for i in range(latent)],
        latents_std=[0.5 + 0.25 * i for i in range(latent)],
    )
    audio_vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=2,
        encoder_rates=(2, 4, 5, 5),
        latent_dim=8,
        latent_channels=latent,
        num_attention_heads=2,
        decoder_dim=16,
        decoder_rates=(5, 5, 4, 2),
        decoder_kernel_sizes=(10, 10, 8, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        sampling_rate=8000,
        latents_mean=[-0.05 * i for i in range(latent)],
        latents_std=[0.4 + 0.2 * i for i in range(latent)],
    )
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=32,
        in_channels=latent,
        audio_in_channels=latent,
        patch_size=(1, 2, 2),
        text_dim=16,
        freq_dim=16,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    )
    return dict(
        transformer=transformer,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        scheduler=MiniMaxH3Scheduler(shift=12.0),
        audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
    )
