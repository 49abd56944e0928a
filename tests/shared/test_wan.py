"""Wan 2.1: image-to-video (CLIP image tokens + encoded first frame) through stage 1, forward and export."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers.family_cases import BUCKET
from helpers.lora_init import randomise_lora
from helpers.spec_inputs import (
    CAPTIONS,
    capture_transformer_inputs,
    folder_digest,
    make_spec,
    pipeline_latents,
    uint8_video,
)


# ----------------------------------------------------------------------------- Wan image-to-video
def make_wan_i2v_spec(tiny_model_factory, **kw):
    """Wan 2.1 I2V on its tiny preset; the text length is the pipeline's 512 (the only one i2v takes)."""
    return build_spec(
        ModelConfig(family="wan", task="i2v", path=str(tiny_model_factory("wan", task="i2v")), **kw), frame_rate=8.0
    )


WAN_I2V_IMAGE = np.random.default_rng(0).integers(0, 256, (BUCKET.height, BUCKET.width, 3), dtype=np.uint8)


def test_wan_i2v_refuses_other_text_lengths_and_non_i2v_transformers(tiny_model_factory):
    with pytest.raises(ValueError, match=r"max_text_tokens = 16, but Wan image-to-video needs exactly 512"):
        make_spec(tiny_model_factory("wan", task="i2v"), "wan", task="i2v")  # max_text_tokens=16
    spec = make_wan_i2v_spec(tiny_model_factory, max_text_tokens=512)
    assert spec.max_text_tokens == 512 and not spec.inference_mismatches()
    with pytest.raises(ValueError, match=r"needs a Wan 2.1 image-to-video transformer \(in_channels 36"):
        build_spec(ModelConfig(family="wan", task="i2v", path=str(tiny_model_factory("wan"))), 8.0).check_bucket(BUCKET)
    with pytest.raises(ValueError, match=r"is an image-to-video one .*set model.task = \"i2v\""):
        make_spec(tiny_model_factory("wan", task="i2v"), "wan").check_bucket(BUCKET)


