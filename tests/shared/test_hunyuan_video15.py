"""HunyuanVideo 1.5 specifics the family-wide tests in test_models.py do not reach: the chat-template
crop of the local tokenizer, the glyph (ByT5) text, the text length the pipeline takes as an
attribute, the transformer's text-to-video inputs (less the masked tokens the pipeline feeds), what a
full fine-tune leaves frozen, and vt's own LoRA loader refusing unknown keys. Image-to-video against
HunyuanVideo15ImageToVideoPipeline: the first frame's SigLIP tokens and latents, the transformer's
inputs, exports loaded back, validation from stored conditions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers.lora_init import randomise_lora
from helpers.spec_inputs import CAPTIONS

FAMILY = "hunyuan-video-1.5"
BUCKET = Bucket(9, 64, 96)


def make_spec(folder):
    return build_spec(ModelConfig(family=FAMILY, path=str(folder), max_text_tokens=128), frame_rate=8.0)


def test_text_and_transformer_inputs_are_the_pipelines(tiny_model_factory, tmp_path):
    from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input
    from safetensors.torch import save_file

    from vt.shared.models.hunyuan_video15 import IMAGE_TOKENS, PROMPT_TEMPLATE_TOKENS
    from vt.shared.models.hunyuan_video15_lora import load_lora

    spec = make_spec(tiny_model_factory(FAMILY))  # max_text_tokens=128
    encoders = spec.load_stage1()
    captions = ["a rabbit in the meadow", 'a sign that reads "OPEN" on a street']
    batch = spec.encode_text(encoders, captions)

    # The pipeline crops its first 108 template tokens: the local tokenizer puts the caption right there.
    pipeline = spec.build_pipeline(spec.load_transformer(), **encoders)
    assert pipeline.tokenizer_max_length == 128 and "tokenizer_max_length = 128" in spec.inference_mismatches()[0]
    ids = pipeline.tokenizer.apply_chat_template(
        format_text_input(captions[:1], pipeline.system_message),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    tokens = pipeline.tokenizer.convert_ids_to_tokens(ids["input_ids"][0])
    assert tokens[PROMPT_TEMPLATE_TOKENS : PROMPT_TEMPLATE_TOKENS + 3] == ["a", "\u0120rabbit", "\u0120in"]
    expected = pipeline.encode_prompt(captions, device="cpu", batch_size=2)  # at tokenizer_max_length
    for name, tensor in zip(
        ("prompt_embeds", "prompt_attention_mask", "prompt_embeds_2", "prompt_attention_mask_2"), expected
    ):
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
        full = transformer(
            hidden_states=torch.cat([(1 - s) * latents + s * noise, torch.zeros(2, 5, 3, 4, 6)], 1),
            timestep=sigmas * 1000,
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_attention_mask=batch["prompt_attention_mask"],
            encoder_hidden_states_2=batch["prompt_embeds_2"],
            encoder_attention_mask_2=batch["prompt_attention_mask_2"],
            image_embeds=torch.zeros(2, IMAGE_TOKENS, 12),
            return_dict=False,
        )[0]
    torch.testing.assert_close(out.prediction, full, atol=1e-5, rtol=1e-5)

    # A full fine-tune trains every parameter that gets a gradient (DDP needs all of them to), and only
    # the last block's text-stream output, which never reaches the loss, stays frozen.
    spec.full_trainable(transformer)
    spec.forward(transformer, {**batch, "latents": latents}, sigmas, noise).prediction.square().mean().backward()
    frozen = {n for n, p in transformer.named_parameters() if not p.requires_grad}
    assert frozen and all(
        n.startswith(("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.ff_context.")) for n in frozen
    )
    assert all(p.grad is not None for p in transformer.parameters() if p.requires_grad)

    foreign = tmp_path / "single.safetensors"  # HunyuanVideo 1's single blocks: HunyuanVideo 1.5 has none
    save_file(
        {
            "diffusion_model.single_blocks.0.linear1.lora_A.weight": torch.zeros(4, 16),
            "diffusion_model.single_blocks.0.linear1.lora_B.weight": torch.zeros(16, 4),
        },
        str(foreign),
    )
    with pytest.raises(ValueError, match=r"linear1.*not a LoRA weight of a HunyuanVideo 1.5 module"):
        load_lora(pipeline, foreign)


# ----------------------------------------------------------------------------- image-to-video
I2V_BUCKET = Bucket(5, 64, 96)  # one of the tiny i2v transformer's output sizes (its target_size 80)


def make_i2v_spec(tiny_model_factory, **kw):
    return build_spec(
        ModelConfig(
            family=FAMILY, task="i2v", path=str(tiny_model_factory(FAMILY, task="i2v")), max_text_tokens=64, **kw
        ),
        frame_rate=8.0,
    )


def i2v_clip(seed: int):
    """(a clip (1, 3, F, H, W) in [-1, 1] whose first frame is `image`, the uint8 image (H, W, 3))."""
    image = np.random.default_rng(seed).integers(0, 256, (I2V_BUCKET.height, I2V_BUCKET.width, 3), dtype=np.uint8)
    first = torch.from_numpy(image).permute(2, 0, 1).float() / 127.5 - 1
    rest = (
        torch.rand(
            3, I2V_BUCKET.frames - 1, I2V_BUCKET.height, I2V_BUCKET.width, generator=torch.Generator().manual_seed(seed)
        )
        * 2
        - 1
    )
    return torch.cat([first[:, None], rest], dim=1)[None], image


def test_i2v_stage1_and_forward_are_the_pipelines(tiny_model_factory, tmp_path):
    """Stage 1 stores the pipeline's SigLIP tokens and image latents of the first frame; training feeds
    [noisy latents, image latents then zeros, mask 1 on the first latent frame] and the image tokens, as a
    pipeline step does (the same prediction as that step's whole call), loss on every frame; step-distilled
    (meanflow) checkpoints are refused."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Transformer3DModel
    from PIL import Image

    from vt.shared.provenance import weights_digests

    spec = make_i2v_spec(tiny_model_factory)
    assert spec.stage1_components[-2:] == ("image_encoder", "feature_extractor") and spec.image_conditions
    assert set(weights_digests(spec)) == set(spec.stage1_components)
    encoders = spec.load_stage1()
    clips, images = zip(*(i2v_clip(seed) for seed in (1, 2)))
    video = torch.cat(clips)
    out = spec.encode_video(encoders, video)
    shapes = spec.condition_shapes(I2V_BUCKET)
    assert set(out) == {"latents", "image_latents", "image_embeds"}
    for name, tensor in out.items():
        assert tensor.shape == (2, *shapes[name]) and tensor.dtype == torch.float32, name
    assert shapes["image_embeds"] == (16, 12)  # 4 x 4 SigLIP patches (729 on the real encoder), no class token

    folder = tiny_model_factory(FAMILY, task="i2v")
    pipeline = HunyuanVideo15ImageToVideoPipeline.from_pretrained(folder)
    assert pipeline.video_processor.calculate_default_height_width(64, 96, pipeline.target_size) == (64, 96)
    for i, image in enumerate(images):
        pil = Image.fromarray(image)
        torch.testing.assert_close(out["image_embeds"][i : i + 1], pipeline.encode_image(pil, 1, "cpu", torch.float32))
        latents = pipeline._get_image_latents(pipeline.vae, pipeline.video_processor, pil, 64, 96, "cpu")
        torch.testing.assert_close(out["image_latents"][i : i + 1], latents, atol=1e-5, rtol=1e-5)

    # One pipeline step's transformer call against training's at the same sigma, for the first sample.
    text = spec.encode_text(encoders, CAPTIONS[:1])
    batch = {**text, **{k: v[:1] for k, v in out.items()}}
    transformer = spec.load_transformer()
    seen = []
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    spec.build_pipeline(transformer, **encoders)(
        **spec.pipeline_inputs(CAPTIONS[0], I2V_BUCKET, 1, 0, images[0]), output_type="latent"
    )
    inference = seen.pop()
    sigma = inference["timestep"] / 1000
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(3))
    prediction = spec.forward(transformer, batch, sigma, noise)
    training = seen.pop()
    hidden = training["hidden_states"]
    assert hidden.shape == (1, 9, 2, 4, 6)
    torch.testing.assert_close(hidden[:, 4:], inference["hidden_states"][:, 4:], atol=1e-5, rtol=1e-5)
    assert (hidden[:, 8, 0] == 1).all() and (hidden[:, 8, 1] == 0).all() and (hidden[:, 4:8, 1] == 0).all()
    torch.testing.assert_close(training["image_embeds"], inference["image_embeds"])
    assert prediction.weight is None and torch.equal(prediction.target, noise - batch["latents"])
    with torch.no_grad():  # the pipeline's whole call: its padded text, for the noisy input training fed
        full = transformer(**{**inference, "hidden_states": hidden})[0]
    torch.testing.assert_close(prediction.prediction, full, atol=1e-5, rtol=1e-5)
    with pytest.raises(KeyError, match="precompute the shards with model.task"):
        spec.forward(transformer, {k: v for k, v in batch.items() if k != "image_embeds"}, sigma, noise)

    torch.manual_seed(0)
    distilled = tmp_path / "meanflow"
    HunyuanVideo15Transformer3DModel(**{**dict(transformer.config), "use_meanflow": True}).save_pretrained(distilled)
    with pytest.raises(ValueError, match=r"step-distilled \(meanflow\).*480p_i2v"):
        make_i2v_spec(tiny_model_factory, components={"transformer": str(distilled)}).check_bucket(I2V_BUCKET)


