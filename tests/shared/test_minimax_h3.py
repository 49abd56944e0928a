"""MiniMax H3, text-to-video-and-audio: training feeds the transformer exactly what the modular pipeline feeds it at its
first denoising step (both streams at one sigma), the audio latents are the pipeline's soundtrack encoding, the audio
heads train only with model.audio, and validation returns the pipeline's stereo sound (tiny real models throughout)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.shared.models.minimax_h3_sound import AUDIO_PARAMETERS

PROMPT = "a big rabbit walks in the meadow"
SHORTEST = Bucket(124, 32, 32)  # the pipeline's shortest video: 5 s at 24 fps, 17k+5 frames


def make_spec(folder, **kw):
    return build_spec(ModelConfig(family="minimax-h3", path=str(folder), max_text_tokens=16, **kw), frame_rate=24.0)


def capture(transformer):
    """The kwargs of every call, copied (the pipeline steps its rows in place after the call)."""
    seen = []
    transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(
            {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        ),
        with_kwargs=True,
    )
    return seen


def test_training_feeds_the_transformer_what_the_pipeline_feeds_it_first(tiny_model_factory):
    """At the first step both of the pipeline's schedules are at sigma 1 (t = 0): training at sigma 1 with the same
    noise builds the same packed sequence (rows, positions, tags, indices, timestep) and gets the same prediction."""
    spec = make_spec(tiny_model_factory("minimax-h3"), audio=True)
    encoders = spec.load_stage1()
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer, **encoders)
    latent, audio_shape = spec.latent_shape(SHORTEST), spec.sound.latent_shape(SHORTEST)
    assert latent == (4, 37, 2, 2) and audio_shape == (2, 4, 207)  # what the pipeline's layout step resolves
    noise = torch.randn(1, *latent, generator=torch.Generator().manual_seed(1))
    audio_noise = torch.randn(1, *audio_shape, generator=torch.Generator().manual_seed(2))
    seen = capture(transformer)
    inputs = spec.pipeline_inputs(PROMPT, SHORTEST, steps=2, seed=0)
    pipeline(**inputs, latents=noise, audio_latents=audio_noise[0], output_type="latent")
    inference = seen[0]

    stored = spec.encode_text(encoders, [PROMPT])
    batch = {
        **stored,
        "latents": torch.randn(1, *latent),
        "audio_latents": torch.randn(1, *audio_shape),
        "audio_noise": audio_noise,
    }
    out = spec.forward(transformer, batch, torch.tensor([1.0]), noise)
    training = seen[-1]
    assert set(training) == set(inference) - {"attention_kwargs"}
    for name, value in training.items():
        if isinstance(value, torch.Tensor):
            torch.testing.assert_close(value, inference[name], atol=0, rtol=0, msg=name)
    assert training["timestep"].tolist() == [0.0] and training["encoder_hidden_states"].shape[1] < 16
    with torch.no_grad():
        video, sound = transformer(**inference)
    assert out.prediction.shape == (1, *latent) and out.audio.prediction.shape == (1, *audio_shape)
    torch.testing.assert_close(out.audio.prediction[0].permute(0, 2, 1).reshape(-1, 4), sound[0])
    torch.testing.assert_close(out.target, batch["latents"] - noise)  # the data-ward velocity
    torch.testing.assert_close(out.audio.target, batch["audio_latents"] - audio_noise)


def test_audio_rows_take_the_audio_schedules_sigma_at_every_step(tiny_model_factory):
    """The pipeline steps video on its shift-12 schedule and audio on its shift-3 one; training pairs a video sigma
    with the audio sigma of the same step, so each step's rows and timesteps are the pipeline's."""
    spec = make_spec(tiny_model_factory("minimax-h3"), audio=True)
    assert spec.schedule_shifts == (12.0, 3.0)
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer, text_encoders=False)
    conditions = spec.encode_validation_text(spec.load_stage1(), PROMPT)
    seen = capture(transformer)
    pipeline(**spec.pipeline_inputs(None, SHORTEST, steps=4, seed=0), **conditions, output_type="latent")
    assert len(seen) == 3
    batch = {
        **conditions,
        "latents": torch.zeros(1, *spec.latent_shape(SHORTEST)),
        "audio_latents": torch.zeros(1, *spec.sound.latent_shape(SHORTEST)),
    }
    for step in seen[1:]:
        video_t, audio_t = (
            step["timestep"][step["timestep_indices"][step["video_indices"][0]]],
            step["timestep"][step["timestep_indices"][step["audio_indices"][0]]],
        )
        assert audio_t > video_t  # the audio schedule is ahead: less noise at the same step
        # the step's rows as the noise itself (x0 = 0, so the noisy rows are sigma x noise): rows / sigma
        noise = unpatchified(spec, step["hidden_states"][0]) / (1 - video_t)
        audio_noise = step["audio_hidden_states"][0].reshape(2, -1, 4).permute(0, 2, 1)[None] / (1 - audio_t)
        out = spec.forward(transformer, {**batch, "audio_noise": audio_noise}, (1 - video_t)[None], noise[None])
        training = seen[-1]
        torch.testing.assert_close(training["timestep"], step["timestep"], atol=1e-6, rtol=0)
        assert torch.equal(training["timestep_indices"], step["timestep_indices"])
        torch.testing.assert_close(training["hidden_states"], step["hidden_states"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(training["audio_hidden_states"], step["audio_hidden_states"], atol=1e-5, rtol=1e-5)
        assert out.audio is not None


def unpatchified(spec, rows):
    from vt.shared.models.minimax_h3_layout import unpatchify

    return unpatchify(rows, spec.latent_shape(SHORTEST), (1, 2, 2))


def test_audio_latents_are_the_pipelines_soundtrack_encoding(tiny_model_factory):
    """Each stereo channel through the mono audio VAE (posterior mode), normalised as the audio decode step
    denormalises; the length is the clip's time span in whole hops."""
    spec = make_spec(tiny_model_factory("minimax-h3"), audio=True)
    bucket = Bucket(22, 32, 64)
    assert spec.sound.format().sample_rate == 8000 and spec.sound.format().channels == 2
    samples = spec.sound.samples(bucket)
    audio = torch.rand(2, 2, samples, generator=torch.Generator().manual_seed(0)) * 2 - 1
    vae = spec.load_component("audio_vae")
    latents = spec.sound.encode({"audio_vae": vae}, audio)["audio_latents"]
    assert latents.shape == (2, *spec.sound.latent_shape(bucket))
    mean, std = (torch.tensor(vae.config[k]).view(1, -1, 1) for k in ("latents_mean", "latents_std"))
    raw = vae.encode(audio[1, :, None]).latent_dist.mode()
    torch.testing.assert_close(latents[1] * std + mean, raw, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"\(B, 2, samples\)"):
        spec.sound.encode({"audio_vae": vae}, audio[:, :1])
    with pytest.raises(ValueError, match="buckets.fps = 24"):
        build_spec(
            ModelConfig(family="minimax-h3", path=str(tiny_model_factory("minimax-h3")), audio=True), frame_rate=12.0
        )


