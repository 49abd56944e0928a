"""Model Spec API on the tiny presets of both families: real diffusers/transformers classes throughout."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import FAMILIES, build_spec, get_spec_class
from vt.shared.models.components import ModelLoadError

BUCKET = Bucket(9, 64, 96)
FAMILY_PARAMS = pytest.mark.parametrize("family", FAMILIES)


def _ltx_denormalize(latents, vae):  # LTXPipeline's own inverse, as used before vae.decode
    from diffusers import LTXPipeline

    return LTXPipeline._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def _wan_denormalize(latents, vae):  # WanPipeline: latents / (1 / std) + mean
    shape = (1, -1, 1, 1, 1)
    return latents / (1.0 / torch.tensor(vae.config.latents_std).view(shape)) + torch.tensor(
        vae.config.latents_mean).view(shape)


def _has_padding_mask(batch):  # padded captions are masked
    mask = batch["prompt_attention_mask"]
    return mask.shape == batch["prompt_embeds"].shape[:2] and 0 < mask.sum() < mask.numel()


def _zero_past_caption(batch):  # no mask: embeddings are zero past the caption's tokens
    return batch["prompt_embeds"][:, -1].abs().sum() == 0 and batch["prompt_embeds"][:, 0].abs().sum() > 0


# What each family's tiny preset must show; a new family adds its entry.
EXPECTED = {
    "ltx-video": dict(frames_step=8, side=32, latent=(16, 2, 2, 3), text_dim=64, text_tokens=128, patch=1,
                      text_padding=_has_padding_mask, denormalize=_ltx_denormalize,
                      comfy_key="diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight"),
    "wan": dict(frames_step=4, side=16, latent=(16, 3, 8, 12), text_dim=64, text_tokens=512, patch=2,
                text_padding=_zero_past_caption, denormalize=_wan_denormalize,
                comfy_key="diffusion_model.blocks.0.self_attn.q.lora_A.weight"),
}
CAPTIONS = ["a big rabbit walks in the meadow", "people riding bikes on a sunny street"]


def make_spec(folder, family, **kw):
    return build_spec(ModelConfig(family=family, path=str(folder), max_text_tokens=16, **kw), frame_rate=8.0)


def video(batch=2, seed=0):
    return torch.rand(batch, 3, BUCKET.frames, BUCKET.height, BUCKET.width,
                      generator=torch.Generator().manual_seed(seed)) * 2 - 1


def stage1(spec, batch=2):
    encoders = spec.load_stage1()
    return {**spec.encode_text(encoders, CAPTIONS[:batch]), **spec.encode_video(encoders, video(batch))}


def pipeline_latents(spec, pipeline, image=None):
    """The denoised latents of a 2-step run: finer than uint8 frames for comparing transformers."""
    inputs = spec.pipeline_inputs("a rabbit in a meadow", BUCKET, steps=2, seed=0, image=image)
    return pipeline(**inputs, output_type="latent").frames.float()


def folder_digest(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*.safetensors"))}


# ----------------------------------------------------------------------------- registry and loading
def test_registry_names_families_and_rejects_unknown():
    assert {"ltx-video", "wan"} <= set(FAMILIES) and set(FAMILIES) == set(EXPECTED)
    assert all(get_spec_class(family).family == family for family in FAMILIES)
    with pytest.raises(ValueError, match=r"'no-such-family'.*\['ltx-video', 'wan'"):
        get_spec_class("no-such-family")


@FAMILY_PARAMS
def test_preset_loads_through_spec_and_pipeline(tiny_model_factory, family):
    folder = tiny_model_factory(family)
    spec = make_spec(folder, family)
    pipeline = spec.pipeline_class().from_pretrained(folder)
    transformer = spec.load_transformer()
    assert type(pipeline.transformer) is type(transformer)
    loaded = pipeline.transformer.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in transformer.state_dict().items())
    assert type(pipeline.vae) is type(spec.load_component("vae"))
    assert type(pipeline.scheduler) is type(spec.load_scheduler())
    assert spec.load_component("tokenizer")(CAPTIONS[0]).input_ids == pipeline.tokenizer(CAPTIONS[0]).input_ids
    assert len(spec.blocks(transformer)) == 2


@FAMILY_PARAMS
def test_frozen_components_honour_dtype(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family, dtype="bfloat16")
    encoders = spec.load_stage1()
    text_encoder, vae = encoders["text_encoder"], encoders["vae"]
    assert text_encoder.dtype == torch.bfloat16 and vae.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in vae.parameters())
    assert spec.load_transformer().dtype == torch.float32  # the trained weights stay float32
    latents = spec.encode_video(encoders, video(1))["latents"]
    assert latents.dtype == torch.float32 and torch.isfinite(latents).all()
    # A bfloat16 transformer (mixed precision) takes the float32 batch and returns a float32 prediction.
    conds = spec.encode_text(encoders, CAPTIONS[:1])
    assert all(v.dtype == torch.float32 for v in conds.values())
    out = spec.forward(spec.load_transformer(dtype=torch.bfloat16), {**conds, "latents": latents},
                       torch.tensor([0.5]), torch.randn_like(latents))
    assert out.prediction.dtype == torch.float32 and torch.isfinite(out.prediction).all()


def test_missing_paths_say_which_key_to_set(tmp_path):
    spec = make_spec(tmp_path / "nowhere", "ltx-video")
    with pytest.raises(FileNotFoundError, match=r"model.path = .*nowhere.* does not exist.*make_tiny_model.py"):
        spec.load_component("vae")
    (tmp_path / "partial").mkdir()
    spec = make_spec(tmp_path / "partial", "wan")
    with pytest.raises(FileNotFoundError, match=r"no 'transformer' folder.*model.components.transformer"):
        spec.load_transformer()
    spec = make_spec(tmp_path, "wan", components={"vae": str(tmp_path / "no_vae_here")})
    with pytest.raises(FileNotFoundError, match="model.components.vae"):
        spec.load_component("vae")
    with pytest.raises(ValueError, match="model.components.unet is not a component"):
        make_spec(tmp_path, "wan", components={"unet": "x"})
    with pytest.raises(ModelLoadError, match=r"the vae of 'wan' from hub id 'someone/missing-model'.*offline "
                                             r"\(HF_HUB_OFFLINE=1\).*set model.path"):
        make_spec("someone/missing-model", "wan").load_component("vae")  # HF_HUB_OFFLINE=1: fails at once


def test_wan_i2v_is_refused_at_construction(tmp_path):
    with pytest.raises(ValueError, match=r"'i2v' is not supported for family 'wan'"):
        make_spec(tmp_path, "wan", task="i2v")


@FAMILY_PARAMS
def test_check_bucket_rejects_what_the_vae_cannot_encode(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    spec.check_bucket(BUCKET)
    step = EXPECTED[family]["frames_step"]
    with pytest.raises(ValueError, match=rf"frames must be {step}k\+1"):
        spec.check_bucket(Bucket(step + 2, 64, 96))
    side = EXPECTED[family]["side"]
    with pytest.raises(ValueError, match=rf"height must be a multiple of {side}"):
        spec.check_bucket(Bucket(9, side + 8, 96))
    with pytest.raises(ValueError, match=r"\(B, 3, F, H, W\)"):
        spec.encode_video(spec.load_stage1(), torch.zeros(1, 9, 64, 96))


# ----------------------------------------------------------------------------- stage 1
@FAMILY_PARAMS
def test_stage1_shapes_match_latent_shape(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    expected = EXPECTED[family]["latent"]
    assert spec.latent_shape(BUCKET) == expected
    batch = stage1(spec)
    assert batch["latents"].shape == (2, *expected) and batch["latents"].dtype == torch.float32
    assert batch["prompt_embeds"].shape == (2, 16, EXPECTED[family]["text_dim"])
    assert EXPECTED[family]["text_padding"](batch)


@FAMILY_PARAMS
def test_latents_are_normalised_as_the_pipeline_denormalises(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    vae = spec.load_component("vae")
    clip = video(1)
    latents = spec.encode_video({"vae": vae}, clip)["latents"]
    raw = vae.encode(clip).latent_dist.mode()
    back = EXPECTED[family]["denormalize"](latents, vae)
    assert not torch.allclose(latents, raw, atol=1e-3)  # the tiny presets have non-trivial statistics
    torch.testing.assert_close(back, raw, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- stage 2
@FAMILY_PARAMS
def test_forward_gives_flow_target_and_trains_lora_only(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    batch = stage1(spec)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=4.0, targets=None)
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, torch.tensor([0.2, 0.9]), noise)
    assert torch.equal(out.target, noise - batch["latents"])
    assert out.prediction.shape == out.target.shape and out.weight is None
    ((out.prediction - out.target) ** 2).mean().backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    lora = {n for n, p in transformer.named_parameters() if "lora_" in n}
    assert with_grad and with_grad == lora
    assert any(transformer.get_parameter(n).grad.abs().sum() > 0 for n in with_grad)


def capture_transformer_inputs(transformer):
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)

    transformer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


@pytest.mark.parametrize("first_frame_noise", [0.0, 0.5])
def test_ltx_i2v_keeps_first_frame_as_condition(tiny_model_factory, first_frame_noise):
    from diffusers import LTXPipeline

    spec = make_spec(tiny_model_factory("ltx-video"), "ltx-video", task="i2v", first_frame_noise=first_frame_noise)
    batch = stage1(spec)
    assert batch["first_frame_latents"].shape == (2, 16, 1, 2, 3)
    transformer = spec.load_transformer()
    seen = capture_transformer_inputs(transformer)
    sigmas = torch.tensor([0.3, 0.9])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, sigmas, noise, generator=torch.Generator().manual_seed(2))

    assert out.weight.shape == (2, 1, 2, 1, 1)
    assert (out.weight[:, :, 0] == 0).all() and (out.weight[:, :, 1:] == 1).all()
    x0 = torch.cat([batch["first_frame_latents"], batch["latents"][:, :, 1:]], dim=2)
    assert torch.equal(out.target, noise - x0)
    noisy = LTXPipeline._unpack_latents(seen["hidden_states"], 2, 2, 3)
    timestep = seen["timestep"].view(2, 2, 6)  # (batch, latent frame, tokens of a frame)
    torch.testing.assert_close(timestep[:, 1], (sigmas * 1000)[:, None].expand(2, 6))
    if first_frame_noise == 0:
        assert torch.equal(noisy[:, :, 0], batch["first_frame_latents"][:, :, 0])
        assert (timestep[:, 0] == 0).all()
    else:
        assert not torch.allclose(noisy[:, :, 0], batch["first_frame_latents"][:, :, 0])
        assert (timestep[:, 0] > 0).all() and (timestep[:, 0] <= 500).all()


# ----------------------------------------------------------------------------- export and validation
@FAMILY_PARAMS
def test_lora_export_loads_into_a_fresh_pipeline(tiny_model_factory, tmp_path, family):
    from peft.utils import get_peft_model_state_dict

    folder = tiny_model_factory(family)
    spec = make_spec(folder, family)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)  # alpha != rank: scaling must survive export
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in transformer.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    path = spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    assert path == tmp_path / "lora" / "pytorch_lora_weights.safetensors" and path.is_file()

    in_memory = pipeline_latents(spec, spec.build_pipeline(transformer))
    fresh = spec.pipeline_class().from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    base = pipeline_latents(spec, fresh)
    fresh.load_lora_weights(tmp_path / "lora")
    loaded = pipeline_latents(spec, fresh)
    assert (base - in_memory).abs().max() > 1e-2
    torch.testing.assert_close(loaded, in_memory, atol=1e-4, rtol=1e-4)

    frames = spec.generate(fresh, "a rabbit in a meadow", BUCKET, steps=2, seed=0)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0

    # The ComfyUI file: original module names under diffusion_model., read back by diffusers' own
    # conversion of non-diffusers LoRA files into the same model.
    from safetensors.torch import load_file

    comfy = load_file(tmp_path / "lora" / "lora_comfyui.safetensors")
    assert all(key.startswith("diffusion_model.") for key in comfy)
    assert EXPECTED[family]["comfy_key"] in comfy and any(key.endswith(".alpha") for key in comfy) == spec.comfy_alpha
    other = spec.pipeline_class().from_pretrained(folder)
    other.set_progress_bar_config(disable=True)
    other.load_lora_weights(tmp_path / "lora", weight_name="lora_comfyui.safetensors")
    torch.testing.assert_close(pipeline_latents(spec, other), in_memory, atol=1e-4, rtol=1e-4)


@FAMILY_PARAMS
def test_full_export_round_trips_and_overrides_the_transformer(tiny_model_factory, tmp_path, family):
    folder = tiny_model_factory(family)
    spec = make_spec(folder, family)
    transformer = spec.load_transformer()
    with torch.no_grad():
        transformer.proj_out.weight.add_(1.0)  # differs from the preset, so the override is visible
    out = spec.save_full(transformer, tmp_path / "full")
    reloaded = spec.component_classes()["transformer"].from_pretrained(out)
    expected = transformer.state_dict()
    assert reloaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in reloaded.state_dict().items())

    override = make_spec(folder, family, components={"transformer": str(out)}).load_transformer()
    assert torch.equal(override.proj_out.weight, transformer.proj_out.weight)
    assert not torch.equal(spec.load_transformer().proj_out.weight, transformer.proj_out.weight)


def test_ltx_i2v_generates_from_an_image(tiny_model_factory):
    from diffusers import LTXImageToVideoPipeline

    spec = make_spec(tiny_model_factory("ltx-video"), "ltx-video", task="i2v")
    pipeline = spec.build_pipeline(spec.load_transformer())
    assert isinstance(pipeline, LTXImageToVideoPipeline)
    image = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    frames = spec.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0, image=image)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8
    with pytest.raises(ValueError, match="needs an image"):
        spec.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0)


# ----------------------------------------------------------------------------- tiny presets
@FAMILY_PARAMS
def test_make_tiny_cli_is_deterministic_for_a_seed(tiny_model_factory, tmp_path, family):
    import make_tiny_model

    make_tiny_model.main(["--family", family, str(tmp_path / "again")])
    assert folder_digest(tmp_path / "again") == folder_digest(tiny_model_factory(family))
    other = make_tiny_model.make_tiny_model(family, tmp_path / "seed1", seed=1)
    assert folder_digest(other)["transformer/diffusion_pytorch_model.safetensors"] != \
        folder_digest(tmp_path / "again")["transformer/diffusion_pytorch_model.safetensors"]
    with pytest.raises(SystemExit):
        make_tiny_model.main(["--family", "nope", str(tmp_path / "x")])


@FAMILY_PARAMS
def test_text_length_defaults_to_what_the_family_pipeline_encodes(tiny_model_factory, family, caplog):
    """Unset, the text length is the pipeline's own (Wan 512, LTX 128); a different one is warned about."""
    spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family))), frame_rate=8.0)
    expected = EXPECTED[family]["text_tokens"]
    assert spec.max_text_tokens == expected == spec.pipeline_default("max_sequence_length")
    assert not any("max_sequence_length" in line for line in spec.inference_mismatches())
    shorter = make_spec(tiny_model_factory(family), family)  # max_text_tokens=16
    assert shorter.pipeline_inputs("a cat", BUCKET, 2, 0)["max_sequence_length"] == 16
    assert any(f"max_sequence_length=16 but {shorter.pipeline_class().__name__} uses {expected}" in line
               for line in shorter.inference_mismatches())
    assert spec.encode_text(spec.load_stage1(), CAPTIONS[:1])["prompt_embeds"].shape[1] == expected


