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
