"""HunyuanVideo 1.5 specifics the family-wide tests in test_models.py do not reach: the chat-template
crop of the local tokenizer, the glyph (ByT5) text, the text length the pipeline takes as an
attribute, the transformer's text-to-video inputs (less the masked tokens the pipeline feeds), what a
full fine-tune leaves frozen, and vt's own LoRA loader refusing unknown keys."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

FAMILY = "hunyuan-video-1.5"
BUCKET = Bucket(9, 64, 96)


def make_spec(folder):
    return build_spec(ModelConfig(family=FAMILY, path=str(folder), max_text_tokens=128), frame_rate=8.0)


def test_text_and_transformer_inputs_are_the_pipelines(tiny_model_factory, tmp_path):
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
    from safetensors.torch import save_file

    from vt.shared.models.hunyuan_video15 import IMAGE_TOKENS, PROMPT_TEMPLATE_TOKENS, load_lora

    spec = make_spec(tiny_model_factory(FAMILY))  # max_text_tokens=128
    encoders = spec.load_stage1()
    captions = ["a rabbit in the meadow", 'a sign that reads "OPEN" on a street']
    batch = spec.encode_text(encoders, captions)

    # The pipeline crops its first 108 template tokens: the local tokenizer puts the caption right there.
    pipeline = spec.build_pipeline(spec.load_transformer(), **encoders)
    assert pipeline.tokenizer_max_length == 128 and "tokenizer_max_length = 128" in spec.inference_mismatches()[0]
    ids = pipeline.tokenizer.apply_chat_template(format_text_input(captions[:1], pipeline.system_message),
                                                 add_generation_prompt=True, tokenize=True, return_dict=True)
    tokens = pipeline.tokenizer.convert_ids_to_tokens(ids["input_ids"][0])
    assert tokens[PROMPT_TEMPLATE_TOKENS:PROMPT_TEMPLATE_TOKENS + 3] == ["a", "\u0120rabbit", "\u0120in"]
    expected = pipeline.encode_prompt(captions, device="cpu", batch_size=2)  # at tokenizer_max_length
    for name, tensor in zip(("prompt_embeds", "prompt_attention_mask", "prompt_embeds_2", "prompt_attention_mask_2"),
                            expected):
        torch.testing.assert_close(batch[name], tensor.float())
    # ByT5 sees only quoted text: none in the first caption (zeros, masked), "OPEN" in the second.
    assert batch["prompt_attention_mask_2"][0].sum() == 0 and batch["prompt_embeds_2"][0].abs().sum() == 0
    assert batch["prompt_attention_mask_2"][1].sum() > 0

    # Training feeds [noisy latents, zero condition, zero mask] and leaves out what the masks drop (the
    # pipeline's 729 zero image tokens, text padding): the prediction equals the pipeline-style call's.
    seen = {}
    transformer = spec.load_transformer()
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    latents = torch.randn(2, *spec.latent_shape(BUCKET), generator=torch.Generator().manual_seed(0))
    noise, sigmas = torch.randn_like(latents), torch.tensor([0.25, 0.75])
    out = spec.forward(transformer, {**batch, "latents": latents}, sigmas, noise)
    assert seen["hidden_states"].shape == (2, 9, 3, 4, 6) and (seen["hidden_states"][:, 4:] == 0).all()
    assert seen["encoder_hidden_states"].shape[1] == 64 < batch["prompt_embeds"].shape[1] == 128
    assert seen["encoder_hidden_states_2"].shape[1] == 64 < 256 and seen["image_embeds"].shape[1] == 0
    torch.testing.assert_close(seen["timestep"], torch.tensor([250.0, 750.0]))
    s = sigmas.view(2, 1, 1, 1, 1)
    with torch.no_grad():
        full = transformer(hidden_states=torch.cat([(1 - s) * latents + s * noise, torch.zeros(2, 5, 3, 4, 6)], 1),
                           timestep=sigmas * 1000, encoder_hidden_states=batch["prompt_embeds"],
                           encoder_attention_mask=batch["prompt_attention_mask"],
                           encoder_hidden_states_2=batch["prompt_embeds_2"],
                           encoder_attention_mask_2=batch["prompt_attention_mask_2"],
                           image_embeds=torch.zeros(2, IMAGE_TOKENS, 12), return_dict=False)[0]
    torch.testing.assert_close(out.prediction, full, atol=1e-5, rtol=1e-5)

    # A full fine-tune trains every parameter that gets a gradient (DDP needs all of them to), and only
    # the last block's text-stream output, which never reaches the loss, stays frozen.
    spec.full_trainable(transformer)
    spec.forward(transformer, {**batch, "latents": latents}, sigmas, noise).prediction.square().mean().backward()
    frozen = {n for n, p in transformer.named_parameters() if not p.requires_grad}
    assert frozen and all(n.startswith(("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.ff_context."))
                          for n in frozen)
    assert all(p.grad is not None for p in transformer.parameters() if p.requires_grad)

    foreign = tmp_path / "single.safetensors"  # HunyuanVideo 1's single blocks: HunyuanVideo 1.5 has none
    save_file({"diffusion_model.single_blocks.0.linear1.lora_A.weight": torch.zeros(4, 16),
               "diffusion_model.single_blocks.0.linear1.lora_B.weight": torch.zeros(16, 4)}, str(foreign))
    with pytest.raises(ValueError, match=r"linear1.*not a LoRA weight of a HunyuanVideo 1.5 module"):
        load_lora(pipeline, foreign)
