"""LTX-2, video stream only: stage 1 stores the text LTX2Pipeline feeds the video stream, training runs
the video stream without the audio cross-attention (so the unused audio input cannot matter), a full
fine-tune leaves exactly the gradient-less audio parameters frozen, and LoRA stays off the audio
stream (tiny real models throughout)."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.shared.models.ltx2 import AUDIO_PARAMETERS

BUCKET = Bucket(9, 64, 96)
PROMPT = "a big rabbit walks in the meadow"


def make_spec(folder, **kw):
    return build_spec(ModelConfig(family="ltx-2", path=str(folder), max_text_tokens=16, **kw), frame_rate=12.0)


def capture(transformer):
    seen = []
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
    return seen


def test_stage1_text_is_what_the_pipeline_feeds_the_video_stream(tiny_model_factory):
    """The pipeline's own call (one pass per step: no guidance terms) gives the transformer the stored
    text, mask and frame rate; `frame_rate` is validation's setting, the bucket rate of training."""
    spec = make_spec(tiny_model_factory("ltx-2"))
    encoders = spec.load_stage1()
    stored = spec.encode_text(encoders, [PROMPT])
    transformer = spec.load_transformer()
    pipeline = spec.build_pipeline(transformer, **encoders)
    seen = capture(transformer)
    inputs = spec.pipeline_inputs(PROMPT, BUCKET, steps=2, seed=0)
    assert inputs["frame_rate"] == 12.0 and inputs["max_sequence_length"] == 16
    pipeline(**inputs, guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, output_type="latent")
    inference = seen.pop()
    torch.testing.assert_close(inference["encoder_hidden_states"], stored["prompt_embeds"])
    torch.testing.assert_close(inference["encoder_attention_mask"].float(), stored["prompt_attention_mask"])
    assert inference["fps"] == 12.0 and inference["use_cross_timestep"] is False  # LTX-2.0's sampling


def test_training_runs_the_video_stream_alone_and_full_fine_tune_freezes_the_audio(tiny_model_factory):
    spec = make_spec(tiny_model_factory("ltx-2"))
    encoders = spec.load_stage1()
    video = torch.rand(2, 3, BUCKET.frames, BUCKET.height, BUCKET.width, generator=torch.Generator().manual_seed(0))
    video = video * 2 - 1
    batch = {**spec.encode_text(encoders, [PROMPT, "people riding bikes"]), **spec.encode_video(encoders, video)}
    transformer = spec.load_transformer()
    spec.full_trainable(transformer)
    seen = capture(transformer)
    sigmas = torch.tensor([0.3, 0.8])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, sigmas, noise)
    inputs = seen.pop()
    assert inputs["isolate_modalities"] is True and inputs["fps"] == 12.0
    assert inputs["audio_hidden_states"].shape == (2, 1, transformer.config.audio_in_channels)
    torch.testing.assert_close(inputs["timestep"], sigmas * 1000)
    torch.testing.assert_close(out.target, noise - batch["latents"])

    # No audio <-> video cross-attention: any audio input gives the same video prediction.
    with torch.no_grad():
        other = transformer(**{**inputs, "audio_hidden_states": torch.randn_like(inputs["audio_hidden_states"]),
                               "audio_encoder_hidden_states": torch.randn_like(inputs["audio_encoder_hidden_states"])})
        coupled = transformer(**{**inputs, "isolate_modalities": False,
                                 "audio_hidden_states": torch.randn_like(inputs["audio_hidden_states"])})
        same = transformer(**inputs)
    assert torch.equal(other[0], same[0]) and not torch.allclose(coupled[0], same[0])

    # Full fine-tune: exactly the parameters that get a gradient train; the audio stream stays frozen.
    ((out.prediction - out.target) ** 2).mean().backward()
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    frozen = {n for n, p in transformer.named_parameters() if not p.requires_grad}
    assert trainable == with_grad and "proj_out.weight" in trainable
    assert frozen and all(AUDIO_PARAMETERS.search(n) for n in frozen)
    assert {"audio_proj_out.weight", "transformer_blocks.0.audio_to_video_attn.to_q.weight"} <= frozen


