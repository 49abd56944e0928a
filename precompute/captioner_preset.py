"""A tiny captioner for tests and the demo: a real transformers vision-language class (LlavaForConditionalGeneration:
a CLIP vision tower and a Llama) at a tiny size with random weights from a seed, its processor (CLIPImageProcessor,
a locally built Llama tokenizer, a chat template) saved beside it, so `caption_model` loads it through
AutoProcessor / AutoModelForImageTextToText as it loads a hub checkpoint. Weights are drawn wide (initializer_range
1.0) so the images steer the text: different clips get different (gibberish) captions.

Why Llava and not Qwen2.5-VL here: transformers' Qwen-VL processors include a video processor, which needs
torchvision; vt does not install it, and Llava's processor needs nothing more. The captioner's code is the same for
both (docs/processors.md).

    python scripts/make_tiny_captioner.py runs/models/captioner-tiny
"""

from __future__ import annotations

from pathlib import Path

from vt.shared.models.tiny import build_llama_tokenizer, seeded

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}:{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %} {{ part['text'] }}{% endif %}"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tiny_captioner(out: Path, seed: int = 0) -> Path:
    """The tiny captioner's folder at `out` (model, processor, tokenizer, chat template), the same for a seed."""
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    wide = 1.0
    with seeded(seed):
        tokenizer = build_llama_tokenizer()
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
        text = LlamaConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            hidden_size=16,
            intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            num_hidden_layers=2,
            vocab_size=len(tokenizer),
            initializer_range=wide,
        )
        vision = CLIPVisionConfig(  # 32 x 32 images in 8 x 8 patches: 16 image tokens each
            hidden_size=16,
            intermediate_size=32,
            projection_dim=16,
            num_attention_heads=4,
            num_hidden_layers=2,
            image_size=32,
            patch_size=8,
            initializer_range=wide,
        )
        config = LlavaConfig(
            vision_config=vision,
            text_config=text,
            pad_token_id=tokenizer.pad_token_id,
            image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
            initializer_range=wide,
        )
        model = LlavaForConditionalGeneration(config)
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessor(crop_size=32, size=32),
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's class token
    )
    out = Path(out)
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out