def test_ltx_trains_and_samples_at_the_bucket_frame_rate(tiny_model_factory):
    """RoPE's temporal scale is VAE time compression / frame rate, in training and in the pipeline."""
    spec = build_spec(ModelConfig(family="ltx-video", path=str(tiny_model_factory("ltx-video")), max_text_tokens=16),
                      frame_rate=12.0)
    assert spec.pipeline_inputs("a cat", BUCKET, 2, 0)["frame_rate"] == 12.0
    assert any("frame_rate=12 but LTXPipeline uses 25" in line for line in spec.inference_mismatches())
    transformer = spec.load_transformer()
    seen = {}
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    batch = stage1(spec, batch=1)
    spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    assert seen["rope_interpolation_scale"] == (spec.geometry.temporal / 12.0, spec.geometry.spatial,
                                                spec.geometry.spatial)


@FAMILY_PARAMS
def test_tokens_per_sample_counts_transformer_tokens(tiny_model_factory, family):
    """Wan folds 2x2 latent pixels into a token, LTX (patch 1 after its VAE) one pixel per token."""
    spec = make_spec(tiny_model_factory(family), family)
    latent = spec.latent_shape(BUCKET)
    transformer = spec.load_transformer()
    seen = {}

    def first_block_input(module, args, kwargs):  # the token sequence the blocks attend over
        seen["tokens"] = (args[0] if args else kwargs["hidden_states"]).shape[1]

    spec.blocks(transformer)[0].register_forward_pre_hook(first_block_input, with_kwargs=True)
    batch = stage1(spec, batch=1)
    spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    assert spec.tokens_per_sample(latent) == seen["tokens"]
    patch = EXPECTED[family]["patch"]
    assert spec.tokens_per_sample(latent) == latent[1] * latent[2] * latent[3] // patch**2