def test_audio_heads_train_only_with_audio(tiny_model_factory):
    folder = tiny_model_factory("minimax-h3")
    video_only, joint = make_spec(folder), make_spec(folder, audio=True)
    encoders = joint.load_stage1()
    bucket = Bucket(5, 32, 64)
    video = (
        torch.rand(2, 3, bucket.frames, bucket.height, bucket.width, generator=torch.Generator().manual_seed(0)) * 2 - 1
    )
    batch = {**joint.encode_text(encoders, [PROMPT, ""]), **joint.encode_video(encoders, video)}
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    sigmas = torch.tensor([0.3, 0.8])

    # Video only: no audio rows, the audio heads frozen in a full fine-tune and refused as LoRA targets.
    transformer = video_only.load_transformer()
    video_only.full_trainable(transformer)
    seen = capture(transformer)
    out = video_only.forward(transformer, batch, sigmas, noise)
    assert out.audio is None and seen[0]["audio_indices"].numel() == 0
    assert seen[1]["text_indices"].numel() == 0  # the empty caption: no text rows
    ((out.prediction - out.target) ** 2).mean().backward()
    frozen = {n for n, p in transformer.named_parameters() if not p.requires_grad}
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    assert frozen == {n for n, _ in transformer.named_parameters() if AUDIO_PARAMETERS.search(n)} != set()
    assert with_grad == {n for n, p in transformer.named_parameters() if p.requires_grad}
    with pytest.raises(ValueError, match="reach the audio stream.*model.audio = true"):
        video_only.add_lora(video_only.load_transformer(), rank=4, alpha=4.0, targets=["audio_proj_out"])

    # Joint: both streams at each sample's sigma; every parameter gets a gradient, audio LoRA targets allowed.
    samples = joint.sound.samples(bucket)
    audio = torch.rand(2, 2, samples, generator=torch.Generator().manual_seed(3)) * 2 - 1
    batch.update(joint.sound.encode(encoders, audio))
    batch["audio_noise"] = torch.randn(batch["audio_latents"].shape, generator=torch.Generator().manual_seed(4))
    transformer = joint.load_transformer()
    joint.full_trainable(transformer)
    out = joint.forward(transformer, batch, sigmas, noise)
    loss = ((out.prediction - out.target) ** 2).mean() + ((out.audio.prediction - out.audio.target) ** 2).mean()
    loss.backward()
    assert all(p.grad is not None for p in transformer.parameters())
    joint.add_lora(joint.load_transformer(), rank=4, alpha=4.0, targets=["audio_proj_out", "attn.to_q"])


