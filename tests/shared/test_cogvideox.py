"""CogVideoX: the v-prediction objective on the scheduler's own schedule, transformer inputs that match
CogVideoXPipeline's, the sincos text-length rule, CogVideoX 1.5's temporal patch, and image-to-video
as CogVideoXImageToVideoPipeline conditions it (tiny real models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket

from helpers.family_cases import BUCKET
from helpers.lora_init import randomise_lora
from helpers.spec_inputs import capture_transformer_inputs, make_spec, pipeline_latents, stage1, uint8_video, video


def variant(tiny_model_factory, folder, seed=0, **changes):
    """A transformer folder like the tiny preset's with `changes` to its config (e.g. 1.5, sincos)."""
    from diffusers import CogVideoXTransformer3DModel

    base = tiny_model_factory("cogvideox")
    config = {
        k: v
        for k, v in CogVideoXTransformer3DModel.load_config(base, subfolder="transformer").items()
        if not k.startswith("_")
    }
    torch.manual_seed(seed)
    CogVideoXTransformer3DModel.from_config({**config, **changes}).save_pretrained(folder)
    return base, str(folder)


def test_objective_is_v_prediction_on_the_scheduler_schedule(tiny_model_factory):
    """x_t and the target are diffusers' add_noise / get_velocity at t = floor(1000 sigma); with the true
    v, the pipeline scheduler's step recovers x0 (so a perfect prediction denoises exactly)."""
    spec = make_spec(tiny_model_factory("cogvideox"), "cogvideox")
    scheduler = spec.load_scheduler()
    assert type(scheduler).__name__ == "CogVideoXDDIMScheduler" and scheduler.config.prediction_type == "v_prediction"
    batch = {**stage1(spec), "latents": torch.randn(3, *spec.latent_shape(BUCKET))}
    batch["prompt_embeds"] = torch.cat([batch["prompt_embeds"], batch["prompt_embeds"][:1]])
    x0 = batch["latents"]
    transformer = spec.load_transformer()
    seen = capture_transformer_inputs(transformer)
    sigmas = torch.tensor([0.0, 0.25, 0.9999])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, sigmas, noise)

    t = seen["timestep"]
    assert t.dtype == torch.int64 and t.tolist() == [0, 250, 999]
    assert seen["hidden_states"].shape == (3, x0.shape[2], x0.shape[1], *x0.shape[3:])  # (B, F, C, H, W)
    noisy = seen["hidden_states"].transpose(1, 2)
    torch.testing.assert_close(noisy, scheduler.add_noise(x0, noise, t), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.target, scheduler.get_velocity(x0, noise, t), atol=1e-5, rtol=1e-5)
    # Zero terminal SNR: at t = 999 the input is pure noise and v = -x0.
    torch.testing.assert_close(noisy[2], noise[2], atol=1e-5, rtol=0)
    torch.testing.assert_close(out.target[2], -x0[2], atol=1e-5, rtol=0)
    assert out.prediction.shape == out.target.shape and out.weight is None

    scheduler.set_timesteps(50)
    for i, step in enumerate(t.tolist()):
        result = scheduler.step(out.target[i : i + 1], step, noisy[i : i + 1])
        torch.testing.assert_close(result.pred_original_sample, x0[i : i + 1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("version", ["1.0", "1.5"])
def test_transformer_inputs_match_the_pipeline(tiny_model_factory, tmp_path, version):
    """The rotary tables, latent layout, timestep dtype and text the spec feeds the transformer are
    those CogVideoXPipeline feeds it for the same bucket (1.5: patch_size_t 2, RoPE 'slice')."""
    folder = tiny_model_factory("cogvideox")
    components = {}
    bucket = BUCKET
    if version == "1.5":
        _, components["transformer"] = variant(tiny_model_factory, tmp_path / "t15", patch_size_t=2, patch_bias=False)
        bucket = Bucket(13, 64, 96)  # 4 latent frames: two temporal patches
    spec = make_spec(folder, "cogvideox", components=components)
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer)
    calls = []
    transformer.register_forward_pre_hook(lambda module, args, kwargs: calls.append(dict(kwargs)), with_kwargs=True)
    pipeline(**spec.pipeline_inputs("a rabbit in a meadow", bucket, steps=1, seed=0), output_type="latent")
    piped = calls.pop()

    encoders = spec.load_stage1()
    batch = {
        **spec.encode_text(encoders, ["a rabbit in a meadow"]),
        "latents": torch.randn(1, *spec.latent_shape(bucket)),
    }
    spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    ours = calls.pop()
    assert ours["hidden_states"].shape[1:] == piped["hidden_states"].shape[1:]
    assert ours["timestep"].dtype == piped["timestep"].dtype == torch.int64
    cos, sin = ours["image_rotary_emb"]
    torch.testing.assert_close(cos, piped["image_rotary_emb"][0])
    torch.testing.assert_close(sin, piped["image_rotary_emb"][1])
    # The pipeline runs guidance: its text batch is [negative, prompt].
    torch.testing.assert_close(
        ours["encoder_hidden_states"][0], piped["encoder_hidden_states"][1], atol=1e-5, rtol=1e-5
    )


def test_cogvideox_1_5_folds_two_latent_frames(tiny_model_factory, tmp_path):
    folder, transformer_dir = variant(tiny_model_factory, tmp_path / "t15", patch_size_t=2, patch_bias=False)
    spec = make_spec(folder, "cogvideox", components={"transformer": transformer_dir})
    with pytest.raises(ValueError, match=r"frames must be 8k\+5 \(e.g. 13 or 85\)"):
        spec.check_bucket(BUCKET)  # 3 latent frames
    bucket = Bucket(13, 64, 96)
    latent = spec.latent_shape(bucket)
    assert latent == (16, 4, 8, 12) and spec.tokens_per_sample(latent) == 2 * 4 * 6
    transformer = spec.load_transformer()
    seen = {}
    spec.blocks(transformer)[0].register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(tokens=kwargs["hidden_states"].shape[1]), with_kwargs=True
    )
    batch = {**spec.encode_text(spec.load_stage1(), ["a cat"]), "latents": torch.randn(1, *latent)}
    out = spec.forward(transformer, batch, torch.tensor([0.3]), torch.randn_like(batch["latents"]))
    assert seen["tokens"] == spec.tokens_per_sample(latent) and out.prediction.shape == (1, *latent)


