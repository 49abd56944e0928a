"""The hunyuan_video15 family's tiny preset (`hunyuan_video15.py`): real classes at a tiny config, weights drawn from torch's
seeded RNG, tokenizers built here or in vt.shared.models.tiny; `parts(task)` are the pipeline's arguments."""

from __future__ import annotations

from typing import Any

from vt.shared.models.hunyuan_video15 import PROMPT_TEMPLATE_TOKENS
from vt.shared.models.tiny import build_qwen_tokenizer, tiny_t5_encoder


INDEX_NAMES = {"feature_extractor": ["transformers", "SiglipImageProcessor"]}  # as the real checkpoints name it


def parts(task: str) -> dict[str, Any]:
    """diffusers' test sizes (2 double blocks, 1 refiner layer, 2 heads x 8), patch 1, the real
    geometry (4-level VAE: x4 time, x16 space); 2-layer Qwen2.5-VL text model with a local byte-level
    BPE tokenizer and chat template, 2-layer ByT5-sized T5 encoder; the 480p t2v checkpoint's
    scheduler (flow-match Euler, shift 5); classifier-free guidance off (scale 1.0, one transformer
    call per step, as diffusers' own test) to keep CPU tests short.

    task "i2v": HunyuanVideo15ImageToVideoPipeline layout with a 2-layer SigLIP on 32 x 32 images
    (4 x 4 patches: 16 image tokens of width 12) and its processor; the transformer's `target_size` 80
    makes 64 x 96 (4 x 6 latent pixels) one of its output sizes (the 480p i2v checkpoint: 640)."""
    from diffusers import (AutoencoderKLHunyuanVideo15, ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler,
                           HunyuanVideo15Transformer3DModel)
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    from diffusers import HunyuanVideo15Pipeline

    # The pipeline crops its first 108 template tokens: the tiny tokenizer's system turn is that long too.
    tokenizer = build_qwen_tokenizer(_pipeline_system_message(HunyuanVideo15Pipeline), PROMPT_TEMPLATE_TOKENS)
    tokenizer_2 = ByT5Tokenizer()
    i2v = task == "i2v"
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1, text_embed_dim=16,
        text_embed_2_dim=32, image_embed_dim=12, rope_axes_dim=(2, 2, 4), target_size=80 if i2v else 16,
        task_type=task,
    )
    vae = AutoencoderKLHunyuanVideo15(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        spatial_compression_ratio=16, temporal_compression_ratio=4, downsample_match_channel=False,
        upsample_match_channel=False,
    )
    text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.pad_token_id, pad_token_id=tokenizer.pad_token_id,
        rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6}))
    text_encoder_2 = tiny_t5_encoder(vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=37)
    parts = tiny_siglip(width=12) if i2v else {}
    return dict(text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer, vae=vae,
                scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), text_encoder_2=text_encoder_2,
                tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=1.0), **parts)


def tiny_siglip(width: int) -> dict[str, Any]:
    """A 2-layer SigLIP vision encoder on 32 x 32 images in 8 x 8 patches (16 tokens) and its processor."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    encoder = SiglipVisionModel(SiglipVisionConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                                                   num_attention_heads=2, image_size=32, patch_size=8))
    return {"image_encoder": encoder, "feature_extractor": SiglipImageProcessor(size={"height": 32, "width": 32})}


def _pipeline_system_message(pipeline_class) -> str:
    """The system prompt HunyuanVideo15Pipeline puts before every caption (its encode default)."""
    import inspect

    return inspect.signature(pipeline_class._get_mllm_prompt_embeds).parameters["system_message"].default
