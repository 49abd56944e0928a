"""HunyuanVideo 1.5's tiny preset (`hunyuan_video15.py`): `parts(task)`, the pipeline's arguments at a tiny config."""

from __future__ import annotations

import inspect
from typing import Any

from vt.shared.models.hunyuan_video15 import PROMPT_TEMPLATE_TOKENS
from vt.shared.models.tiny import build_qwen_tokenizer, tiny_t5_encoder

INDEX_NAMES = {"feature_extractor": ["transformers", "SiglipImageProcessor"]}  # as the real checkpoints name it


def parts(task: str) -> dict[str, Any]:
    """diffusers' test sizes, the real geometry; i2v adds a SigLIP (16 tokens) and `target_size` 80, which makes
    64 x 96 one of the pipeline's output sizes."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    # The pipeline crops its first 108 template tokens after its system prompt: the tiny tokenizer's are as many.
    system = inspect.signature(HunyuanVideo15Pipeline._get_mllm_prompt_embeds).parameters["system_message"].default
    tokenizer, tokenizer_2 = build_qwen_tokenizer(system, PROMPT_TEMPLATE_TOKENS), ByT5Tokenizer()
    i2v = task == "i2v"
    transformer = HunyuanVideo15Transformer3DModel(
        in_channels=9,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=8,
        num_layers=2,
        num_refiner_layers=1,
        mlp_ratio=2.0,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=16,
        text_embed_2_dim=32,
        image_embed_dim=12,
        rope_axes_dim=(2, 2, 4),
        target_size=80 if i2v else 16,
        task_type=task,
    )
    vae = AutoencoderKLHunyuanVideo15(  # the real geometry: x4 time, x16 space
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
        downsample_match_channel=False,
        upsample_match_channel=False,
    )
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.pad_token_id,
            pad_token_id=tokenizer.pad_token_id,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
        )
    )
    text_encoder_2 = tiny_t5_encoder(vocab_size=len(tokenizer_2), d_model=32, d_kv=8, d_ff=37)
    parts = {}
    if i2v:
        siglip = SiglipVisionConfig(
            hidden_size=12,
            intermediate_size=24,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        parts = {
            "image_encoder": SiglipVisionModel(siglip),
            "feature_extractor": SiglipImageProcessor(size={"height": 32, "width": 32}),
        }
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)  # the 480p t2v checkpoint's
    return dict(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=1.0),
        **parts,
    )  # one transformer call per step