def test_sincos_transformer_needs_its_text_length(tiny_model_factory, tmp_path):
    """The 2B layout (sincos positions over max_text_seq_length text tokens) refuses another text
    length at start-up (check_bucket, which both stages call first), naming the key to set."""
    folder, transformer_dir = variant(
        tiny_model_factory, tmp_path / "sincos", use_rotary_positional_embeddings=False, max_text_seq_length=16
    )
    spec = make_spec(folder, "cogvideox", components={"transformer": transformer_dir})  # max_text_tokens=16
    batch = stage1(spec, batch=1)
    out = spec.forward(spec.load_transformer(), batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    assert torch.isfinite(out.prediction).all()

    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    unset = build_spec(
        ModelConfig(family="cogvideox", path=str(folder), components={"transformer": transformer_dir}), frame_rate=8.0
    )
    with pytest.raises(
        ValueError,
        match=r"model.max_text_tokens unset \(226.*max_text_seq_length = 16.*"
        r"Set model.max_text_tokens = 16",
    ):
        unset.check_bucket(BUCKET)
    other = build_spec(
        ModelConfig(
            family="cogvideox", path=str(folder), max_text_tokens=32, components={"transformer": transformer_dir}
        ),
        frame_rate=8.0,
    )
    with pytest.raises(ValueError, match=r"model.max_text_tokens = 32 does not fit"):
        other.encode_text(other.load_stage1(), ["a cat"])


# ----------------------------------------------------------------------------- image-to-video
I2V_IMAGE = np.random.default_rng(0).integers(0, 256, (BUCKET.height, BUCKET.width, 3), dtype=np.uint8)


def i2v_spec(tiny_model_factory, **kw):
    return make_spec(tiny_model_factory("cogvideox", task="i2v"), "cogvideox", task="i2v", **kw)


def test_i2v_conditions_on_the_first_frame_as_the_pipeline_does(tiny_model_factory):
    """image_latents are the pipeline's prepare_latents image (the same posterior, mode instead of a
    sample, times scaling_factor); the transformer gets [noisy, image latents then zeros] on channels,
    as the pipeline feeds it; a t2v checkpoint or task refuses the other."""
    from diffusers import CogVideoXImageToVideoPipeline
    from PIL import Image

    spec = i2v_spec(tiny_model_factory)
    encoders = spec.load_stage1()
    clip, pixels = uint8_video(2)
    batch = {**spec.encode_text(encoders, ["a cat", "a dog"]), **spec.encode_video(encoders, clip)}
    assert batch["image_latents"].shape == (2, 16, 1, 8, 12) and batch["latents"].shape == (2, 16, 3, 8, 12)

    pipeline = CogVideoXImageToVideoPipeline.from_pretrained(tiny_model_factory("cogvideox", task="i2v"))
    factor = pipeline.vae.config.scaling_factor
    image = pipeline.video_processor.preprocess(Image.fromarray(pixels[1, 0].numpy()), height=64, width=96)
    torch.testing.assert_close(image, clip[1:, :, 0], atol=1e-6, rtol=0)  # the same pixels
    posterior = pipeline.vae.encode(image.unsqueeze(2)).latent_dist
    _, piped = pipeline.prepare_latents(
        image, 1, 16, BUCKET.frames, 64, 96, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    assert piped.shape == (1, 3, 16, 8, 12) and (piped[:, 1:] == 0).all()  # (B, F, C, H, W)
    sampled = posterior.sample(torch.Generator().manual_seed(0)) * factor
    torch.testing.assert_close(piped[:, :1].transpose(1, 2), sampled, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch["image_latents"][1:], posterior.mode() * factor, atol=1e-5, rtol=1e-5)

    transformer = spec.load_transformer()
    seen = capture_transformer_inputs(transformer)
    spec.forward(transformer, batch, torch.tensor([0.2, 0.9]), torch.randn_like(batch["latents"]))
    hidden = seen["hidden_states"].transpose(1, 2)  # (B, 2C, F, H, W)
    assert hidden.shape == (2, 32, 3, 8, 12) and "ofs" not in seen  # 1.0: no ofs embedding
    assert torch.equal(hidden[:, 16:, :1], batch["image_latents"]) and (hidden[:, 16:, 1:] == 0).all()
    pipeline.transformer = transformer
    pipeline(**spec.pipeline_inputs("a cat", BUCKET, steps=1, seed=0, image=I2V_IMAGE), output_type="latent")
    assert seen["hidden_states"].shape[2:] == (32, 8, 12) and (seen["hidden_states"][:, 1:, 16:] == 0).all()
    assert seen["ofs"] is None

    with pytest.raises(KeyError, match="precompute the shards with model.task"):
        spec.forward(
            transformer,
            {k: v for k, v in batch.items() if k != "image_latents"},
            torch.tensor([0.5, 0.5]),
            torch.randn_like(batch["latents"]),
        )
    with pytest.raises(ValueError, match=r"needs an image-to-video transformer"):
        make_spec(tiny_model_factory("cogvideox"), "cogvideox", task="i2v").check_bucket(BUCKET)
    with pytest.raises(ValueError, match=r"Set model.task = \"i2v\""):
        make_spec(tiny_model_factory("cogvideox", task="i2v"), "cogvideox").check_bucket(BUCKET)


def test_i2v_lora_and_full_exports_load_into_the_i2v_pipeline(tiny_model_factory, tmp_path):
    """The LoRA file read by CogVideoXImageToVideoPipeline.load_lora_weights reproduces the in-memory
    model, whose videos depend on the image; the full export overrides the i2v transformer."""
    from diffusers import CogVideoXImageToVideoPipeline
    from peft.utils import get_peft_model_state_dict

    folder = tiny_model_factory("cogvideox", task="i2v")
    spec = i2v_spec(tiny_model_factory)
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    in_memory = pipeline_latents(spec, spec.build_pipeline(transformer), image=I2V_IMAGE)
    fresh = CogVideoXImageToVideoPipeline.from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    assert (pipeline_latents(spec, fresh, image=I2V_IMAGE) - in_memory).abs().max() > 1e-2
    fresh.load_lora_weights(tmp_path / "lora")
    torch.testing.assert_close(pipeline_latents(spec, fresh, image=I2V_IMAGE), in_memory, atol=1e-4, rtol=1e-4)

    other = pipeline_latents(spec, fresh, image=255 - I2V_IMAGE)
    assert (other - in_memory).abs().max() > 1e-2, "the image did not condition the video"
    frames = spec.generate(fresh, "a rabbit", BUCKET, steps=1, seed=0, image=I2V_IMAGE)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0
    with pytest.raises(ValueError, match="cogvideox i2v generation needs an image"):
        spec.generate(fresh, "a rabbit", BUCKET, steps=1, seed=0)

    full = spec.load_transformer()
    with torch.no_grad():
        full.patch_embed.proj.weight.add_(0.5)  # the image channels' patch embedding is saved too
    override = make_spec(
        folder, "cogvideox", task="i2v", components={"transformer": str(spec.save_full(full, tmp_path / "full"))}
    ).load_transformer()
    assert override.config.in_channels == 32
    assert torch.equal(override.patch_embed.proj.weight, full.patch_embed.proj.weight)
    assert isinstance(spec.build_pipeline(override), CogVideoXImageToVideoPipeline)


def test_i2v_checkpoint_variants_follow_the_pipeline(tiny_model_factory, tmp_path):
    """CogVideoX 1.5 I2V: `ofs` = 2.0 goes to the transformer and a VAE with invert_scale_latents
    divides the image latents by scaling_factor (prepare_latents); the 5B-I2V's learned positional
    embedding refuses other bucket sizes."""
    folder, transformer_dir = variant(
        tiny_model_factory, tmp_path / "i2v15", in_channels=32, patch_size_t=2, patch_bias=False, ofs_embed_dim=32
    )  # = time_embed_dim, as 1.5
    spec = make_spec(folder, "cogvideox", task="i2v", components={"transformer": transformer_dir})
    encoders = spec.load_stage1()
    encoders["vae"].register_to_config(invert_scale_latents=True)
    bucket = Bucket(13, 64, 96)
    clip = video(1, bucket=bucket)
    batch = {**spec.encode_text(encoders, ["a cat"]), **spec.encode_video(encoders, clip)}
    mode = encoders["vae"].encode(clip[:, :, :1]).latent_dist.mode()
    torch.testing.assert_close(batch["image_latents"], mode / encoders["vae"].config.scaling_factor)
    transformer = spec.load_transformer()
    seen = capture_transformer_inputs(transformer)
    out = spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    assert seen["ofs"].tolist() == [2.0] and out.prediction.shape == (1, 16, 4, 8, 12)

    _, learned_dir = variant(
        tiny_model_factory,
        tmp_path / "learned",
        in_channels=32,
        use_learned_positional_embeddings=True,
        max_text_seq_length=16,
    )
    learned = make_spec(folder, "cogvideox", task="i2v", components={"transformer": learned_dir})
    learned.check_bucket(Bucket(5, 64, 96))  # the sample size (8 x 12 latents); any frame count
    with pytest.raises(ValueError, match=r"covers exactly 64x96 pixels.*9x64x96"):
        learned.check_bucket(Bucket(9, 64, 64))
