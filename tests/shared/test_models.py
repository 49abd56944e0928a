"""Model Spec API on the tiny presets of both families: real diffusers/transformers classes throughout."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from lora_init import randomise_lora

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import FAMILIES, build_spec, get_spec_class
from vt.shared.models.comfy import filename as comfy_filename
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


def _cogvideox_denormalize(latents, vae):  # CogVideoXPipeline.decode_latents: 1 / scaling_factor * latents
    return 1 / vae.config.scaling_factor * latents


def _hunyuan_denormalize(latents, vae):  # HunyuanVideoPipeline: latents / scaling_factor
    return latents / vae.config.scaling_factor


def _mochi_denormalize(latents, vae):  # MochiPipeline: latents * std / scaling_factor + mean
    return _wan_denormalize(latents / vae.config.scaling_factor, vae)


def _inverted_flow_target(spec, x0, noise, sigmas):  # Mochi: the pipeline's inverted flow time
    return x0 - noise


def _ltx2_denormalize(latents, vae):  # LTX2Pipeline's own inverse, as used before vae.decode
    from diffusers import LTX2Pipeline

    return LTX2Pipeline._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)


def _ltx2_connector_text(batch):  # LTX2Pipeline's connectors: every row is valid and carries their output
    return bool((batch["prompt_attention_mask"] == 1).all() and (batch["prompt_embeds"].abs().sum(-1) > 0).all())


def _t5_unmasked(batch):  # no mask, no zeroing: padded positions carry T5's outputs (CogVideoXPipeline)
    return "prompt_attention_mask" not in batch and (batch["prompt_embeds"][:, -1].abs().sum(-1) > 0).all()


def _flow_target(spec, x0, noise, sigmas):  # rectified flow
    return noise - x0


def _v_target(spec, x0, noise, sigmas):  # DDPM v-prediction at t = floor(1000 sigma) on the scheduler's schedule
    return spec.load_scheduler().get_velocity(x0, noise, (sigmas * 1000).floor().long().clamp(max=999))


# What each family's tiny preset must show; a new family adds its entry (comfy_key None: the family
# writes no ComfyUI file; target: the training target, rectified flow unless given).
EXPECTED = {
    "ltx-video": dict(frames_step=8, side=32, latent=(16, 2, 2, 3), text_dim=64, text_tokens=128, patch=1,
                      text_padding=_has_padding_mask, denormalize=_ltx_denormalize,
                      comfy_key="diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight"),
    "wan": dict(frames_step=4, side=16, latent=(16, 3, 8, 12), text_dim=64, text_tokens=512, patch=2,
                text_padding=_zero_past_caption, denormalize=_wan_denormalize,
                comfy_key="diffusion_model.blocks.0.self_attn.q.lora_A.weight"),
    "wan2.2": dict(frames_step=4, side=16, latent=(16, 3, 8, 12), text_dim=64, text_tokens=512, patch=2,
                   text_padding=_zero_past_caption, denormalize=_wan_denormalize,
                   comfy_key="diffusion_model.blocks.0.self_attn.q.lora_A.weight"),
    # Wan 2.2 TI2V-5B: the 48-channel VAE folds 2 x 2 pixels first (x16 space), so sides are multiples of 32.
    "wan2.2-ti2v": dict(frames_step=4, side=32, latent=(48, 3, 4, 6), text_dim=64, text_tokens=512, patch=2,
                        text_padding=_zero_past_caption, denormalize=_wan_denormalize,
                        comfy_key="diffusion_model.blocks.0.self_attn.q.lora_A.weight"),
    "cogvideox": dict(frames_step=4, side=16, latent=(16, 3, 8, 12), text_dim=64, text_tokens=226, patch=2,
                      text_padding=_t5_unmasked, denormalize=_cogvideox_denormalize, comfy_key=None,
                      target=_v_target),
    # LoRA targets of the export test: double blocks only; diffusers splits the single blocks' fused
    # linear1 at the real hidden size (3072), so they read back through it only at the real size.
    "hunyuan-video": dict(frames_step=4, side=16, latent=(4, 3, 8, 12), text_dim=16, text_tokens=256, patch=2,
                          text_padding=_has_padding_mask, denormalize=_hunyuan_denormalize,
                          comfy_key="diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight",
                          lora_targets=r"transformer_blocks\.\d+\.attn\.(to_q|to_k|to_v|to_out\.0)"),
    # x16 VAE, patch 1; the pipeline encodes 1000 text tokens and takes no length argument (it is an attribute).
    "hunyuan-video-1.5": dict(frames_step=4, side=16, latent=(4, 3, 4, 6), text_dim=16, text_tokens=1000, patch=1,
                              text_padding=_has_padding_mask, denormalize=_hunyuan_denormalize,
                              comfy_key="diffusion_model.double_blocks.0.img_attn_q.lora_A.weight",
                              text_length_in_call=False),
    # Video stream only (the audio branch is not trained); the connectors' mask marks every row.
    "ltx-2": dict(frames_step=8, side=32, latent=(8, 2, 2, 3), text_dim=16, text_tokens=1024, patch=1,
                  text_padding=_ltx2_connector_text, denormalize=_ltx2_denormalize,
                  comfy_key="diffusion_model.transformer_blocks.0.attn1.to_q.lora_A.weight"),
    # Frames 6k+1 (bucket); nothing in diffusers reads a non-diffusers Mochi LoRA (comfy_in_diffusers):
    # tests/shared/test_mochi.py checks its ComfyUI file through diffusers' single-file converter.
    "mochi": dict(frames_step=6, side=16, latent=(12, 2, 8, 12), text_dim=64, text_tokens=256, patch=2,
                  text_padding=_has_padding_mask, denormalize=_mochi_denormalize, target=_inverted_flow_target,
                  comfy_key="diffusion_model.blocks.0.attn.qkv_x.lora_A.weight", comfy_in_diffusers=False,
                  bucket=Bucket(7, 64, 96)),
}
CAPTIONS = ["a big rabbit walks in the meadow", "people riding bikes on a sunny street"]


def make_spec(folder, family, **kw):
    return build_spec(ModelConfig(family=family, path=str(folder), max_text_tokens=16, **kw), frame_rate=8.0)


def bucket_of(family):
    """The test bucket of a family: BUCKET, unless its VAE needs other frame counts (EXPECTED "bucket")."""
    return EXPECTED.get(family, {}).get("bucket", BUCKET)


def video(batch=2, seed=0, bucket=BUCKET):
    return torch.rand(batch, 3, bucket.frames, bucket.height, bucket.width,
                      generator=torch.Generator().manual_seed(seed)) * 2 - 1


def stage1(spec, batch=2):
    encoders = spec.load_stage1()
    return {**spec.encode_text(encoders, CAPTIONS[:batch]),
            **spec.encode_video(encoders, video(batch, bucket=bucket_of(spec.family)))}


def pipeline_latents(spec, pipeline, image=None):
    """The denoised latents of a 2-step run: finer than uint8 frames for comparing transformers."""
    inputs = spec.pipeline_inputs("a rabbit in a meadow", bucket_of(spec.family), steps=2, seed=0, image=image)
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
    encoders = {name: spec.load_component(name) for name in spec.stage1_components}  # as stage 1 on a GPU
    text_encoder, vae = encoders["text_encoder"], encoders["vae"]
    assert text_encoder.dtype == torch.bfloat16 and vae.dtype == torch.bfloat16
    # On a CPU stage 1 computes in float32: bf16 convolutions there run tens of times slower.
    assert {spec.load_stage1("cpu")[name].dtype for name in ("text_encoder", "vae")} == {torch.float32}
    assert not any(p.requires_grad for p in vae.parameters())
    assert spec.load_transformer().dtype == torch.float32  # the trained weights stay float32
    latents = spec.encode_video(encoders, video(1, bucket=bucket_of(family)))["latents"]
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


@FAMILY_PARAMS
def test_check_bucket_rejects_what_the_vae_cannot_encode(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    spec.check_bucket(bucket_of(family))
    step = EXPECTED[family]["frames_step"]
    with pytest.raises(ValueError, match=rf"frames must be {step}k\+1"):
        spec.check_bucket(Bucket(step + 2, 64, 96))
    side = EXPECTED[family]["side"]
    with pytest.raises(ValueError, match=rf"height must be a multiple of {side}"):
        spec.check_bucket(Bucket(bucket_of(family).frames, side + 8, 96))
    with pytest.raises(ValueError, match=r"\(B, 3, F, H, W\)"):
        spec.encode_video(spec.load_stage1(), torch.zeros(1, 9, 64, 96))


# ----------------------------------------------------------------------------- stage 1
@FAMILY_PARAMS
def test_stage1_shapes_match_latent_shape(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    expected = EXPECTED[family]["latent"]
    assert spec.latent_shape(bucket_of(family)) == expected
    batch = stage1(spec)
    assert batch["latents"].shape == (2, *expected) and batch["latents"].dtype == torch.float32
    assert batch["prompt_embeds"].shape == (2, 16, EXPECTED[family]["text_dim"])
    assert EXPECTED[family]["text_padding"](batch)


@FAMILY_PARAMS
def test_latents_are_normalised_as_the_pipeline_denormalises(tiny_model_factory, family):
    spec = make_spec(tiny_model_factory(family), family)
    vae = spec.load_component("vae")
    clip = video(1, bucket=bucket_of(family))
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
    sigmas = torch.tensor([0.2, 0.9])
    out = spec.forward(transformer, batch, sigmas, noise)
    target = EXPECTED[family].get("target", _flow_target)(spec, batch["latents"], noise, sigmas)
    torch.testing.assert_close(out.target, target, atol=1e-6, rtol=1e-6)
    assert out.prediction.shape == out.target.shape and out.weight is None
    ((out.prediction - out.target) ** 2).mean().backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    lora = {n for n, p in transformer.named_parameters() if "lora_" in n}
    assert with_grad and with_grad == lora
    assert any(transformer.get_parameter(n).grad.abs().sum() > 0 for n in with_grad)


@FAMILY_PARAMS
def test_checkpointing_recomputes_every_block_of_every_list(tiny_model_factory, family):
    """The spec's block lists are the transformer's block lists (every top-level ModuleList), and under
    activation checkpointing every block of them runs twice per micro-step: forward, then recompute."""
    from collections import Counter

    from torch.nn.modules.module import register_module_forward_pre_hook

    from vt.train.parallel import apply_ac

    spec = make_spec(tiny_model_factory(family), family)
    batch = stage1(spec)
    transformer = spec.load_transformer()
    lists = {name for name, child in transformer.named_children() if isinstance(child, torch.nn.ModuleList)}
    assert lists == set(spec.block_lists), f"{family}: block lists {spec.block_lists}, transformer has {lists}"
    apply_ac(transformer, spec)
    names = {id(block._checkpoint_wrapped_module): name for name, block in spec.named_blocks(transformer)}
    starts = Counter()
    handle = register_module_forward_pre_hook(lambda module, args: starts.update([names.get(id(module))]))
    try:
        noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
        out = spec.forward(transformer, batch, torch.tensor([0.2, 0.9]), noise)
        ((out.prediction - out.target) ** 2).mean().backward()
    finally:
        handle.remove()
    starts.pop(None, None)
    assert starts == {name: 2 for name in names.values()}, f"{family}: block forward starts {dict(starts)}"


def capture_transformer_inputs(transformer):
    seen = {}

    def hook(module, args, kwargs):
        seen.update(kwargs)

    transformer.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def test_first_frame_noise_is_refused_where_it_would_do_nothing(tiny_model_factory):
    with pytest.raises(ValueError, match=r"first_frame_noise = 0.5 does nothing for 'wan' task 'i2v': it conditions"):
        make_spec(tiny_model_factory("wan", task="i2v"), "wan", task="i2v", first_frame_noise=0.5)
    with pytest.raises(ValueError, match=r"for 'ltx-video' task 't2v': it is an i2v setting"):
        make_spec(tiny_model_factory("ltx-video"), "ltx-video", first_frame_noise=0.5)


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
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=EXPECTED[family].get("lora_targets"))  # alpha != rank
    randomise_lora(transformer, seed=3)
    path = spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    assert path == tmp_path / "lora" / "pytorch_lora_weights.safetensors" and path.is_file()

    in_memory = pipeline_latents(spec, spec.build_pipeline(transformer))
    fresh = spec.pipeline_class().from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    base = pipeline_latents(spec, fresh)
    spec.load_lora(fresh, tmp_path / "lora")  # the pipeline's load_lora_weights, or the family's own loader
    loaded = pipeline_latents(spec, fresh)
    assert (base - in_memory).abs().max() > 1e-2
    torch.testing.assert_close(loaded, in_memory, atol=1e-4, rtol=1e-4)

    bucket = bucket_of(family)
    frames = spec.generate(fresh, "a rabbit in a meadow", bucket, steps=2, seed=0)
    assert frames.shape == (bucket.frames, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0

    # The ComfyUI file: original module names under diffusion_model., read back by diffusers' own
    # conversion of non-diffusers LoRA files into the same model (by the family's own loader where
    # diffusers has none for the pipeline: HunyuanVideo 1.5).
    from safetensors.torch import load_file

    comfy_name = comfy_filename(spec.expert)
    if EXPECTED[family]["comfy_key"] is None:  # no original key table: the diffusers file only
        assert not (tmp_path / "lora" / comfy_name).exists()
        return
    comfy = load_file(tmp_path / "lora" / comfy_name)
    assert all(key.startswith("diffusion_model.") for key in comfy)
    assert EXPECTED[family]["comfy_key"] in comfy and any(key.endswith(".alpha") for key in comfy) == spec.comfy_alpha
    if not EXPECTED[family].get("comfy_in_diffusers", True):  # no diffusers reader: the family's own test checks it
        return
    other = spec.pipeline_class().from_pretrained(folder)
    other.set_progress_bar_config(disable=True)
    spec.load_lora(other, tmp_path / "lora", weight_name=comfy_name)
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
    inputs = shorter.pipeline_inputs("a cat", bucket_of(family), 2, 0)
    if EXPECTED[family].get("text_length_in_call", True):
        assert inputs["max_sequence_length"] == 16
    else:  # no such call argument: validation sets the pipeline's own length attribute (the family's test)
        assert "max_sequence_length" not in inputs
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
    latent = spec.latent_shape(bucket_of(family))
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


@pytest.mark.parametrize("expert", ["high_noise", "low_noise"])
def test_an_expert_trains_its_own_transformer_and_noise_range(tiny_model_factory, tmp_path, expert):
    """Wan 2.2 A14B: each expert is its own transformer, trained on its side of the boundary, and its
    LoRA loads into that expert of the pipeline, from the diffusers and the ComfyUI file alike."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    folder = tiny_model_factory("wan2.2")
    spec = make_spec(folder, "wan2.2", expert=expert)
    component = {"high_noise": "transformer", "low_noise": "transformer_2"}[expert]
    assert spec.trained_component == component
    assert spec.sigma_range() == ((0.875, 1.0) if expert == "high_noise" else (0.0, 0.875))
    transformer = spec.load_transformer()
    stored = load_file(next((folder / component).glob("*.safetensors")))
    name = next(iter(stored))
    torch.testing.assert_close(transformer.state_dict()[name], stored[name].float())
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    with torch.no_grad():
        for param_name, param in transformer.named_parameters():
            if "lora_B" in param_name:
                param.normal_(std=0.3, generator=torch.Generator().manual_seed(1))
    pipeline = spec.build_pipeline(transformer)
    assert getattr(pipeline, component) is transformer and pipeline.config.boundary_ratio == 0.875
    in_memory = pipeline_latents(spec, pipeline)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    for weight_name in ("pytorch_lora_weights.safetensors", f"lora_comfyui_{expert}.safetensors"):
        fresh = spec.pipeline_class().from_pretrained(folder)
        fresh.set_progress_bar_config(disable=True)
        fresh.load_lora_weights(tmp_path, weight_name=weight_name, **spec.lora_load_kwargs())
        torch.testing.assert_close(pipeline_latents(spec, fresh), in_memory, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match=r"model.expert = 'middle'.*\['high_noise', 'low_noise', 'all'\]"):
        make_spec(folder, "wan2.2", expert="middle")
    with pytest.raises(ValueError, match=r"one transformer: leave it unset"):
        make_spec(tiny_model_factory("wan"), "wan", expert="low_noise")


