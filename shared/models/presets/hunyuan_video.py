"""HunyuanVideo's tiny preset (`hunyuan_video.py`): `parts(task)`, the pipeline's arguments at a tiny config."""

from __future__ import annotations

from typing import Any

from vt.shared.models.hunyuan_video import LLAVA_CHAT_TOKENS
from vt.shared.models.tiny import TINY_WORDS, add_merge_chain, bpe_vocab, build_clip_tokenizer, build_llama_tokenizer

INDEX_NAMES = {"image_processor": ["transformers", "CLIPImageProcessor"]}  # as the real checkpoints name it


def parts(task: str) -> dict[str, Any]:
    """diffusers' test sizes; i2v: the token_replace transformer (as HunyuanVideo-I2V) and a Llava."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from transformers import (
        CLIPImageProcessor,
        CLIPTextConfig,
        CLIPTextModel,
        CLIPVisionConfig,
        LlamaConfig,
        LlamaModel,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    i2v = task == "i2v"
    tokenizer, tokenizer_2 = build_llava_tokenizer() if i2v else build_llama_tokenizer(), build_clip_tokenizer()
    transformer = tiny_hunyuan_transformer(**({"image_condition_type": "token_replace"} if i2v else {}))
    vae = tiny_hunyuan_vae()
    llama = LlamaConfig(  # i2v: 3 layers, so the pipeline's third-to-last hidden states have read the image
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        hidden_size=16,
        intermediate_size=37,
        num_attention_heads=4,
        num_hidden_layers=3 if i2v else 2,
        vocab_size=len(tokenizer),
        hidden_act="gelu",
    )
    if i2v:  # 32 x 32 images in 8 x 8 patches: 16 image tokens
        vision = CLIPVisionConfig(
            hidden_size=8,
            intermediate_size=37,
            projection_dim=32,
            num_attention_heads=4,
            num_hidden_layers=2,
            image_size=32,
            patch_size=8,
        )
        text_encoder = LlavaForConditionalGeneration(
            LlavaConfig(
                vision_config=vision,
                text_config=llama,
                pad_token_id=tokenizer.pad_token_id,
                image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            )
        )
    else:
        text_encoder = LlamaModel(llama)
    text_encoder_2 = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=tokenizer_2.bos_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
            pad_token_id=tokenizer_2.pad_token_id,
            hidden_size=8,
            intermediate_size=37,
            num_attention_heads=4,
            num_hidden_layers=2,
            vocab_size=len(tokenizer_2),
            hidden_act="gelu",
            projection_dim=32,
        )
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=7.0)  # hunyuanvideo-community/HunyuanVideo's
    parts = {"image_processor": CLIPImageProcessor(crop_size=32, size=32)} if i2v else {}
    return dict(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=transformer,
        vae=vae,
        scheduler=scheduler,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        **parts,
    )


def tiny_hunyuan_transformer(**config):
    """The tiny preset's transformer; `config` overrides (I2V: image_condition_type, in_channels, ...)."""
    from diffusers import HunyuanVideoTransformer3DModel

    settings = dict(
        in_channels=4,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=10,
        num_layers=1,
        num_single_layers=1,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        guidance_embeds=True,
        text_embed_dim=16,
        pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4),
    )
    return HunyuanVideoTransformer3DModel(**{**settings, **config})


def tiny_hunyuan_vae():
    """HunyuanVideo's VAE at 4 levels (x4 time, x8 space, 4 channels); Kandinsky 5's and 6's presets take it too."""
    from diffusers import AutoencoderKLHunyuanVideo

    return AutoencoderKLHunyuanVideo(
        in_channels=3,
        out_channels=3,
        latent_channels=4,
        down_block_types=("HunyuanVideoDownBlock3D",) * 4,
        up_block_types=("HunyuanVideoUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8),
        layers_per_block=1,
        act_fn="silu",
        norm_num_groups=4,
        scaling_factor=0.476986,
        spatial_compression_ratio=8,
        temporal_compression_ratio=4,
        mid_block_add_attention=True,
    )


def build_llava_tokenizer(words: list[str] = TINY_WORDS):
    """The tiny Llama tokenizer (right padded) with what the I2V pipeline's chat template needs to be
    tokenized as the real Llama-3 one is: the header, end-of-turn and `<image>` tokens, and "system",
    "user", "assistant" and "\n\n" as one token each (its crop drops the 4 tokens before the assistant's
    turn); the template's own words are whole tokens too, so its system turn is about 100 tokens, not 300."""
    import re

    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_image2video import DEFAULT_PROMPT_TEMPLATE
    from transformers import LlamaTokenizer

    template_words = re.findall(r"[A-Za-z]+", DEFAULT_PROMPT_TEMPLATE["template"].split("<image>")[1])
    words = list(dict.fromkeys([*words, *template_words]))
    vocab, merges = bpe_vocab(words, ["<unk>", "<s>", "</s>", "<pad>"], prefix="\u2581")
    vocab.setdefault("\n", len(vocab))
    for word in ("system", "user", "assistant", "\n\n"):
        add_merge_chain(list(word), vocab, merges)
    tokenizer = LlamaTokenizer(
        vocab=vocab,
        merges=merges,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        padding_side="right",
        model_max_length=1024,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(LLAVA_CHAT_TOKENS)})
    return tokenizer
