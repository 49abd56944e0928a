"""CogVideoX: the v-prediction objective on the scheduler's own schedule, transformer inputs that match
CogVideoXPipeline's, the sincos text-length rule and CogVideoX 1.5's temporal patch (tiny real models)."""

from __future__ import annotations

import pytest
import torch
from test_models import BUCKET, capture_transformer_inputs, make_spec, stage1

from vt.shared.buckets import Bucket


def variant(tiny_model_factory, folder, seed=0, **changes):
    """A transformer folder like the tiny preset's with `changes` to its config (e.g. 1.5, sincos)."""
    from diffusers import CogVideoXTransformer3DModel

    base = tiny_model_factory("cogvideox")
    config = {k: v for k, v in CogVideoXTransformer3DModel.load_config(base, subfolder="transformer").items()
              if not k.startswith("_")}
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
        result = scheduler.step(out.target[i:i + 1], step, noisy[i:i + 1])
        torch.testing.assert_close(result.pred_original_sample, x0[i:i + 1], atol=1e-4, rtol=1e-4)


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
    batch = {**spec.encode_text(encoders, ["a rabbit in a meadow"]),
             "latents": torch.randn(1, *spec.latent_shape(bucket))}
    spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    ours = calls.pop()
    assert ours["hidden_states"].shape[1:] == piped["hidden_states"].shape[1:]
    assert ours["timestep"].dtype == piped["timestep"].dtype == torch.int64
    cos, sin = ours["image_rotary_emb"]
    torch.testing.assert_close(cos, piped["image_rotary_emb"][0])
    torch.testing.assert_close(sin, piped["image_rotary_emb"][1])
    # The pipeline runs guidance: its text batch is [negative, prompt].
    torch.testing.assert_close(ours["encoder_hidden_states"][0], piped["encoder_hidden_states"][1], atol=1e-5, rtol=1e-5)


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
        lambda module, args, kwargs: seen.update(tokens=kwargs["hidden_states"].shape[1]), with_kwargs=True)
    batch = {**spec.encode_text(spec.load_stage1(), ["a cat"]), "latents": torch.randn(1, *latent)}
    out = spec.forward(transformer, batch, torch.tensor([0.3]), torch.randn_like(batch["latents"]))
    assert seen["tokens"] == spec.tokens_per_sample(latent) and out.prediction.shape == (1, *latent)


def test_sincos_transformer_needs_its_text_length(tiny_model_factory, tmp_path):
    """The 2B layout (sincos positions over max_text_seq_length text tokens) refuses another text
    length at start-up (check_bucket, which both stages call first), naming the key to set."""
    folder, transformer_dir = variant(tiny_model_factory, tmp_path / "sincos", use_rotary_positional_embeddings=False,
                                      max_text_seq_length=16)
    spec = make_spec(folder, "cogvideox", components={"transformer": transformer_dir})  # max_text_tokens=16
    batch = stage1(spec, batch=1)
    out = spec.forward(spec.load_transformer(), batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    assert torch.isfinite(out.prediction).all()

    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec

    unset = build_spec(ModelConfig(family="cogvideox", path=str(folder), components={"transformer": transformer_dir}),
                       frame_rate=8.0)
    with pytest.raises(ValueError, match=r"model.max_text_tokens unset \(226.*max_text_seq_length = 16.*"
                                         r"Set model.max_text_tokens = 16"):
        unset.check_bucket(BUCKET)
    other = build_spec(ModelConfig(family="cogvideox", path=str(folder), max_text_tokens=32,
                                   components={"transformer": transformer_dir}), frame_rate=8.0)
    with pytest.raises(ValueError, match=r"model.max_text_tokens = 32 does not fit"):
        other.encode_text(other.load_stage1(), ["a cat"])
