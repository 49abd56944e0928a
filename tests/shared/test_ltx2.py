"""LTX-2 (tiny real models throughout). Video stream only: stage 1 stores the text LTX2Pipeline feeds the
video stream, training runs the video stream without the audio cross-attention (so the unused audio input
cannot matter), a full fine-tune leaves exactly the gradient-less audio parameters frozen, and LoRA stays off
the audio stream. With model.audio (LTX-2.0 and LTX-2.3 presets): training feeds the transformer what the
pipeline's first denoising step feeds it, video and audio (t2v and i2v), one sigma for both streams, every
parameter and default adapter trains, both LoRA files load back with the audio modules, and validation's
clip carries the vocoder's sound."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec
from vt.shared.models.ltx2_sound import AUDIO_PARAMETERS

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
        other = transformer(
            **{
                **inputs,
                "audio_hidden_states": torch.randn_like(inputs["audio_hidden_states"]),
                "audio_encoder_hidden_states": torch.randn_like(inputs["audio_encoder_hidden_states"]),
            }
        )
        coupled = transformer(
            **{
                **inputs,
                "isolate_modalities": False,
                "audio_hidden_states": torch.randn_like(inputs["audio_hidden_states"]),
            }
        )
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
NO_GUIDANCE = dict(
    guidance_scale=1.0,
    audio_guidance_scale=1.0,
    stg_scale=0.0,
    audio_stg_scale=0.0,
    modality_scale=1.0,
    audio_modality_scale=1.0,
)


def make_i2v_spec(tiny_model_factory):
    return make_spec(tiny_model_factory("ltx-2", task="i2v"), task="i2v")


def uint8_clip(seed=0):
    """(video in [-1, 1] as stage 1 makes it, its uint8 frames (F, H, W, 3))."""
    pixels = torch.randint(
        0,
        256,
        (BUCKET.frames, BUCKET.height, BUCKET.width, 3),
        dtype=torch.uint8,
        generator=torch.Generator().manual_seed(seed),
    )
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
        "prompt_embeds",
        "prompt_attention_mask",
        "latents",
    }  # latents only: the image is their first frame
    clip, pixels = uint8_clip()
    latents = spec.encode_video(spec.load_stage1(), clip)["latents"]
    pipeline = LTX2ImageToVideoPipeline.from_pretrained(folder)
    image = pipeline.video_processor.preprocess(
        Image.fromarray(pixels[0].numpy()), height=BUCKET.height, width=BUCKET.width
    )
    packed, mask = pipeline.prepare_latents(
        image,
        1,
        8,
        BUCKET.height,
        BUCKET.width,
        BUCKET.frames,
        0.0,
        torch.float32,
        "cpu",
        torch.Generator().manual_seed(0),
    )
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
    from peft.utils import get_peft_model_state_dict

    from helpers.lora_init import randomise_lora

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


# ----------------------------------------------------------------------------- video and audio (model.audio)
@pytest.fixture(scope="module", params=["2.0", "2.3"])
def av_folder(request, tiny_model_factory, tmp_path_factory):
    """(version, tiny preset folder): LTX-2.0's (the family preset) and LTX-2.3's (`presets.ltx2.parts_23`)."""
    from vt.shared.models.ltx2 import LTX2Spec

    if request.param == "2.0":
        return "2.0", tiny_model_factory("ltx-2")
    from vt.shared.models.presets.ltx2 import parts_23

    return "2.3", LTX2Spec.make_tiny(tmp_path_factory.mktemp("ltx23-tiny"), parts=parts_23)


def av_spec(folder, **kw):
    return make_spec(folder, audio=True, **kw)


def first_step(spec, transformer, encoders) -> tuple[list[dict], tuple]:
    """(every call's inputs from now on, the outputs of the first): LTX2Pipeline's first denoising step (sigma
    1, one pass) is the first call."""
    seen, outputs = capture(transformer), []
    transformer.register_forward_hook(lambda module, args, out: outputs.append(out))
    pipeline = spec.build_pipeline(transformer, **encoders)
    pipeline(**spec.pipeline_inputs(PROMPT, BUCKET, steps=2, seed=0), **NO_GUIDANCE, output_type="latent")
    return seen, outputs[0]


def test_audio_forward_feeds_what_the_pipeline_feeds(av_folder):
    """At the pipeline's first step (sigma 1) training on a clip feeds the transformer exactly the pipeline's
    video and audio tokens, both text embeddings and masks, timesteps and cross-attention settings, and gets
    its predictions back: stage 1's `audio_prompt_embeds` is the connectors' audio embedding the pipeline
    makes, the audio latents are packed and unpacked as it packs them (LTX-2.0 and LTX-2.3 checkpoints)."""
    from diffusers import LTX2Pipeline

    version, folder = av_folder
    spec = av_spec(folder)
    assert spec.cross_timestep is (version == "2.3")
    assert type(spec.load_component("vocoder")).__name__ == (
        "LTX2VocoderWithBWE" if version == "2.3" else "LTX2Vocoder"
    )
    encoders = spec.load_stage1()
    text = spec.encode_text(encoders, [PROMPT])
    transformer = spec.load_transformer()
    seen, (video_out, audio_out) = first_step(spec, transformer, encoders)
    inference = seen[0]
    audio_frames = inference["audio_num_frames"]
    bins = inference["audio_hidden_states"].shape[-1] // 2  # 2 latent channels x mel bins per token
    noise = LTX2Pipeline._unpack_latents(inference["hidden_states"], 2, 2, 3, 1, 1)
    audio_noise = LTX2Pipeline._unpack_audio_latents(inference["audio_hidden_states"], audio_frames, bins)
    generator = torch.Generator().manual_seed(3)
    batch = {
        **text,
        "latents": torch.randn(noise.shape, generator=generator),
        "audio_latents": torch.randn(audio_noise.shape, generator=generator),
        "audio_noise": audio_noise,
    }
    out = spec.forward(transformer, batch, torch.tensor([1.0]), noise)
    training = seen[-1]

    for name in (
        "hidden_states",
        "audio_hidden_states",
        "encoder_hidden_states",
        "audio_encoder_hidden_states",
        "timestep",
        "sigma",
    ):
        torch.testing.assert_close(training[name], inference[name], msg=name)
    torch.testing.assert_close(training["audio_timestep"], inference["timestep"])  # the pipeline's default: the same
    for name in ("encoder_attention_mask", "audio_encoder_attention_mask"):
        torch.testing.assert_close(training[name].float(), inference[name].float(), msg=name)
    for name in (
        "audio_num_frames",
        "fps",
        "isolate_modalities",
        "use_cross_timestep",
        "num_frames",
        "height",
        "width",
    ):
        assert training[name] == inference[name], name
    assert training["isolate_modalities"] is False and training["use_cross_timestep"] is (version == "2.3")
    torch.testing.assert_close(
        transformer.audio_rope.prepare_audio_coords(1, audio_frames, "cpu"), inference["audio_coords"]
    )  # what the transformer builds from audio_num_frames
    torch.testing.assert_close(out.prediction, LTX2Pipeline._unpack_latents(video_out.float(), 2, 2, 3, 1, 1))
    torch.testing.assert_close(
        out.audio.prediction, LTX2Pipeline._unpack_audio_latents(audio_out.float(), audio_frames, bins)
    )
    torch.testing.assert_close(out.audio.target, audio_noise - batch["audio_latents"])


def audio_batch(spec, encoders, size=2, seed=0):
    """A training batch of `size` random clips with random audio latents of the pipeline's audio length for
    BUCKET (19 latent frames: 9 frames at 12 fps, 16 kHz, hop 160, x4) and their audio noise."""
    generator = torch.Generator().manual_seed(seed)
    video = torch.rand(size, 3, BUCKET.frames, BUCKET.height, BUCKET.width, generator=generator) * 2 - 1
    batch = {**spec.encode_text(encoders, [PROMPT, "people riding bikes"][:size]), **spec.encode_video(encoders, video)}
    batch["audio_latents"] = torch.randn(size, 2, 19, 2, generator=generator)
    batch["audio_noise"] = torch.randn(size, 2, 19, 2, generator=generator)
    return batch


def test_audio_training_shares_the_sigma_and_trains_both_streams(av_folder):
    """One sigma per sample noises both streams and is the video, audio and cross-attention timestep; the video
    prediction depends on the audio (cross-attention on); the joint loss is finite and a full fine-tune trains
    every parameter, each of which gets a gradient (the audio stream and both cross-attention directions too)."""
    from diffusers import LTX2Pipeline

    from vt.train.objectives import joint_loss

    _, folder = av_folder
    spec = av_spec(folder)
    encoders = spec.load_stage1()
    batch = audio_batch(spec, encoders)
    transformer = spec.load_transformer()
    spec.full_trainable(transformer)
    seen = capture(transformer)
    sigmas = torch.tensor([0.3, 0.8])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    out = spec.forward(transformer, batch, sigmas, noise)
    inputs = seen.pop()
    for name in ("timestep", "audio_timestep", "sigma"):
        torch.testing.assert_close(inputs[name], sigmas * 1000, msg=name)
    noisy_audio = (1 - sigmas.view(2, 1, 1, 1)) * batch["audio_latents"] + sigmas.view(2, 1, 1, 1) * batch[
        "audio_noise"
    ]
    torch.testing.assert_close(inputs["audio_hidden_states"], LTX2Pipeline._pack_audio_latents(noisy_audio))
    assert out.audio.prediction.shape == out.audio.target.shape == (2, 2, 19, 2)

    with torch.no_grad():  # cross-attention on: other audio, other video prediction
        same = transformer(**inputs)[0]
        other = transformer(**{**inputs, "audio_hidden_states": torch.randn_like(inputs["audio_hidden_states"])})[0]
    assert not torch.allclose(other, same), "the audio does not reach the video"

    loss, audio_loss = joint_loss(out, audio_weight=0.5)
    assert torch.isfinite(loss) and torch.isfinite(audio_loss) and float(audio_loss.detach()) > 0
    loss.backward()
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert trainable == {n for n, _ in transformer.named_parameters()} == with_grad
    assert {
        "audio_proj_out.weight",
        "transformer_blocks.0.audio_to_video_attn.to_q.weight",
        "transformer_blocks.1.video_to_audio_attn.to_out.0.weight",
        "audio_time_embed.linear.weight",
    } <= with_grad


def test_audio_lora_defaults_reach_the_audio_stream_and_train(av_folder):
    """With model.audio the default LoRA targets add the audio attention and both cross-attention directions,
    targets reaching the audio stream are allowed, and every adapter gets a gradient from the joint loss."""
    from vt.shared.models.ltx2 import AUDIO_LORA_TARGETS, VIDEO_LORA_TARGETS
    from vt.train.objectives import joint_loss

    _, folder = av_folder
    spec = av_spec(folder)
    assert spec.default_lora_targets == VIDEO_LORA_TARGETS + AUDIO_LORA_TARGETS
    assert make_spec(folder).default_lora_targets == VIDEO_LORA_TARGETS  # video-only: unchanged
    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=2, alpha=2.0, targets=None)
    lora = {n.split(".lora_")[0] for n, _ in transformer.named_parameters() if "lora_" in n}
    for attn in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn"):
        assert f"transformer_blocks.1.{attn}.to_out.0" in lora, attn
    assert not any(".ff." in n or "audio_ff" in n for n in lora)
    from helpers.lora_init import randomise_lora

    randomise_lora(transformer, seed=1)  # lora_B non-zero, so lora_A gets a gradient too
    out = spec.forward(
        transformer,
        audio_batch(spec, spec.load_stage1()),
        torch.tensor([0.4, 0.9]),
        torch.randn(2, 8, 2, 2, 3, generator=torch.Generator().manual_seed(2)),
    )
    joint_loss(out, audio_weight=1.0)[0].backward()
    with_grad = {n for n, p in transformer.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad == {n for n, p in transformer.named_parameters() if "lora_" in n}
    spec.add_lora(spec.load_transformer(), rank=2, alpha=2.0, targets=["to_q", "audio_ff.net.2"])  # allowed with audio


def test_audio_lora_exports_load_back_with_the_audio_modules(av_folder, tmp_path):
    """A LoRA on both streams and the cross-attention: the diffusers file and the ComfyUI file (LTXAV's module
    names, scale in lora_B) each give a fresh LTX2Pipeline the in-memory model, video and audio alike."""
    from diffusers import LTX2Pipeline
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    from helpers.lora_init import randomise_lora

    _, folder = av_folder
    spec = av_spec(folder)

    def latents(pipeline):
        output = pipeline(**spec.pipeline_inputs(PROMPT, BUCKET, steps=2, seed=0), **NO_GUIDANCE, output_type="latent")
        return output.frames.float(), output.audio.float()

    transformer = spec.load_transformer()
    spec.add_lora(transformer, rank=4, alpha=8.0, targets=None)
    randomise_lora(transformer, seed=3)
    spec.save_lora(get_peft_model_state_dict(transformer), tmp_path)
    comfy = load_file(tmp_path / "lora_comfyui.safetensors")
    assert "diffusion_model.transformer_blocks.0.video_to_audio_attn.to_k.lora_A.weight" in comfy
    assert "diffusion_model.transformer_blocks.1.audio_attn2.to_out.0.lora_B.weight" in comfy
    video, audio = latents(spec.build_pipeline(transformer))
    for weight_name in ("pytorch_lora_weights.safetensors", "lora_comfyui.safetensors"):
        fresh = LTX2Pipeline.from_pretrained(folder)
        fresh.set_progress_bar_config(disable=True)
        if weight_name.startswith("pytorch"):  # the LoRA moves both streams
            base_video, base_audio = latents(fresh)
            assert (base_video - video).abs().max() > 1e-2 and (base_audio - audio).abs().max() > 1e-2
        spec.load_lora(fresh, tmp_path, weight_name=weight_name)
        got_video, got_audio = latents(fresh)
        torch.testing.assert_close(got_video, video, atol=1e-4, rtol=1e-4, msg=weight_name)
        torch.testing.assert_close(got_audio, audio, atol=1e-4, rtol=1e-4, msg=weight_name)


def test_audio_validation_clip_carries_the_vocoders_sound(av_folder, tmp_path):
    """generate_clip returns the pipeline's own vocoder output as a Sound at the vocoder's rate (2.0: 16 kHz in
    the tiny preset, 2.3's bandwidth extension: 32 kHz; the tiny vocoders' lengths are not a clip's duration),
    and the mp4 validation writes carries it."""
    import numpy as np

    from vt.shared.video_io import read_sound, write_video

    version, folder = av_folder
    spec = av_spec(folder)
    pipeline = spec.build_pipeline(spec.load_transformer())
    vocoded = []
    pipeline.vocoder.register_forward_hook(lambda module, args, out: vocoded.append(out))
    frames, sound = spec.generate_clip(pipeline, PROMPT, BUCKET, steps=2, seed=0, **NO_GUIDANCE)
    rate = 32000 if version == "2.3" else 16000
    assert frames.shape == (9, 64, 96, 3) and sound.sample_rate == rate and sound.waveform.shape[0] == 2
    np.testing.assert_array_equal(sound.waveform, vocoded[0][0].float().numpy())
    assert np.abs(sound.waveform).max() > 1e-3
    heard = read_sound(write_video(frames, tmp_path / "00.mp4", fps=12.0, sound=sound))
    assert heard is not None and heard.sample_rate == rate and heard.waveform.shape[0] == 2
    assert abs(heard.waveform.shape[1] - sound.waveform.shape[1]) <= 2048  # AAC frames of 1024 samples


def test_i2v_audio_forward_feeds_what_the_pipeline_feeds(tiny_model_factory):
    """i2v with model.audio at LTX2ImageToVideoPipeline's first step: the clean image latent, per-token video
    timesteps, the audio noised whole at the sample's timestep, and both streams' text, as the pipeline feeds."""
    from diffusers import LTX2ImageToVideoPipeline

    spec = make_spec(tiny_model_factory("ltx-2", task="i2v"), task="i2v", audio=True)
    encoders = spec.load_stage1()
    clip, pixels = uint8_clip()
    transformer = spec.load_transformer()
    seen = capture(transformer)
    pipeline = spec.build_pipeline(transformer, **encoders)
    pipeline(
        **spec.pipeline_inputs(PROMPT, BUCKET, steps=2, seed=0, image=pixels[0].numpy()),
        **NO_GUIDANCE,
        image_crf=0,
        output_type="latent",
    )
    inference = seen[0]
    frames = inference["audio_num_frames"]
    audio_noise = LTX2ImageToVideoPipeline._unpack_audio_latents(inference["audio_hidden_states"], frames, 2)
    batch = {
        **spec.encode_text(encoders, [PROMPT]),
        **spec.encode_video(encoders, clip),
        "audio_latents": torch.randn(audio_noise.shape),
        "audio_noise": audio_noise,
    }
    noise = LTX2ImageToVideoPipeline._unpack_latents(inference["hidden_states"], 2, 2, 3, 1, 1)
    out = spec.forward(transformer, batch, torch.tensor([1.0]), noise)
    training = seen[-1]
    for name in (
        "hidden_states",
        "audio_hidden_states",
        "timestep",
        "audio_timestep",
        "sigma",
        "encoder_hidden_states",
        "audio_encoder_hidden_states",
    ):
        torch.testing.assert_close(training[name], inference[name], atol=1e-5, rtol=1e-5, msg=name)
    assert training["isolate_modalities"] is inference["isolate_modalities"] is False
    assert out.weight.flatten().tolist() == [0.0, 1.0] and out.audio.weight is None  # the sound is generated whole


def test_context_parallel_plans_name_ltx2_modules(av_folder):
    """The CP plan (tests/parallel runs it, with and without audio) names attentions every block has, and cuts the
    tiny preset's "split" rotary tables (B, heads, tokens, D / 2) by heads."""
    _, folder = av_folder
    spec = av_spec(folder)
    plan = spec.cp_plan()
    assert plan.rope_heads == {"rope": -3} and plan.cross_stream.rope_dims == (-2, -3)
    block = spec.blocks(spec.load_transformer())[0]
    for name in (*plan.self_attention, *plan.cross_stream.queries_whole, *plan.cross_stream.queries_split):
        assert block.get_submodule(name).heads == 2


def test_audio_loss_falls_on_a_clip_trained_repeatedly(tiny_model_factory):
    """A full fine-tune on one clip (fresh sigmas and noise each step) lowers that clip's audio loss at a held-out
    sigma and noise: the audio stream learns from the joint loss."""
    from vt.train.objectives import joint_loss

    spec = av_spec(tiny_model_factory("ltx-2"))
    batch = audio_batch(spec, spec.load_stage1(), size=1)
    transformer = spec.load_transformer()
    spec.full_trainable(transformer)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(7)

    def audio_loss(sigma: float, seed: int) -> float:
        draw = torch.Generator().manual_seed(seed)
        held = {**batch, "audio_noise": torch.randn(batch["audio_latents"].shape, generator=draw)}
        with torch.no_grad():
            out = spec.forward(
                transformer, held, torch.tensor([sigma]), torch.randn(batch["latents"].shape, generator=draw)
            )
        return float(joint_loss(out, 1.0)[1])

    before = audio_loss(0.5, 99)
    for _ in range(12):
        step = {**batch, "audio_noise": torch.randn(batch["audio_latents"].shape, generator=generator)}
        out = spec.forward(
            transformer,
            step,
            torch.rand(1, generator=generator),
            torch.randn(batch["latents"].shape, generator=generator),
        )
        joint_loss(out, 1.0)[0].backward()
        optimizer.step()
        optimizer.zero_grad()
    after = audio_loss(0.5, 99)
    assert after < 0.9 * before, (before, after)  # 2.80 -> 2.37 (the noise in the target stays unpredictable)