def test_i2v_exports_load_into_a_fresh_i2v_pipeline_and_validation_renders_from_stored_tokens(
    tiny_model_factory, tmp_path
):
    """vt's loader reads the diffusers and the ComfyUI file into a fresh HunyuanVideo15ImageToVideoPipeline,
    which then makes what the in-memory model makes; the full export too. Validation's pipeline, without the
    text encoders or SigLIP, renders from the conditions stage 1 stores (the image's SigLIP tokens among
    them) what the whole pipeline renders, at the size the pipeline picks for the image."""
    from diffusers import HunyuanVideo15ImageToVideoPipeline
    from peft.utils import get_peft_model_state_dict

    from vt.shared.validation_inputs import decode_conditions, encode_conditions

    folder = tiny_model_factory(FAMILY, task="i2v")
    spec = make_i2v_spec(tiny_model_factory)
    encoders = spec.load_stage1()
    _, image = i2v_clip(1)
    stored = {
        **spec.encode_validation_text(encoders, CAPTIONS[0]),
        **spec.image_conditions.encode(encoders, image),
        **{f"negative_{k}": v for k, v in spec.encode_validation_text(encoders, spec.negative_prompt).items()},
    }
    conditions = decode_conditions(encode_conditions(stored, torch.float32))  # as the window gives them back
    assert conditions["image_embeds"].shape == (1, 16, 12)

    def latents(pipeline):
        inputs = {**spec.pipeline_inputs(None, I2V_BUCKET, 2, 0, image), "output_type": "latent"}
        return pipeline(**inputs, **spec.pipeline_conditions(pipeline, conditions)).frames

    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    bare = spec.build_pipeline(transformer, text_encoders=False)
    assert bare.image_encoder is None and bare.feature_extractor is None and bare.text_encoder is None
    in_memory = latents(bare)
    for weight_name in ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors"):
        fresh = HunyuanVideo15ImageToVideoPipeline.from_pretrained(folder)
        fresh.set_progress_bar_config(disable=True)
        fresh.tokenizer_max_length = spec.max_text_tokens
        if weight_name.startswith("pytorch"):
            assert (latents(fresh) - in_memory).abs().max() > 1e-2
        spec.load_lora(fresh, tmp_path / "lora", weight_name=weight_name)
        torch.testing.assert_close(latents(fresh), in_memory, atol=1e-4, rtol=1e-4, msg=weight_name)

    frames = spec.generate(bare, None, I2V_BUCKET, steps=2, seed=0, image=image, conditions=conditions)
    whole = spec.generate(spec.build_pipeline(transformer, **encoders), CAPTIONS[0], I2V_BUCKET, 2, 0, image=image)
    assert frames.shape == (5, *spec.output_size(image), 3) == (5, 64, 96, 3)
    assert np.abs(frames.astype(int) - whole).max() <= 1
    other = {**conditions, **spec.image_conditions.encode(encoders, 255 - image)}
    moved = bare(
        **{**spec.pipeline_inputs(None, I2V_BUCKET, 2, 0, 255 - image), "output_type": "latent"},
        **spec.pipeline_conditions(bare, other),
    ).frames
    assert (moved - in_memory).abs().mean() > 1e-2, "the image did not condition the video"

    full = spec.load_transformer()
    with torch.no_grad():
        full.image_embedder.linear_1.weight.add_(0.5)  # the image branch is saved too
    out = spec.save_full(full, tmp_path / "full")
    override = make_i2v_spec(tiny_model_factory, components={"transformer": str(out)}).load_transformer()
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in override.state_dict().items())
