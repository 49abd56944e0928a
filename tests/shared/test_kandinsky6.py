"""Kandinsky 6 specifics the family-wide tests in test_models.py do not reach: the tiny tokenizer's 129-token
template crop, stored text against the pipeline's own encoding, the transformer's inputs against the pipeline's
(t2v with sound, i2v's appended image frame), the audio latents' length and encoding, the sound in a generated
clip, and LoRA kept off the sound stream of a video-only run."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers.spec_inputs import first_call, uint8_video

FAMILY = "kandinsky6"
BUCKET = Bucket(9, 64, 96)
CAPTIONS = ["a big rabbit walks in the meadow", "a cat"]


def make_spec(folder, task="t2v", **model):
    model = {"max_text_tokens": 32, **model}
    return build_spec(ModelConfig(family=FAMILY, path=str(folder), task=task, **model), 8.0)


def stage1(spec, encoders, clip=None):
    clip = uint8_video(seed=3)[0] if clip is None else clip
    batch = {**spec.encode_text(encoders, CAPTIONS), **spec.encode_video(encoders, clip)}
    if spec.config.audio:
        seconds = torch.linspace(0, BUCKET.frames / 8.0, spec.sound.samples(BUCKET))
        tone = 0.5 * torch.sin(2 * torch.pi * 440 * seconds)
        batch.update(spec.sound.encode(encoders, torch.stack([tone, -tone])[:, None]))
    return batch


def test_text_is_stored_as_the_pipeline_encodes_it(tiny_model_factory):
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_ti2va import _PROMPT_TEMPLATE, _QWEN_CROP_START

    spec = make_spec(tiny_model_factory(FAMILY))
    encoders = spec.load_stage1()
    # The pipeline crops its first 129 template tokens: the local tokenizer puts the caption right there.
    ids = encoders["tokenizer"](_PROMPT_TEMPLATE.format(CAPTIONS[0]))["input_ids"]
    tokens = encoders["tokenizer"].convert_ids_to_tokens(ids[_QWEN_CROP_START:])
    assert tokens[:3] == ["a", "\u0120big", "\u0120rabbit"] and tokens[-1] == "<|im_end|>"

    batch = spec.encode_text(encoders, CAPTIONS)
    pipeline = spec.build_pipeline(spec.load_transformer(), **encoders)
    embeds, pooled, mask, *_ = pipeline.encode_prompt(
        CAPTIONS, do_classifier_free_guidance=False, max_sequence_length=32, device="cpu"
    )
    assert batch["prompt_embeds"].shape == (2, 32, 16) and batch["pooled_prompt_embeds"].shape == (2, 8)
    torch.testing.assert_close(batch["prompt_attention_mask"], mask.float())
    torch.testing.assert_close(batch["prompt_embeds"], embeds * mask[..., None])  # padding rows stored as zeros
    torch.testing.assert_close(batch["pooled_prompt_embeds"], pooled)
    assert mask.sum(1).tolist() == [8, 3]  # the caption's tokens and the template's closing one


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_forward_feeds_the_transformer_what_the_pipeline_feeds_it(tiny_model_factory, task):
    """The pipeline's first denoising call at sigma 1 (pure noise) against training's at sigma 1 with the same noise:
    the same hidden states (with i2v's clean image as a masked tail frame, token type 1 at RoPE time 0), timestep,
    text rows and mask, pooled text and audio latents, so the same predictions."""
    audio = task == "t2v"
    spec = make_spec(tiny_model_factory(FAMILY, task=task), task=task, audio=audio)
    encoders = spec.load_stage1()
    clip, pixels = uint8_video(batch=1, seed=5)
    batch = stage1(spec, encoders, clip)
    transformer = spec.load_transformer()
    seen = first_call(transformer)
    pipeline = spec.build_pipeline(transformer, **encoders)
    shape = spec.latent_shape(BUCKET)
    noise = torch.randn(1, *shape, generator=torch.Generator().manual_seed(7))
    audio_noise = torch.randn(1, *spec.sound.latent_shape(BUCKET), generator=torch.Generator().manual_seed(8))
    kwargs = spec.pipeline_inputs(CAPTIONS[0], BUCKET, steps=1, seed=0, image=pixels[0, 0] if task == "i2v" else None)
    pipeline(
        **kwargs,
        latents=noise,
        **({"audio_latents": audio_noise} if audio else {}),
        sigmas=[1.0],
        guidance_scale=1.0,
        output_type="latent",
    )
    one = {name: value[:1] for name, value in batch.items()}
    if audio:
        one["audio_noise"] = audio_noise
    trained = first_call(transformer)
    with torch.no_grad():
        spec.forward(transformer, one, torch.tensor([1.0]), noise)
    assert torch.equal(trained["timestep"], seen["timestep"].float()) and float(seen["timestep"][0]) == 1000.0
    torch.testing.assert_close(trained["pooled_projections"], seen["pooled_projections"])
    # every frame but i2v's appended image, whose latents the pipeline samples from the posterior (stage 1: its mode)
    real = slice(None, shape[1])
    torch.testing.assert_close(trained["hidden_states"][:, real], seen["hidden_states"][:, real])
    torch.testing.assert_close(trained["hidden_states"][..., 4:], seen["hidden_states"][..., 4:])  # condition, mask
    # the pipeline pads the prompt to max_sequence_length under its mask; training feeds the rows the mask keeps
    rows = int(one["prompt_attention_mask"].sum())
    assert seen["encoder_attention_mask"][0, :rows].all() and not seen["encoder_attention_mask"][0, rows:].any()
    torch.testing.assert_close(trained["encoder_hidden_states"], seen["encoder_hidden_states"][:, :rows])
    assert trained["encoder_hidden_states"].shape[1] == rows and trained["encoder_attention_mask"].all()
    if audio:
        torch.testing.assert_close(trained["audio_hidden_states"], seen["audio_hidden_states"])
        assert trained["audio_hidden_states"].shape == (1, spec.sound.latent_shape(BUCKET)[1], 4)
    else:
        assert trained.get("audio_hidden_states") is None and seen.get("audio_hidden_states") is None
    if task == "i2v":
        assert trained["hidden_states"].shape[1] == shape[1] + 1  # the image as a tail frame
        assert (trained["hidden_states"][:, -1, ..., -1] == 1).all() and (
            trained["hidden_states"][:, :-1, ..., -1] == 0
        ).all()
        assert torch.equal(trained["visual_token_type_ids"], seen["visual_token_type_ids"])
        for mine, theirs in zip(trained["visual_rope_pos"], seen["visual_rope_pos"]):
            assert torch.equal(mine, theirs)
        assert torch.equal(trained["hidden_states"][:, -1, ..., :4], one["image_latents"][:, :, 0].permute(0, 2, 3, 1))


def test_audio_latents_have_the_pipelines_length_and_encoding(tiny_model_factory):
    spec = make_spec(tiny_model_factory(FAMILY), audio=True)
    encoders = spec.load_stage1()
    assert "audio_vae" in encoders and spec.sound.format().channels == 1
    pipeline = spec.build_pipeline(spec.load_transformer(), **encoders)
    # the pipeline's audio length for 9 frames at 8 fps: ceil(9 / 8 x 8000 / 128) = 71 latents
    assert spec.sound.latent_shape(BUCKET) == (4, 71)
    assert pipeline.audio_latent_hop_length == spec.sound.hop() == 128
    batch = stage1(spec, encoders)
    assert batch["audio_latents"].shape == (2, 4, 71)
    tone = torch.sin(torch.linspace(0, 500, spec.sound.samples(BUCKET)))
    padded = torch.nn.functional.pad(tone, (0, 71 * 128 - tone.numel()))
    mode = encoders["audio_vae"].encode(padded[None]).latent_dist.mode() * encoders["audio_vae"].config.scaling_factor
    torch.testing.assert_close(spec.sound.encode(encoders, tone[None, None])["audio_latents"], mode)


def test_a_generated_clip_carries_its_sound(tiny_model_factory):
    spec = make_spec(tiny_model_factory(FAMILY), audio=True)
    encoders = spec.load_stage1()
    pipeline = spec.build_pipeline(spec.load_transformer(), text_encoders=False)
    negative = spec.encode_validation_text(encoders, spec.negative_prompt)
    conditions = {
        **spec.encode_validation_text(encoders, CAPTIONS[1]),
        **{f"negative_{name}": value for name, value in negative.items()},
    }
    assert conditions["prompt_embeds"].shape == (1, 3, 16)  # the prompt's own rows
    frames, sound = spec.generate_clip(pipeline, None, BUCKET, 2, 0, conditions=conditions)
    assert frames.shape == (9, 64, 96, 3) and sound.sample_rate == 8000 and sound.waveform.shape[0] == 1
    assert abs(sound.waveform.shape[1] / 8000 - 9 / 8) < 0.05
    silent = make_spec(tiny_model_factory(FAMILY))  # video only: no audio parts loaded, no sound sampled
    assert (
        "audio_vae" not in silent.pipeline_parts()
        and silent.pipeline_inputs("a", BUCKET, 1, 0)["sample_audio"] is False
    )


def test_a_video_only_lora_stays_off_the_sound_stream(tiny_model_factory):
    silent, heard = (make_spec(tiny_model_factory(FAMILY), audio=audio) for audio in (False, True))
    adapted = {}
    for name, spec in (("silent", silent), ("heard", heard)):
        transformer = spec.load_transformer()
        spec.add_lora(transformer, rank=2, alpha=2.0, targets=None)
        adapted[name] = {n.split(".lora_")[0] for n, _ in transformer.named_parameters() if "lora_" in n}
    sound = {name for name in adapted["heard"] if "audio_" in name or ".va_" in name or ".av_" in name}
    assert sound and not sound & adapted["silent"]
    assert adapted["heard"] - sound == adapted["silent"]
    assert "visual_transformer_blocks.0.video_dec_block.cross_attention.out_layer" in adapted["silent"]
    transformer = silent.load_transformer()
    with pytest.raises(ValueError, match="matched no layer of the kandinsky6 transformer outside the audio stream"):
        silent.add_lora(transformer, rank=2, alpha=2.0, targets=r".*audio_dec_block\.self_attention\.to_query")


def test_i2v_needs_an_image_conditioned_transformer(tiny_model_factory, monkeypatch):
    spec = make_spec(tiny_model_factory(FAMILY), task="i2v")
    config = spec.load_config("transformer")
    assert config["visual_token_type_num_embeddings"] == 2  # one preset for both tasks
    load = spec.load_config
    monkeypatch.setattr(
        spec,
        "load_config",
        lambda name: {**config, "visual_token_type_num_embeddings": 0} if name == "transformer" else load(name),
    )
    with pytest.raises(ValueError, match=r"i2v\" needs a Kandinsky 6 transformer with image conditioning"):
        _ = spec.geometry


@pytest.mark.parametrize("key, billions", [("kandinsky6-lite", 3.18), ("kandinsky6-pro", 30.14)])
def test_real_configs_build_at_the_published_sizes(key, billions):
    """scripts/real_models.json's Kandinsky 6 transformers (what `vt-train plan` and docs/memory.md read) have the
    released checkpoints' sizes on the meta device: Lite 3.18B in 2,399 tensors, Pro 30.1B in 4,471."""
    import json
    from pathlib import Path

    from accelerate import init_empty_weights
    from diffusers import Kandinsky6Transformer3DModel

    real = json.loads((Path(__file__).parents[2] / "scripts" / "real_models.json").read_text())[key]
    with init_empty_weights():
        transformer = Kandinsky6Transformer3DModel.from_config(real["components"]["transformer"]["config"])
    assert round(sum(p.numel() for p in transformer.parameters()) / 1e9, 2) == billions
    assert len(transformer.state_dict()) == {"kandinsky6-lite": 2399, "kandinsky6-pro": 4471}[key]