def test_validation_generates_the_pipelines_shortest_video_with_its_sound(tiny_model_factory):
    """From stored text (no text encoder in the pipeline); a bucket under 5 s samples the pipeline's 124 frames."""
    spec = make_spec(tiny_model_factory("minimax-h3"), audio=True)
    conditions = spec.encode_validation_text(spec.load_stage1(), PROMPT)
    pipeline = spec.build_pipeline(spec.load_transformer(), text_encoders=False)
    assert pipeline.text_encoder is None
    frames, sound = spec.generate_clip(pipeline, None, Bucket(5, 32, 64), steps=2, seed=0, conditions=conditions)
    assert frames.shape == (124, 32, 64, 3) and frames.dtype == np.uint8 and frames.std() > 0
    assert sound.sample_rate == 8000 and sound.waveform.shape[0] == 2
    assert sound.waveform.shape[1] >= 124 / 24 * 8000 and np.abs(sound.waveform).max() > 0


def test_comfy_file_with_every_kind_of_target_loads_back_through_diffusers(tiny_model_factory, tmp_path):
    """The original-name file (ComfyUI's MiniMaxH3Model names: fused qkv_proj, SwiGLU fc1 as [gate; value], the
    refiner, AdaLN and the patch/output projections) read by diffusers' own H3 LoRA conversion gives the in-memory
    model's denoised latents."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from vt.shared.models.minimax_h3_pipeline import MiniMaxH3Pipeline

    from helpers.lora_init import randomise_lora

    folder = tiny_model_factory("minimax-h3")
    spec = make_spec(folder, audio=True)
    transformer = spec.load_transformer()
    targets = (
        r"(transformer_blocks|token_refiner\.refiner_blocks)\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2)"
        r"|adaln_proj\.linear)|proj_in|audio_proj_in|context_embedder|proj_out|audio_proj_out|norm_out\.linear"
    )
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=targets)
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    comfy = load_file(tmp_path / "lora" / "lora_comfyui.safetensors")
    for name in (
        "blocks.1.mlp.fc1",
        "token_refiner.blocks.0.attn.qkv_proj",
        "final_layer.audio_out",
        "video_patch_proj",
        "blocks.0.adaln_proj.linear",
        "final_layer.adaln_proj.linear",
    ):
        assert f"diffusion_model.{name}.lora_A.weight" in comfy, name
    assert comfy["diffusion_model.blocks.0.attn.qkv_proj.lora_B.weight"].shape == (3 * 32, 3 * 4)

    def latents(pipeline):
        inputs = spec.pipeline_inputs("a rabbit in a meadow", Bucket(5, 32, 32), steps=2, seed=0)
        out = pipeline(**inputs, output_type="latent")
        return torch.cat([out.frames.flatten(), out.audio.flatten()])

    in_memory = latents(spec.build_pipeline(transformer))
    fresh = MiniMaxH3Pipeline.from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    base = latents(fresh)
    spec.load_lora(fresh, tmp_path / "lora", weight_name="lora_comfyui.safetensors")
    assert (base - in_memory).abs().max() > 1e-2
    torch.testing.assert_close(latents(fresh), in_memory, atol=1e-4, rtol=1e-4)
