"""The ltx2 family's tiny presets (`ltx2.py`): real classes at a tiny config, weights drawn from torch's seeded RNG;
`parts(task)` (LTX-2.0) and `parts_23(task)` (LTX-2.3) are the pipeline's arguments."""

from __future__ import annotations

from typing import Any

import torch

from vt.shared.models.tiny import build_gemma_tokenizer

# diffusers' test sizes, what the 2.0 and 2.3 presets share: the transformer (2 layers, video 2 heads x 8, audio 2 x 4),
# the text connectors (widths: heads x head dim) and the vocoder. The vocoder upsamples x160 in all: one waveform sample
# per mel hop of the audio VAE (16 kHz / 160), so the sound lasts as long as the frames, as the real x240 to 24 kHz.
TRANSFORMER = dict(
    in_channels=8,
    out_channels=8,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=2,
    attention_head_dim=8,
    cross_attention_dim=16,
    audio_in_channels=4,
    audio_out_channels=4,
    audio_num_attention_heads=2,
    audio_attention_head_dim=4,
    audio_cross_attention_dim=8,
    num_layers=2,
    qk_norm="rms_norm_across_heads",
    caption_channels=16,
    rope_double_precision=False,
    rope_type="split",
)
CONNECTORS = dict(
    caption_channels=16,
    text_proj_in_factor=2 + 1,
    video_connector_num_attention_heads=2,
    video_connector_attention_head_dim=8,
    video_connector_num_layers=1,
    video_connector_num_learnable_registers=None,
    audio_connector_num_attention_heads=2,
    audio_connector_num_layers=1,
    audio_connector_num_learnable_registers=None,
    connector_rope_base_seq_len=32,
    rope_double_precision=False,
    rope_type="split",
)
VOCODER = dict(
    in_channels=2 * 8,
    hidden_channels=32,
    out_channels=2,
    upsample_kernel_sizes=[10, 8, 8, 4],
    upsample_factors=[5, 4, 4, 2],
    resnet_kernel_sizes=[3],
    resnet_dilations=[[1, 3, 5]],
)


def parts(task: str) -> dict[str, Any]:
    """The shared transformer, connectors (each the text width) and vocoder; the audio VAE at diffusers' test widths
    but with LTX-2's three levels (its encoder downsamples x4 in time and mel bins, as the pipeline's audio latent shape
    assumes); a 4-level video VAE (x8 time, x32 space, 8 channels); a 2-layer Gemma 3 with a locally built tokenizer;
    one preset for both tasks, saved in LTX2Pipeline's layout or (i2v) LTX2ImageToVideoPipeline's."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    tokenizer = build_gemma_tokenizer()
    text_encoder = Gemma3ForConditionalGeneration(
        Gemma3Config(
            text_config=Gemma3TextConfig(
                vocab_size=len(tokenizer),
                hidden_size=CONNECTORS["caption_channels"],
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=8,
                sliding_window=16,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
            ),
            vision_config=SiglipVisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
        )
    )
    connectors = LTX2TextConnectors(**CONNECTORS, audio_connector_attention_head_dim=8)
    vae = AutoencoderKLLTX2Video(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        patch_size=4,
        patch_size_t=1,
        decoder_inject_noise=(False,) * 4,
        spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    )
    # Non-trivial normalisation statistics, so a wrong normalisation cannot go unnoticed.
    vae.latents_mean.copy_(torch.randn(8) * 0.1)
    vae.latents_std.copy_(torch.rand(8) + 0.5)
    transformer = LTX2VideoTransformer3DModel(**TRANSFORMER)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4,
        output_channels=2,
        ch_mult=(1, 1, 1),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=2,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=8,
    )
    audio_vae.latents_mean.copy_(torch.randn(4) * 0.1)  # per (channel, mel bin) of a latent frame, as for video
    audio_vae.latents_std.copy_(torch.rand(4) + 0.5)
    vocoder = LTX2Vocoder(**VOCODER, leaky_relu_negative_slope=0.1, output_sampling_rate=16000)
    scheduler = FlowMatchEulerDiscreteScheduler(  # LTX's token-count shift (LTX2Pipeline's mu defaults)
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
        shift_terminal=0.1,
    )
    return dict(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )


def parts_23(task: str) -> dict[str, Any]:
    """An LTX-2.3 tiny preset: `parts` with 2.3's transformer (gated attention, prompt and cross-attention modulation,
    no caption projection: the connectors project per modality), text connectors (`per_modality_projections`, the
    video and audio embeddings at each stream's width) and vocoder with bandwidth extension (16 -> 32 kHz), as
    diffusers' conversion configures LTX-2.3."""
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2VocoderWithBWE

    built = parts(task)
    built["transformer"] = LTX2VideoTransformer3DModel(
        **TRANSFORMER,
        gated_attn=True,
        cross_attn_mod=True,
        audio_gated_attn=True,
        audio_cross_attn_mod=True,
        use_prompt_embeddings=False,
        perturbed_attn=True,
    )
    built["connectors"] = LTX2TextConnectors(
        **CONNECTORS,
        audio_connector_attention_head_dim=4,
        video_gated_attn=True,
        audio_gated_attn=True,
        per_modality_projections=True,
        video_hidden_dim=16,
        audio_hidden_dim=8,
        proj_bias=True,
    )
    built["vocoder"] = LTX2VocoderWithBWE(
        **VOCODER,
        bwe_in_channels=2 * 8,
        bwe_hidden_channels=16,
        bwe_out_channels=2,
        bwe_upsample_kernel_sizes=[8, 4],
        bwe_upsample_factors=[4, 2],
        bwe_resnet_kernel_sizes=[3],
        bwe_resnet_dilations=[[1, 3, 5]],
        filter_length=32,
        hop_length=4,
        window_length=32,
        num_mel_channels=8,
        input_sampling_rate=16000,
        output_sampling_rate=32000,
    )
    return built
