"""Kandinsky 5's tiny preset (`kandinsky5.py`): `parts(task)`, the pipeline's arguments at a tiny config."""

from __future__ import annotations

from typing import Any

from vt.shared.models.kandinsky5 import PROMPT_TEMPLATE_TOKENS
from vt.shared.models.presets.hunyuan_video import tiny_hunyuan_vae
from vt.shared.models.tiny import TINY_WORDS, add_merge_chain, build_clip_tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VISION_TOKENS = {
    "vision_start_token_id": "<|vision_start|>",
    "vision_end_token_id": "<|vision_end|>",
    "image_token_id": "<|image_pad|>",
    "video_token_id": "<|video_pad|>",
}


def parts(task: str) -> dict[str, Any]:
    """diffusers' test sizes, visual_cond on (as every release); one preset for both tasks."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2VPipeline, Kandinsky5Transformer3DModel
    from transformers import CLIPTextConfig, CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    prefix = Kandinsky5T2VPipeline(*([None] * 7)).prompt_template.split("{}")[0]
    tokenizer, tokenizer_2 = build_template_tokenizer(prefix, PROMPT_TEMPLATE_TOKENS), build_clip_tokenizer()
    transformer = Kandinsky5Transformer3DModel(
        in_visual_dim=4,
        out_visual_dim=4,
        in_text_dim=16,
        in_text_dim2=8,
        time_dim=16,
        patch_size=(1, 2, 2),
        model_dim=16,
        ff_dim=32,
        num_text_blocks=1,
        num_visual_blocks=1,
        axes_dims=(2, 2, 4),
        visual_cond=True,
    )
    for name, module in transformer.named_modules():
        if name.endswith("modulation"):  # drawn: the class zeroes them, which would leave every block an identity
            module.out_layer.reset_parameters()
    vae = tiny_hunyuan_vae()
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}
    text_encoder = Qwen2_5_VLForConditionalGeneration(
        Qwen2_5_VLConfig(
            text_config=dict(
                vocab_size=len(tokenizer),
                hidden_size=16,
                intermediate_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.pad_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6},
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=16,
                num_heads=2,
                out_hidden_size=16,
                fullatt_block_indexes=[0],
            ),
            **ids,
        )
    )
    text_encoder_2 = CLIPTextModel(
        CLIPTextConfig(
            bos_token_id=tokenizer_2.bos_token_id,
            eos_token_id=tokenizer_2.eos_token_id,
            pad_token_id=tokenizer_2.pad_token_id,
            hidden_size=8,
            intermediate_size=37,
            num_attention_heads=2,
            num_hidden_layers=2,
            vocab_size=len(tokenizer_2),
            hidden_act="gelu",
            projection_dim=8,
        )
    )
    return dict(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
    )  # Lite's


def build_template_tokenizer(prefix: str, template_tokens: int, words: list[str] = TINY_WORDS):
    """A byte-level BPE Qwen2 tokenizer (Qwen's own pre-tokenizer) over a pipeline's prompt template and `words`,
    right padded, whose template before the caption (`prefix`) is exactly the `template_tokens` the pipeline crops,
    as with the real Qwen2.5-VL tokenizer: each of its pre-tokens is one token (a merge chain), except the few
    longest once-only words, which stop one merge short (two tokens each) until the count is reached."""
    import regex
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    specials = [*SPECIAL_TOKENS, *VISION_TOKENS.values()]
    vocab = {token: index for index, token in enumerate(specials)}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(char, len(vocab))
    to_bytes = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    pieces = [
        to_bytes.pre_tokenize_str(piece)[0][0]
        for text in regex.split(r"<\|im_start\|>|<\|im_end\|>", prefix)
        for piece in regex.findall(PRETOKENIZE_REGEX, text)
    ]
    split = template_tokens - len(pieces) - prefix.count("<|im_")
    once = sorted({p for p in pieces if pieces.count(p) == 1 and len(p) > 3}, key=lambda p: (-len(p), p))
    if split < 0 or split > len(once):
        raise AssertionError(
            f"the prompt template has {len(pieces)} pre-tokens: no {template_tokens}-token tiny tokenizer"
        )
    merges: list[tuple[str, str]] = []
    for piece in pieces:
        if len(piece) > 1:
            add_merge_chain(list(piece[:-1] if piece in once[:split] else piece), vocab, merges)
    for word in words:
        add_merge_chain(list(f"\u0120{word}"), vocab, merges)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, padding_side="right", model_max_length=4096)
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    count = len(tokenizer(prefix)["input_ids"])
    if count != template_tokens:
        raise AssertionError(f"the tiny Qwen tokenizer makes {count} template tokens, not {template_tokens}")
    return tokenizer