# ----------------------------------------------------------------------------- Wan image-to-video
def make_wan_i2v_spec(tiny_model_factory, **kw):
    """Wan 2.1 I2V on its tiny preset; the text length is the pipeline's 512 (the only one i2v takes)."""
    return build_spec(ModelConfig(family="wan", task="i2v", path=str(tiny_model_factory("wan", task="i2v")), **kw),
                      frame_rate=8.0)


def uint8_video(batch=2, seed=0):
    """(video in [-1, 1] as stage 1 makes it from decoded pixels, the uint8 pixels (B, F, H, W, 3))."""
    pixels = torch.randint(0, 256, (batch, BUCKET.frames, BUCKET.height, BUCKET.width, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    return pixels.permute(0, 4, 1, 2, 3).float() / 127.5 - 1, pixels


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
        torch.testing.assert_close(out["image_embeds"][i:i + 1], pipeline.encode_image(image, "cpu"))
        frame = pipeline.video_processor.preprocess(image, height=BUCKET.height, width=BUCKET.width)
        _, condition = pipeline.prepare_latents(frame, 1, 16, BUCKET.height, BUCKET.width, BUCKET.frames,
                                                torch.float32, "cpu", torch.Generator().manual_seed(0))
        assert condition.shape == (1, 20, 3, 8, 12)
        torch.testing.assert_close(condition[:, :4], spec.first_frame_mask(out["latents"][i:i + 1]))
        torch.testing.assert_close(condition[:, 4:], out["condition_latents"][i:i + 1], atol=1e-5, rtol=1e-5)
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
    torch.testing.assert_close(hidden[:, :16], (1 - sigmas.view(2, 1, 1, 1, 1)) * batch["latents"]
                               + sigmas.view(2, 1, 1, 1, 1) * noise)
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
    assert {"diffusion_model.blocks.0.cross_attn.k_img.lora_A.weight",
            "diffusion_model.blocks.1.cross_attn.v_img.lora_B.weight"} <= set(comfy)

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
    override = build_spec(ModelConfig(family="wan", task="i2v", path=str(folder),
                                      components={"transformer": str(out)}), 8.0).load_transformer()
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
