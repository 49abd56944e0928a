"""The wan family's tiny preset (vt.shared.models.tiny): `parts(task)`, the pipeline's arguments."""

from __future__ import annotations

from typing import Any

import torch

from vt.shared.models.flow import NUM_TRAIN_TIMESTEPS
from vt.shared.models.tiny import build_t5_tokenizer, tiny_t5_encoder
from vt.shared.models.wan import IMAGE_TASKS

INDEX_NAMES = {"image_processor": ["transformers", "CLIPImageProcessor"]}  # as the real checkpoints name it
# The tiny Wan DiT (SkyReels V2's and VACE's too): 2 layers of 4 heads x 16, patch 1x2x2, text width 64.
TINY_DIT = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=16,
    text_dim=64,
    freq_dim=256,
    ffn_dim=128,
    num_layers=2,
    rope_max_seq_len=64,
)


def parts(task: str) -> dict[str, Any]:
    """WanPipeline's layout; i2v: Wan 2.1 I2V's (WanImageToVideoPipeline); flf2v: also FLF2V's position embedding
    over two images' tokens, drawn non-zero (diffusers starts it at zeros) so the order of the two images shows."""
    vae = tiny_wan_vae()
    flf2v = {"pos_embed_seq_len": 2 * 17} if task == "flf2v" else {}
    transformer = tiny_wan_transformer(out_channels=16, **image_channels(task in IMAGE_TASKS), **flf2v)
    if task == "flf2v":
        with torch.no_grad():
            transformer.condition_embedder.image_embedder.pos_embed.normal_(0.0, 0.5)
    text_encoder = tiny_t5_encoder(umt5=True)
    parts = tiny_image_parts(32) if task in IMAGE_TASKS else {}
    # Wan2.1-T2V-1.3B-Diffusers' (and I2V-480P's) scheduler: UniPC on flow sigmas with shift 3.
    return dict(
        tokenizer=build_t5_tokenizer(),
        text_encoder=text_encoder,
        vae=vae,
        scheduler=flow_unipc_scheduler(3.0),
        transformer=transformer,
        **parts,
    )


def image_channels(i2v: bool) -> dict[str, int]:
    """16 latent channels; i2v 36 ([noisy, mask, condition]) and projections of 32-wide CLIP tokens to 4 x 16."""
    return dict(in_channels=36, image_dim=32, added_kv_proj_dim=64) if i2v else dict(in_channels=16)


def tiny_wan_vae(z_dim: int = 16, base_dim: int = 16, **config):
    """The Wan VAE at 3 levels of tiny width `base_dim` (x4 time, x8 space unless `config` says otherwise)."""
    from diffusers import AutoencoderKLWan

    return AutoencoderKLWan(
        base_dim=base_dim,
        z_dim=z_dim,
        dim_mult=[1, 1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        **config,
    )


def tiny_wan_transformer(**config):
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel(**TINY_DIT, **config)


def flow_unipc_scheduler(shift: float):
    """The Wan checkpoints' scheduler: UniPC on flow sigmas with `shift`."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=NUM_TRAIN_TIMESTEPS,
        flow_shift=shift,
    )


def tiny_image_parts(hidden: int) -> dict[str, Any]:
    """A 2-layer CLIP vision encoder (32 x 32 images in 8 x 8 patches: 16 + 1 tokens) and its processor."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=hidden,
            projection_dim=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
    )
    return {"image_encoder": encoder, "image_processor": CLIPImageProcessor(crop_size=32, size=32)}