def test_wan_i2v_stage1_conditions_as_the_pipeline_does(tiny_model_factory):
    """Image embeddings equal the pipeline's encode_image of the first frame, and [mask, condition
    latents] its prepare_latents condition for the same frame; both stored per sample, float32."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    spec = make_wan_i2v_spec(tiny_model_factory)
    assert spec.stage1_components == ("tokenizer", "text_encoder", "vae", "image_encoder", "image_processor")
    assert {"image_encoder", "image_processor"} <= set(spec.component_names())
    from vt.shared.provenance import weights_digests

    assert set(weights_digests(spec)) == set(spec.stage1_components)  # shards name the image encoder's files
    encoders = spec.load_stage1()
    clip, pixels = uint8_video(2)
    out = spec.encode_video(encoders, clip)
    assert set(out) == {"latents", "image_embeds", "condition_latents"}
    assert out["latents"].shape == out["condition_latents"].shape == (2, 16, 3, 8, 12)
    assert out["image_embeds"].shape == (2, 17, 32)  # 4 x 4 patches + the class token, CLIP hidden size
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in out.values())

    pipeline = WanImageToVideoPipeline.from_pretrained(tiny_model_factory("wan", task="i2v"))
    for i in range(2):
        image = Image.fromarray(pixels[i, 0].numpy())
        torch.testing.assert_close(out["image_embeds"][i : i + 1], pipeline.encode_image(image, "cpu"))
        frame = pipeline.video_processor.preprocess(image, height=BUCKET.height, width=BUCKET.width)
        _, condition = pipeline.prepare_latents(
            frame,
            1,
            16,
            BUCKET.height,
            BUCKET.width,
            BUCKET.frames,
            torch.float32,
            "cpu",
            torch.Generator().manual_seed(0),
        )
        assert condition.shape == (1, 20, 3, 8, 12)
        torch.testing.assert_close(condition[:, :4], spec.condition_mask(out["latents"][i : i + 1]))
        torch.testing.assert_close(condition[:, 4:], out["condition_latents"][i : i + 1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out["condition_latents"][:, :, 1:], out["latents"][:, :, 1:], atol=1e-2)


def test_wan_i2v_forward_feeds_36_channels_and_image_tokens_and_trains_lora_only(tiny_model_factory):
    spec = make_wan_i2v_spec(tiny_model_factory)
    encoders = spec.load_stage1()
    batch = {**spec.encode_text(encoders, CAPTIONS), **spec.encode_video(encoders, uint8_video(2)[0])}
    assert batch["prompt_embeds"].shape == (2, 512, 64)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=None)
    assert any("attn2.add_k_proj.lora_A" in n for n, _ in transformer.named_parameters())  # i2v default targets
    seen = capture_transformer_inputs(transformer)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    sigmas = torch.tensor([0.2, 0.9])
    out = spec.forward(transformer, batch, sigmas, noise)

    hidden = seen["hidden_states"]
    assert hidden.shape == (2, 36, 3, 8, 12)
    torch.testing.assert_close(
        hidden[:, :16], (1 - sigmas.view(2, 1, 1, 1, 1)) * batch["latents"] + sigmas.view(2, 1, 1, 1, 1) * noise
    )
    assert (hidden[:, 16:20, 0] == 1).all() and (hidden[:, 16:20, 1:] == 0).all()
    assert torch.equal(hidden[:, 20:], batch["condition_latents"])
    assert torch.equal(seen["encoder_hidden_states_image"], batch["image_embeds"])
    torch.testing.assert_close(seen["timestep"], sigmas * 1000)
    assert torch.equal(out.target, noise - batch["latents"]) and out.weight is None  # loss on every frame
    loss = ((out.prediction - out.target) ** 2).mean()
    assert torch.isfinite(loss)
    loss.backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    assert with_grad and with_grad == {n for n, p in transformer.named_parameters() if "lora_" in n}
    assert transformer.get_parameter("blocks.1.attn2.add_k_proj.lora_B.default.weight").grad.abs().sum() > 0
    with pytest.raises(KeyError, match="precompute the shards with model.task"):
        spec.forward(transformer, {k: v for k, v in batch.items() if k != "image_embeds"}, sigmas, noise)


def test_wan_i2v_lora_export_loads_into_a_fresh_i2v_pipeline(tiny_model_factory, tmp_path):
    """The diffusers file and the ComfyUI file (image keys/values as cross_attn.k_img / v_img) each
    reproduce the in-memory model through WanImageToVideoPipeline.load_lora_weights."""
    from diffusers import WanImageToVideoPipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    folder = tiny_model_factory("wan", task="i2v")
    spec = make_wan_i2v_spec(tiny_model_factory)
    assert spec.pipeline_class() is WanImageToVideoPipeline
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    comfy = load_file(tmp_path / "lora" / "lora_comfyui.safetensors")
    assert {
        "diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight",
        "diffusion_model.blocks.1.cross_attn.v_img.lora_B.weight",
    } <= set(comfy)

    in_memory = pipeline_latents(spec, spec.build_pipeline(transformer), image=WAN_I2V_IMAGE)
    for weight_name in ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors"):
        fresh = WanImageToVideoPipeline.from_pretrained(folder)
        fresh.set_progress_bar_config(disable=True)
        if weight_name.startswith("pytorch"):
            assert (pipeline_latents(spec, fresh, image=WAN_I2V_IMAGE) - in_memory).abs().max() > 1e-2
        fresh.load_lora_weights(tmp_path / "lora", weight_name=weight_name)
        torch.testing.assert_close(pipeline_latents(spec, fresh, image=WAN_I2V_IMAGE), in_memory, atol=1e-4, rtol=1e-4)


def test_wan_i2v_full_export_round_trips_and_generates_from_an_image(tiny_model_factory, tmp_path):
    from diffusers import WanImageToVideoPipeline

    folder = tiny_model_factory("wan", task="i2v")
    spec = make_wan_i2v_spec(tiny_model_factory)
    transformer = spec.load_transformer()
    with torch.no_grad():
        transformer.condition_embedder.image_embedder.ff.net[2].weight.add_(0.5)  # the image branch is saved too
    out = spec.save_full(transformer, tmp_path / "full")
    override = build_spec(
        ModelConfig(family="wan", task="i2v", path=str(folder), components={"transformer": str(out)}), 8.0
    ).load_transformer()
    expected = transformer.state_dict()
    assert override.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in override.state_dict().items())
    assert override.config.in_channels == 36 and override.config.added_kv_proj_dim == 64

    pipeline = spec.build_pipeline(override)
    assert isinstance(pipeline, WanImageToVideoPipeline) and pipeline.transformer is override
    frames = spec.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0, image=WAN_I2V_IMAGE)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0
    other = spec.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0, image=255 - WAN_I2V_IMAGE)
    assert np.abs(frames.astype(int) - other).mean() > 1, "the image did not condition the video"
    with pytest.raises(ValueError, match="wan i2v generation needs an image"):
        spec.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0)


def test_make_tiny_builds_the_wan_i2v_preset_deterministically(tiny_model_factory, tmp_path):
    import json

    import make_tiny_model

    make_tiny_model.main(["--family", "wan", "--task", "i2v", str(tmp_path / "again")])
    assert folder_digest(tmp_path / "again") == folder_digest(tiny_model_factory("wan", task="i2v"))
    index = json.loads((tmp_path / "again" / "model_index.json").read_text())
    assert index["_class_name"] == "WanImageToVideoPipeline"
    assert index["image_encoder"] == ["transformers", "CLIPVisionModelWithProjection"]
    assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
    with pytest.raises(ValueError, match=r"family 'wan' has no task 'v2v'"):
        make_tiny_model.make_tiny_model("wan", tmp_path / "x", task="v2v")


# ----------------------------------------------------------------------------- Wan first-and-last-frame (FLF2V)
def make_wan_flf2v_spec(tiny_model_factory, **kw):
    """Wan 2.1 FLF2V on its tiny preset (the i2v preset with FLF2V's image position embedding)."""
    return build_spec(
        ModelConfig(family="wan", task="flf2v", path=str(tiny_model_factory("wan", task="flf2v")), **kw), frame_rate=8.0
    )


FLF2V_LAST = np.random.default_rng(1).integers(0, 256, (BUCKET.height, BUCKET.width, 3), dtype=np.uint8)


def flf2v_latents(spec, pipeline, first=WAN_I2V_IMAGE, last=FLF2V_LAST):
    """The denoised latents of a 2-step first-and-last-frame run (no guidance batch: half the work)."""
    inputs = spec.pipeline_inputs("a rabbit in a meadow", BUCKET, steps=2, seed=0, image=first, last_image=last)
    return pipeline(**inputs, guidance_scale=1.0, output_type="latent").frames.float()


def test_wan_flf2v_takes_only_flf2v_transformers_and_checks_its_last_images(tiny_model_factory, tmp_path):
    from vt.shared.config import ConfigError, load_config

    i2v, flf2v = (str(tiny_model_factory("wan", task=task)) for task in ("i2v", "flf2v"))
    with pytest.raises(
        ValueError,
        match=r"model.task = \"flf2v\" needs a Wan 2.1 first-and-last-frame transformer "
        r"\(pos_embed_seq_len 34.*has pos_embed_seq_len None",
    ):
        build_spec(ModelConfig(family="wan", task="flf2v", path=i2v), 8.0).check_bucket(BUCKET)
    with pytest.raises(
        ValueError,
        match=r"first-and-last-frame one \(pos_embed_seq_len 34\): set model.task = "
        r"\"flf2v\"",
    ):
        build_spec(ModelConfig(family="wan", task="i2v", path=flf2v), 8.0).check_bucket(BUCKET)
    with pytest.raises(ValueError, match=r"image-to-video one .*\(or \"flf2v\": it takes two images\)"):
        make_spec(flf2v, "wan").check_bucket(BUCKET)
    spec = make_wan_flf2v_spec(tiny_model_factory)
    assert spec.stage1_components[-2:] == ("image_encoder", "image_processor") and spec.image_conditions
    assert spec.condition_shapes(BUCKET)["image_embeds"] == (2, 17, 32)  # [first, last] x CLIP tokens x width
    with pytest.raises(ValueError, match=r"flf2v conditions on the first and last frames"):
        spec.check_bucket(Bucket(1, 64, 96))
    with pytest.raises(ValueError, match=r"wan flf2v generation needs a last_image"):
        spec.pipeline_inputs("a rabbit", BUCKET, 2, 0, image=WAN_I2V_IMAGE)
    with pytest.raises(ValueError, match=r"task 'i2v' takes no last image; use model.task = \"flf2v\""):
        make_wan_i2v_spec(tiny_model_factory).pipeline_inputs(
            "a rabbit", BUCKET, 2, 0, image=WAN_I2V_IMAGE, last_image=FLF2V_LAST
        )

    sets = ['validation.prompts=["a", "b"]', 'validation.images=["x.png", "y.png"]']
    with pytest.raises(ConfigError, match=r"validation.last_images has 1 entries for 2 validation.prompts"):
        load_config(None, ['model.task="flf2v"', *sets, 'validation.last_images=["z.png"]'])
    with pytest.raises(ConfigError, match=r"only model.task = \"flf2v\" .* this run's task is 'i2v'; remove it"):
        load_config(None, ['model.task="i2v"', *sets, 'validation.last_images=["z.png", "w.png"]'])
    config = load_config(None, ['model.task="flf2v"', *sets, 'validation.last_images=["z.png", "w.png"]'])
    assert config.validation.last_images == ["z.png", "w.png"]


def test_wan_flf2v_stage1_conditions_as_the_pipeline_does(tiny_model_factory):
    """Per sample: both frames' CLIP embeddings equal the pipeline's encode_image([first, last]), and
    [mask, condition latents] its prepare_latents(..., last_image=) for the clip's first and last frames."""
    from diffusers import WanImageToVideoPipeline
    from PIL import Image

    spec = make_wan_flf2v_spec(tiny_model_factory)
    clip, pixels = uint8_video(2)
    out = spec.encode_video(spec.load_stage1(), clip)
    assert out["image_embeds"].shape == (2, 2, 17, 32) and out["condition_latents"].shape == (2, 16, 3, 8, 12)

    pipeline = WanImageToVideoPipeline.from_pretrained(tiny_model_factory("wan", task="flf2v"))
    for i in range(2):
        first, last = Image.fromarray(pixels[i, 0].numpy()), Image.fromarray(pixels[i, -1].numpy())
        torch.testing.assert_close(out["image_embeds"][i], pipeline.encode_image([first, last], "cpu"))
        frames = [
            pipeline.video_processor.preprocess(image, height=BUCKET.height, width=BUCKET.width)
            for image in (first, last)
        ]
        _, condition = pipeline.prepare_latents(
            frames[0],
            1,
            16,
            BUCKET.height,
            BUCKET.width,
            BUCKET.frames,
            torch.float32,
            "cpu",
            torch.Generator().manual_seed(0),
            None,
            frames[1],
        )
        mask = spec.condition_mask(out["latents"][i : i + 1])
        torch.testing.assert_close(condition[:, :4], mask)
        assert mask[0, :, :, 0, 0].tolist() == [[1, 0, 0], [1, 0, 0], [1, 0, 0], [1, 0, 1]]  # the last frame's slot
        torch.testing.assert_close(condition[:, 4:], out["condition_latents"][i : i + 1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out["condition_latents"][:, :, -1], out["latents"][:, :, -1], atol=1e-2)  # causal VAE


def test_wan_flf2v_forward_feeds_what_the_pipeline_feeds_and_trains_lora_only(tiny_model_factory):
    """Training on a clip whose first and last frames are the pipeline's two images gives the transformer the
    pipeline's own [mask, condition] channels, its (2, N, D) image tokens of [first, last] and its text."""
    from PIL import Image

    spec = make_wan_flf2v_spec(tiny_model_factory)
    encoders = spec.load_stage1()
    clip, pixels = uint8_video(1)
    batch = {**spec.encode_text(encoders, CAPTIONS[:1]), **spec.encode_video(encoders, clip)}
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=None)
    seen = capture_transformer_inputs(transformer)
    pipeline = spec.build_pipeline(transformer, **encoders)
    first, last = (Image.fromarray(pixels[0, index].numpy()) for index in (0, -1))
    inputs = spec.pipeline_inputs(CAPTIONS[0], BUCKET, steps=1, seed=0, image=first, last_image=last)
    pipeline(**inputs, guidance_scale=1.0, output_type="latent")  # one pass per step: no guidance batch
    inference = dict(seen)

    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, torch.tensor([0.6]), noise)
    assert seen["hidden_states"].shape == inference["hidden_states"].shape == (1, 36, 3, 8, 12)
    torch.testing.assert_close(seen["hidden_states"][:, 16:], inference["hidden_states"][:, 16:], atol=1e-5, rtol=1e-5)
    assert seen["encoder_hidden_states_image"].shape == (2, 17, 32)
    torch.testing.assert_close(seen["encoder_hidden_states_image"], inference["encoder_hidden_states_image"])
    torch.testing.assert_close(seen["encoder_hidden_states"], inference["encoder_hidden_states"])
    torch.testing.assert_close(seen["timestep"], torch.tensor([600.0]))
    assert torch.equal(out.target, noise - batch["latents"]) and out.weight is None  # loss on every frame
    ((out.prediction - out.target) ** 2).mean().backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    assert with_grad and with_grad == {n for n, p in transformer.named_parameters() if "lora_" in n}
    assert transformer.get_parameter("blocks.0.attn2.add_v_proj.lora_B.default.weight").grad.abs().sum() > 0
    swapped = {**batch, "image_embeds": batch["image_embeds"].flip(1)}  # the position embedding tells them apart
    with torch.no_grad():
        assert not torch.allclose(
            spec.forward(transformer, swapped, torch.tensor([0.6]), noise).prediction, out.prediction, atol=1e-4
        )


