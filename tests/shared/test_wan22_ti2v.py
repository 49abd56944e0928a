"""Wan 2.2 TI2V-5B (family wan2.2-ti2v): per-token timesteps, the 48-channel VAE, i2v on a clean first frame."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.family_cases import BUCKET
from helpers.spec_inputs import capture_transformer_inputs, encode_clip, make_spec, uint8_video

IMAGE = np.random.default_rng(1).integers(0, 256, (BUCKET.height, BUCKET.width, 3), dtype=np.uint8)


def test_ti2v_trains_as_the_expand_timesteps_pipelines_sample(tiny_model_factory):
    """TI2V-5B: per-token timesteps (B, tokens), frame-major; for i2v the first latent frame is the
    clean encoded image (what the pipeline's prepare_latents encodes from it) at timestep 0 with no
    loss, and validation samples with WanImageToVideoPipeline(expand_timesteps=True)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline
    from PIL import Image

    folder = tiny_model_factory("wan2.2-ti2v")
    t2v, i2v = make_spec(folder, "wan2.2-ti2v"), make_spec(folder, "wan2.2-ti2v", task="i2v")
    clip, pixels = uint8_video(2)
    batch = encode_clip(i2v, clip)
    assert set(batch) == {"prompt_embeds", "latents"} and batch["latents"].shape == (2, 48, 3, 4, 6)
    reference = WanImageToVideoPipeline.from_pretrained(folder)
    assert reference.config.expand_timesteps
    frame = reference.video_processor.preprocess(
        Image.fromarray(pixels[1, 0].numpy()), height=BUCKET.height, width=BUCKET.width
    )
    _, condition, mask = reference.prepare_latents(
        frame, 1, 48, BUCKET.height, BUCKET.width, BUCKET.frames, torch.float32, "cpu", torch.Generator().manual_seed(0)
    )
    assert condition.shape == (1, 48, 1, 4, 6) and (mask[:, :, 0] == 0).all() and (mask[:, :, 1:] == 1).all()
    torch.testing.assert_close(condition, batch["latents"][1:, :, :1], atol=1e-4, rtol=1e-4)

    transformer = i2v.load_transformer()
    seen = capture_transformer_inputs(transformer)
    sigmas = torch.tensor([0.3, 0.8])
    noise = torch.randn(batch["latents"].shape, generator=torch.Generator().manual_seed(1))
    x0 = batch["latents"]
    out = i2v.forward(transformer, batch, sigmas, noise)
    timestep = seen["timestep"].view(2, 3, 6)  # (batch, latent frame, tokens of a frame)
    assert (timestep[:, 0] == 0).all()
    torch.testing.assert_close(timestep[:, 1:], (sigmas * 1000).view(2, 1, 1).expand(2, 2, 6))
    assert torch.equal(seen["hidden_states"][:, :, 0], x0[:, :, 0])
    torch.testing.assert_close(
        seen["hidden_states"][:, :, 1:],
        (1 - sigmas.view(2, 1, 1, 1, 1)) * x0[:, :, 1:] + sigmas.view(2, 1, 1, 1, 1) * noise[:, :, 1:],
    )
    assert out.weight.flatten().tolist() == [0.0, 1.0, 1.0] and torch.equal(out.target, noise - x0)

    out = t2v.forward(transformer, batch, sigmas, noise)
    torch.testing.assert_close(seen["timestep"], (sigmas * 1000).view(2, 1).expand(2, 18))
    assert out.weight is None and torch.isfinite(out.prediction).all()

    assert t2v.pipeline_class() is WanPipeline and i2v.pipeline_class() is WanImageToVideoPipeline
    pipeline = i2v.build_pipeline(transformer)
    assert pipeline.config.expand_timesteps and pipeline.config.boundary_ratio is None
    frames = i2v.generate(pipeline, "a rabbit", BUCKET, steps=2, seed=0, image=IMAGE)
    assert frames.shape == (9, 64, 96, 3) and frames.dtype == np.uint8 and frames.std() > 0
    with pytest.raises(ValueError, match='use family "wan2.2-ti2v"'):
        _ = make_spec(folder, "wan2.2").boundary