def test_lora_stays_on_the_video_stream(tiny_model_factory):
    spec = make_spec(tiny_model_factory("ltx-2"))
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=2.0, targets=None)
    lora = {n.split(".lora_")[0] for n, _ in transformer.named_parameters() if "lora_" in n}
    assert "transformer_blocks.1.attn2.to_out.0" in lora and not any(AUDIO_PARAMETERS.search(n) for n in lora)
    with pytest.raises(ValueError, match=r"reach the audio stream \(transformer_blocks\.0\.audio_attn1\.to_q"):
        spec.add_lora(spec.load_transformer(), rank=2, alpha=2.0, targets=["to_q"])


# ----------------------------------------------------------------------------- image-to-video
# One pass per step, video and audio: no classifier-free, spatio-temporal or modality guidance batch.
NO_GUIDANCE = dict(guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
                   modality_scale=1.0, audio_modality_scale=1.0)


def make_i2v_spec(tiny_model_factory):
    return make_spec(tiny_model_factory("ltx-2", task="i2v"), task="i2v")


def uint8_clip(seed=0):
    """(video in [-1, 1] as stage 1 makes it, its uint8 frames (F, H, W, 3))."""
    pixels = torch.randint(0, 256, (BUCKET.frames, BUCKET.height, BUCKET.width, 3), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(seed))
    return pixels.permute(3, 0, 1, 2)[None].float() / 127.5 - 1, pixels