def test_wan_flf2v_exports_load_back_and_validation_renders_from_both_images(tiny_model_factory, tmp_path):
    """The LoRA file and the full weights give WanImageToVideoPipeline the in-memory model (the ComfyUI file's
    keys are i2v's: test_comfy_keys.py); the last image conditions the video; and validation's
    text-encoder-free pipeline, fed the stored conditions (prompt, negative prompt, both images' embeddings
    named as the Validator names them), renders what the pipeline renders from the prompt and images."""
    from diffusers import WanImageToVideoPipeline
    from peft.utils import get_peft_model_state_dict

    folder = tiny_model_factory("wan", task="flf2v")
    spec = make_wan_flf2v_spec(tiny_model_factory)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    in_memory = flf2v_latents(spec, spec.build_pipeline(transformer))
    fresh = WanImageToVideoPipeline.from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    spec.load_lora(fresh, tmp_path / "lora")
    torch.testing.assert_close(flf2v_latents(spec, fresh), in_memory, atol=1e-4, rtol=1e-4)

    full = spec.load_transformer()
    with torch.no_grad():
        full.condition_embedder.image_embedder.pos_embed.add_(0.5)  # FLF2V's own parameter is saved too
    override = build_spec(
        ModelConfig(
            family="wan",
            task="flf2v",
            path=str(folder),
            components={"transformer": str(spec.save_full(full, tmp_path / "full"))},
        ),
        8.0,
    ).load_transformer()
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in override.state_dict().items())
    assert override.config.pos_embed_seq_len == 34
    encoders = spec.load_stage1()
    pipeline = spec.build_pipeline(override, **encoders)
    ends = [flf2v_latents(spec, pipeline, last=last)[:, :, -1] for last in (FLF2V_LAST, 255 - FLF2V_LAST)]
    assert (ends[0] - ends[1]).abs().mean() > 1e-2, "the last image did not condition the video"
    frames = spec.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0, image=WAN_I2V_IMAGE, last_image=FLF2V_LAST)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0

    negative = spec.encode_validation_text(encoders, spec.negative_prompt)
    conditions = {
        **spec.encode_validation_text(encoders, "a rabbit"),
        **{f"negative_{k}": v for k, v in negative.items()},
        **spec.image_conditions.encode(encoders, WAN_I2V_IMAGE),
        **{f"last_{k}": v for k, v in spec.image_conditions.encode(encoders, FLF2V_LAST).items()},
    }
    bare = spec.build_pipeline(override, text_encoders=False, vae=encoders["vae"])
    assert bare.image_encoder is None and bare.text_encoder is None
    stored = spec.generate(
        bare, None, BUCKET, steps=2, seed=0, image=WAN_I2V_IMAGE, last_image=FLF2V_LAST, conditions=conditions
    )
    assert np.abs(stored.astype(int) - frames).max() <= 1
