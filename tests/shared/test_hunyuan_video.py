"""HunyuanVideo: transformer inputs that match HunyuanVideoPipeline's (text, mask, pooled CLIP, guidance,
timestep), LoRA kept out of the text token refiner, and the fused ComfyUI export read back by diffusers'
own conversion at the real model's hidden size (tiny real models; the conversion on bare tensors).
Image-to-video against HunyuanVideoImageToVideoPipeline: Llava's text read with the first frame, the image
latents, both transformer kinds (token_replace, latent_concat), exports and validation from stored text."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.shared.weights.comfy import comfy_state_dict

from helpers.lora_init import randomise_lora

BUCKET = Bucket(5, 32, 48)
PROMPT = "a big rabbit walks in the meadow"


def make_spec(folder, **kw):
    return build_spec(ModelConfig(family="hunyuan-video", path=str(folder), max_text_tokens=16, **kw), frame_rate=8.0)


def capture(transformer):
    seen = []
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    return seen


def test_transformer_inputs_match_the_pipeline(tiny_model_factory):
    spec = make_spec(tiny_model_factory("hunyuan-video"))
    assert spec.prompt_template == {"template": "{}", "crop_start": 0}  # the tiny tokenizer has no chat headers
    assert spec.pipeline_inputs(PROMPT, BUCKET, 1, 0)["prompt_template"] == spec.prompt_template
    assert spec.guidance == 1.0  # trained at guidance 1 (as the peers train it); sampled at any
    assert spec.pipeline_default("guidance_scale") == 6.0
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer)
    seen = capture(transformer)
    pipeline(
        **spec.pipeline_inputs(PROMPT, BUCKET, steps=1, seed=0), guidance_scale=spec.guidance, output_type="latent"
    )
    inference = seen.pop()

    encoders = spec.load_stage1()
    batch = {**spec.encode_text(encoders, [PROMPT]), "latents": torch.zeros(1, *spec.latent_shape(BUCKET))}
    sigma = inference["timestep"] / 1000
    spec.forward(transformer, batch, sigma, torch.randn_like(batch["latents"]))
    training = seen.pop()
    for name in ("encoder_hidden_states", "encoder_attention_mask", "pooled_projections", "guidance"):
        torch.testing.assert_close(training[name], inference[name], msg=name)
    torch.testing.assert_close(training["timestep"], inference["timestep"])
    assert training["guidance"].tolist() == [1000.0]
    assert training["encoder_attention_mask"][0, :7].all() and not training["encoder_attention_mask"][0, -1]


@pytest.mark.parametrize("targets", [None, ["to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj"]])
def test_lora_never_targets_the_token_refiner(tiny_model_factory, targets):
    spec = make_spec(tiny_model_factory("hunyuan-video"))
    transformer = spec.load_transformer()
    assert any("token_refiner" in n and n.endswith("attn.to_q") for n, _ in transformer.named_modules())
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=targets)
    lora = [n for n, _ in transformer.named_parameters() if "lora_A" in n]
    assert lora and not any("token_refiner" in n for n in lora)
    assert {"transformer_blocks.0.attn.to_q", "single_transformer_blocks.0.attn.to_v"} <= {
        n.split(".lora_A")[0] for n in lora
    }
    with pytest.raises(ValueError, match="matched no layer .* outside the text token refiner"):
        spec.add_lora(spec.load_transformer(), rank=4, alpha=4.0, targets=[r"refiner_blocks.0.attn.to_q"])


def test_comfy_file_reads_back_through_diffusers_at_the_real_hidden_size(tiny_model_factory):
    """diffusers splits single_blocks.N.linear1 at hidden size 3072, so the single-block fusion is checked
    at that size on bare tensors: every module's B A (times alpha / r) comes back, proj_mlp's as zero."""
    from diffusers.loaders.lora_conversion_utils import _convert_hunyuan_video_lora_to_diffusers

    spec = make_spec(tiny_model_factory("hunyuan-video"))
    hidden, mlp, rank, alpha = 3072, 4 * 3072, 2, 8.0
    gen = torch.Generator().manual_seed(0)
    modules = {f"transformer_blocks.0.attn.{p}": hidden for p in ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj")}
    modules.update({f"single_transformer_blocks.0.attn.{p}": hidden for p in ("to_q", "to_k", "to_v")})
    modules["single_transformer_blocks.0.proj_out"] = hidden
    lora = {}
    for module, out in modules.items():
        lora[f"{module}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen)
        lora[f"{module}.lora_B.weight"] = torch.randn(out, rank, generator=gen)
    sizes = {
        "transformer_blocks.0.attn.add_q_proj": hidden,
        "transformer_blocks.0.attn.add_v_proj": hidden,
        "single_transformer_blocks.0.proj_mlp": mlp,
    }
    state = comfy_state_dict(
        lora,
        spec.original_names,
        rank,
        alpha,
        write_alpha=False,
        fused=spec.comfy_fused,
        out_features=sizes.__getitem__,
    )
    assert state["diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight"].shape == (3 * rank, hidden)
    assert state["diffusion_model.double_blocks.0.txt_attn_qkv.lora_B.weight"].shape == (3 * hidden, rank)
    assert state["diffusion_model.single_blocks.0.linear1.lora_B.weight"].shape == (3 * hidden + mlp, 3 * rank)
    assert "diffusion_model.single_blocks.0.linear2.lora_A.weight" in state
    assert not any(key.endswith(".alpha") for key in state)

    back = _convert_hunyuan_video_lora_to_diffusers(dict(state))
    scale = alpha / rank
    for module in modules:
        expected = scale * lora[f"{module}.lora_B.weight"] @ lora[f"{module}.lora_A.weight"]
        got = back[f"transformer.{module}.lora_B.weight"] @ back[f"transformer.{module}.lora_A.weight"]
        torch.testing.assert_close(got, expected, msg=module)
    for module in ("single_transformer_blocks.0.proj_mlp", "transformer_blocks.0.attn.add_q_proj"):
        assert not back[f"transformer.{module}.lora_B.weight"].any()


# ----------------------------------------------------------------------------- image-to-video
I2V_BUCKET = Bucket(5, 32, 48)
I2V_CAPTIONS = ["a big rabbit walks in the meadow", "people riding bikes on a sunny street"]  # the second is cut


def make_i2v_spec(tiny_model_factory, **kw):
    """HunyuanVideo I2V on its tiny preset (token_replace, as hunyuanvideo-community/HunyuanVideo-I2V)."""
    return make_spec(tiny_model_factory("hunyuan-video", task="i2v"), task="i2v", **kw)


def i2v_clip(seed: int) -> tuple[torch.Tensor, np.ndarray]:
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


def latent_concat_spec(tiny_model_factory, tmp_path):
    """The I2V preset with the 33-channel kind of transformer (latent_concat, no guidance embedding), as
    hunyuanvideo-community/HunyuanVideo-I2V-33ch, through model.components.transformer."""
    from vt.shared.models.presets.hunyuan_video import tiny_hunyuan_transformer

    folder = tmp_path / "latent_concat"
    torch.manual_seed(0)
    tiny_hunyuan_transformer(
        in_channels=9, guidance_embeds=False, image_condition_type="latent_concat"
    ).save_pretrained(folder)
    return make_i2v_spec(tiny_model_factory, components={"transformer": str(folder)})


def test_i2v_stage1_stores_what_the_pipeline_makes_of_the_first_frame(tiny_model_factory):
    """Llava's text of each caption read with its clip's first frame equals the I2V pipeline's own encoding
    (image tokens, then the caption cropped out of the chat template), CLIP's pooled text its encoding of the
    caption alone, and image_latents its prepare_latents of the frame; the text changes with the image."""
    from diffusers import HunyuanVideoImageToVideoPipeline
    from PIL import Image

    from vt.shared.provenance import weights_digests

    spec = make_i2v_spec(tiny_model_factory)
    assert spec.stage1_components[-1] == "image_processor" and spec.text_with_image
    assert set(weights_digests(spec)) == set(spec.stage1_components)  # shards name the image processor too
    template = spec.prompt_template  # the tiny tokenizer's own positions in the pipeline's template
    assert (template["image_emb_len"], spec.image_embed_interleave) == (16, 4)
    encoders = spec.load_stage1()
    tokenizer = encoders["tokenizer"]
    ids = tokenizer(template["template"].format(I2V_CAPTIONS[0])).input_ids
    assert tokenizer.convert_ids_to_tokens(ids[template["image_emb_start"]]) == "<image>"
    assert tokenizer.convert_ids_to_tokens(ids[template["crop_start"] : template["crop_start"] + 2]) == [
        "a",
        "\u2581big",
    ]

    clips, images = zip(*(i2v_clip(seed) for seed in (1, 2)))
    video = torch.cat(clips)
    text = spec.encode_text(encoders, I2V_CAPTIONS)
    assert set(text) == {"pooled_prompt_embeds"}  # the caption alone: per caption
    sample_text = spec.text_with_image.encode(encoders, I2V_CAPTIONS, video[:, :, 0])
    latents = spec.encode_video(encoders, video)
    shapes = spec.condition_shapes(I2V_BUCKET)
    for name, tensor in {**text, **sample_text, **latents}.items():
        assert tensor.shape == (2, *shapes[name]) and tensor.dtype == torch.float32, name
    assert sample_text["prompt_embeds"].shape[1] == 4 + 16 - 4  # 16 image tokens every 4th, the caption less 4

    pipeline = HunyuanVideoImageToVideoPipeline.from_pretrained(tiny_model_factory("hunyuan-video", task="i2v"))
    for i, (caption, image) in enumerate(zip(I2V_CAPTIONS, images)):
        pil = Image.fromarray(image)
        embeds, pooled, mask = pipeline.encode_prompt(
            image=pil, prompt=[caption], prompt_template=template, max_sequence_length=16, image_embed_interleave=4
        )
        torch.testing.assert_close(sample_text["prompt_embeds"][i : i + 1], embeds)
        torch.testing.assert_close(sample_text["prompt_attention_mask"][i : i + 1], mask.float())
        torch.testing.assert_close(text["pooled_prompt_embeds"][i : i + 1], pooled)
        frame = pipeline.video_processor.preprocess(pil, I2V_BUCKET.height, I2V_BUCKET.width)
        _, image_latents = pipeline.prepare_latents(
            frame,
            1,
            4,
            I2V_BUCKET.height,
            I2V_BUCKET.width,
            I2V_BUCKET.frames,
            torch.float32,
            "cpu",
            None,
            None,
            "token_replace",
        )
        torch.testing.assert_close(latents["image_latents"][i : i + 1], image_latents, atol=1e-5, rtol=1e-5)
    mask = sample_text["prompt_attention_mask"]
    assert mask[0, :12].all() and not mask[0, 12:].any() and mask[1].all()  # right padded; the cut caption fills
    other = spec.text_with_image.encode(encoders, I2V_CAPTIONS[:1], -video[:1, :, 0])["prompt_embeds"]
    assert (other - sample_text["prompt_embeds"][:1])[:, 4:].abs().max() > 1e-5, "the caption did not read the image"


def test_i2v_forward_feeds_the_pipelines_inputs_and_weights_the_clean_frame_zero(tiny_model_factory):
    """token_replace: the clean image latent stands in for the first latent frame (which the transformer
    modulates at timestep 0 and the pipeline never updates), weight 0 there; the Llava text, mask, pooled
    text, guidance and timestep are what a pipeline step feeds for the same caption and image."""
    spec = make_i2v_spec(tiny_model_factory)
    encoders = spec.load_stage1()
    video, image = i2v_clip(1)
    batch = {
        **spec.encode_text(encoders, I2V_CAPTIONS[:1]),
        **spec.text_with_image.encode(encoders, I2V_CAPTIONS[:1], video[:, :, 0]),
        **spec.encode_video(encoders, video),
    }
    transformer = spec.load_transformer()
    seen = capture(transformer)
    spec.build_pipeline(transformer, **encoders)(
        **spec.pipeline_inputs(I2V_CAPTIONS[0], I2V_BUCKET, 1, 0, image),
        guidance_scale=spec.guidance,
        output_type="latent",
    )
    inference = seen.pop()

    spec.add_lora(transformer, rank=4, alpha=4.0, targets=None)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(3))
    sigma = inference["timestep"] / 1000
    out = spec.forward(transformer, batch, sigma, noise)
    training = seen.pop()
    for name in ("encoder_hidden_states", "encoder_attention_mask", "pooled_projections", "guidance", "timestep"):
        torch.testing.assert_close(training[name], inference[name], msg=name)
    hidden = training["hidden_states"]
    assert hidden.shape == batch["latents"].shape  # 4 channels: nothing concatenated
    torch.testing.assert_close(hidden[:, :, :1], inference["hidden_states"][:, :, :1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[:, :, 1:], ((1 - sigma) * batch["latents"] + sigma * noise)[:, :, 1:])
    assert out.weight.flatten().tolist() == [0.0, 1.0] and torch.equal(out.target, noise - batch["latents"])
    ((out.prediction - out.target) ** 2 * out.weight).mean().backward()
    assert all(p.grad is not None for n, p in transformer.named_parameters() if "lora_" in n)
    with pytest.raises(KeyError, match="precompute the shards with model.task"):
        spec.forward(transformer, {k: v for k, v in batch.items() if k != "image_latents"}, sigma, noise)


def test_i2v_latent_concat_transformer_takes_the_image_on_the_channel_axis(tiny_model_factory, tmp_path):
    """latent_concat (33 channels on the real model): [noisy latents, image latents then zeros, mask 1 on
    the first latent frame], every 2nd image token, no guidance embedding, every frame trained, as a
    pipeline step feeds it; the task and the transformer kind must agree."""
    spec = latent_concat_spec(tiny_model_factory, tmp_path)
    assert spec.image_embed_interleave == 2
    encoders = spec.load_stage1()
    video, image = i2v_clip(1)
    batch = {
        **spec.encode_text(encoders, I2V_CAPTIONS[:1]),
        **spec.text_with_image.encode(encoders, I2V_CAPTIONS[:1], video[:, :, 0]),
        **spec.encode_video(encoders, video),
    }
    assert batch["prompt_embeds"].shape[1] == spec.condition_shapes(I2V_BUCKET)["prompt_embeds"][0] == 8 + 12
    transformer = spec.load_transformer()
    seen = capture(transformer)
    spec.build_pipeline(transformer, **encoders)(
        **spec.pipeline_inputs(I2V_CAPTIONS[0], I2V_BUCKET, 1, 0, image), output_type="latent"
    )
    inference = seen.pop()
    sigma = inference["timestep"] / 1000
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(3))
    out = spec.forward(transformer, batch, sigma, noise)
    training = seen.pop()
    for name in ("encoder_hidden_states", "encoder_attention_mask", "pooled_projections", "timestep"):
        torch.testing.assert_close(training[name], inference[name], msg=name)
    assert training["guidance"] is None and inference["guidance"] is None
    hidden = training["hidden_states"]
    assert hidden.shape == (1, 9, 2, 4, 6)
    torch.testing.assert_close(hidden[:, 4:], inference["hidden_states"][:, 4:], atol=1e-5, rtol=1e-5)
    assert (hidden[:, 8, 0] == 1).all() and (hidden[:, 8, 1:] == 0).all() and (hidden[:, 4:8, 1:] == 0).all()
    torch.testing.assert_close(hidden[:, :4], (1 - sigma) * batch["latents"] + sigma * noise)
    assert out.weight is None

    with pytest.raises(ValueError, match=r"needs a HunyuanVideo image-to-video transformer .*HunyuanVideo-I2V-33ch"):
        make_spec(tiny_model_factory("hunyuan-video"), task="i2v").check_bucket(I2V_BUCKET)
    with pytest.raises(ValueError, match=r"is an image-to-video one \(image_condition_type 'token_replace'\)"):
        make_spec(tiny_model_factory("hunyuan-video", task="i2v")).check_bucket(I2V_BUCKET)


def test_i2v_lora_and_full_exports_load_into_a_fresh_i2v_pipeline(tiny_model_factory, tmp_path):
    """The diffusers file and the ComfyUI file (double blocks: diffusers reads single blocks back only at
    the real size) through HunyuanVideoImageToVideoPipeline.load_lora_weights, and the full transformer
    through model.components, reproduce the in-memory model; the image conditions the video."""
    from diffusers import HunyuanVideoImageToVideoPipeline
    from peft.utils import get_peft_model_state_dict

    folder = tiny_model_factory("hunyuan-video", task="i2v")
    spec = make_i2v_spec(tiny_model_factory)
    _, image = i2v_clip(1)
    encoders = spec.load_stage1()  # the prompt's text once, not at every call
    text = {
        **spec.encode_validation_text(encoders, PROMPT),
        **spec.text_with_image.encode_validation(encoders, PROMPT, image),
    }

    def latents(pipeline):
        return pipeline(**spec.pipeline_inputs(None, I2V_BUCKET, 2, 0, image), **text, output_type="latent").frames

    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)")
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    in_memory = latents(spec.build_pipeline(transformer))
    for weight_name in ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors"):
        fresh = HunyuanVideoImageToVideoPipeline.from_pretrained(folder)
        fresh.set_progress_bar_config(disable=True)
        if weight_name.startswith("pytorch"):
            assert (latents(fresh) - in_memory).abs().max() > 1e-2
        spec.load_lora(fresh, tmp_path / "lora", weight_name=weight_name)
        torch.testing.assert_close(latents(fresh), in_memory, atol=1e-4, rtol=1e-4, msg=weight_name)

    full = spec.load_transformer()
    with torch.no_grad():
        full.x_embedder.proj.weight.add_(0.5)
    override = make_i2v_spec(tiny_model_factory, components={"transformer": str(spec.save_full(full, tmp_path / "m"))})
    pipeline = override.build_pipeline(override.load_transformer())
    assert isinstance(pipeline, HunyuanVideoImageToVideoPipeline)
    assert override.load_transformer().config.image_condition_type == "token_replace"
    frames = spec.generate(pipeline, PROMPT, I2V_BUCKET, steps=2, seed=0, image=image)
    assert frames.shape == (5, 32, 48, 3) and frames.std() > 0
    other = spec.generate(pipeline, PROMPT, I2V_BUCKET, steps=2, seed=0, image=255 - image)
    assert np.abs(frames.astype(int) - other).mean() > 1, "the image did not condition the video"


def test_i2v_validation_renders_from_stored_pair_conditions_without_text_encoders(tiny_model_factory):
    """Validation's pipeline has no Llava or CLIP: the conditions stage 1 stores (the prompt's pooled text,
    the prompt read with its image, the negative prompt's) give the video the whole pipeline makes."""
    from vt.shared.validation_inputs import decode_conditions, encode_conditions

    spec = make_i2v_spec(tiny_model_factory)
    encoders = spec.load_stage1()
    _, image = i2v_clip(2)
    stored = {
        **spec.encode_validation_text(encoders, PROMPT),
        **spec.text_with_image.encode_validation(encoders, PROMPT, image),
        **{f"negative_{k}": v for k, v in spec.encode_validation_text(encoders, spec.negative_prompt).items()},
    }
    conditions = decode_conditions(encode_conditions(stored, torch.float32))  # as the window gives them back
    assert set(conditions) >= {"prompt_embeds", "prompt_attention_mask", "pooled_prompt_embeds"}
    transformer = spec.load_transformer()
    bare = spec.build_pipeline(transformer, text_encoders=False)
    assert bare.text_encoder is None and bare.image_processor is None
    frames = spec.generate(bare, None, I2V_BUCKET, steps=2, seed=0, image=image, conditions=conditions)
    whole = spec.generate(spec.build_pipeline(transformer, **encoders), PROMPT, I2V_BUCKET, 2, 0, image=image)
    assert np.abs(frames.astype(int) - whole).max() <= 1