def test_i2v_first_latent_frame_is_the_pipelines_image_latent(tiny_model_factory):
    """The clip's first latent frame equals what LTX2ImageToVideoPipeline.prepare_latents makes of the first
    frame as an image (causal VAE, normalised as it normalises), and the pipeline's conditioning mask covers
    exactly the tokens training keeps clean."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    folder = tiny_model_factory("ltx-2", task="i2v")
    spec = make_i2v_spec(tiny_model_factory)
    assert spec.pipeline_class() is LTX2ImageToVideoPipeline and spec.condition_shapes(BUCKET).keys() == {
        "prompt_embeds", "prompt_attention_mask", "latents"}  # latents only: the image is their first frame
    clip, pixels = uint8_clip()
    latents = spec.encode_video(spec.load_stage1(), clip)["latents"]
    pipeline = LTX2ImageToVideoPipeline.from_pretrained(folder)
    image = pipeline.video_processor.preprocess(Image.fromarray(pixels[0].numpy()), height=BUCKET.height,
                                                width=BUCKET.width)
    packed, mask = pipeline.prepare_latents(image, 1, 8, BUCKET.height, BUCKET.width, BUCKET.frames, 0.0,
                                            torch.float32, "cpu", torch.Generator().manual_seed(0))
    tokens = LTX2ImageToVideoPipeline._pack_latents(latents, 1, 1)
    image_tokens = int(mask.sum())
    assert image_tokens == 2 * 3 and mask[0, :image_tokens].eq(1).all()  # the first latent frame's 2 x 3 tokens
    torch.testing.assert_close(packed[:, :image_tokens], tokens[:, :image_tokens], atol=1e-5, rtol=1e-5)
    timestep = spec.token_timesteps(torch.tensor([700.0]), (2, 2, 3))
    torch.testing.assert_close(timestep, 700.0 * (1 - mask))  # the pipeline's per-token timestep


def test_i2v_forward_feeds_what_the_pipeline_feeds(tiny_model_factory):
    """At the pipeline's first step (sigma 1) training on the clip whose first frame is the image feeds the
    transformer exactly the pipeline's tokens (clean image latent, then its noise), per-token timesteps,
    audio timestep and text; the image frame is left out of the loss and only the LoRA trains."""
    from diffusers import LTX2ImageToVideoPipeline

    spec = make_i2v_spec(tiny_model_factory)
    encoders = spec.load_stage1()
    clip, pixels = uint8_clip()
    batch = {**spec.encode_text(encoders, [PROMPT]), **spec.encode_video(encoders, clip)}
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=2.0, targets=None)
    seen = capture(transformer)
    pipeline = spec.build_pipeline(transformer, **encoders)
    inputs = spec.pipeline_inputs(PROMPT, BUCKET, steps=2, seed=0, image=pixels[0].numpy())
    pipeline(**inputs, **NO_GUIDANCE, image_crf=0, output_type="latent")  # crf 0: the frame as it is
    inference = seen[0]
    assert inference["timestep"].shape == (1, 12) and float(inference["audio_timestep"]) == 1000.0

    noise = LTX2ImageToVideoPipeline._unpack_latents(inference["hidden_states"], 2, 2, 3, 1, 1)  # sigma 1: noise
    out = spec.forward(transformer, batch, torch.tensor([1.0]), noise)
    training = seen[-1]
    torch.testing.assert_close(training["hidden_states"], inference["hidden_states"], atol=1e-5, rtol=1e-5)
    for name in ("timestep", "audio_timestep", "sigma", "encoder_hidden_states"):
        torch.testing.assert_close(training[name], inference[name], msg=name)
    assert training["fps"] == inference["fps"] == 12.0 and training["isolate_modalities"] is True
    assert out.weight.flatten().tolist() == [0.0, 1.0]  # the image frame, whose prediction the pipeline drops
    ((out.weight * (out.prediction - out.target) ** 2).mean()).backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None}
    assert with_grad and with_grad == {n for n, p in transformer.named_parameters() if "lora_" in n}


def test_i2v_exports_load_back_and_generate_from_the_image(tiny_model_factory, tmp_path):
    """The LoRA file and the full weights give LTX2ImageToVideoPipeline the in-memory model (the ComfyUI file
    is t2v's: test_comfy_keys.py), and the image conditions the video it renders."""
    import numpy as np
    from diffusers import LTX2ImageToVideoPipeline
    from lora_init import randomise_lora
    from peft.utils import get_peft_model_state_dict

    folder = tiny_model_factory("ltx-2", task="i2v")
    spec = make_i2v_spec(tiny_model_factory)
    image = uint8_clip()[1][0].numpy()

    def latents(pipeline, picture=image):
        inputs = spec.pipeline_inputs(PROMPT, BUCKET, steps=2, seed=0, image=picture)
        return pipeline(**inputs, **NO_GUIDANCE, output_type="latent").frames.float()

    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path / "lora")
    in_memory = latents(spec.build_pipeline(transformer))
    fresh = LTX2ImageToVideoPipeline.from_pretrained(folder)
    fresh.set_progress_bar_config(disable=True)
    assert (latents(fresh) - in_memory).abs().max() > 1e-2
    spec.load_lora(fresh, tmp_path / "lora")
    torch.testing.assert_close(latents(fresh), in_memory, atol=1e-4, rtol=1e-4)

    full = spec.load_transformer()
    with torch.no_grad():
        full.proj_out.weight.add_(0.5)
    override = make_spec(folder, task="i2v", components={"transformer": str(spec.save_full(full, tmp_path / "full"))})
    loaded = override.load_transformer()
    assert all(torch.equal(v, full.state_dict()[k]) for k, v in loaded.state_dict().items())
    pipeline = override.build_pipeline(loaded)
    frames = override.generate(pipeline, PROMPT, BUCKET, steps=2, seed=0, image=image, **NO_GUIDANCE)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0
    other = override.generate(pipeline, PROMPT, BUCKET, steps=2, seed=0, image=255 - image, **NO_GUIDANCE)
    assert np.abs(frames.astype(int) - other).mean() > 1, "the image did not condition the video"
    with pytest.raises(ValueError, match="ltx-2 i2v generation needs an image"):
        override.generate(pipeline, PROMPT, BUCKET, steps=2, seed=0)
