"""LTX-Video: first-frame conditioning (i2v) and the frame rate it trains and samples at."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vt.shared.config import ModelConfig
from vt.shared.models import build_spec

from helpers.family_cases import BUCKET
from helpers.spec_inputs import capture_transformer_inputs, make_spec, stage1


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
    out = spec.forward(transformer, batch, sigmas, noise, generators=generators(2, 3))

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
        # Each sample's draw is its own generator's: the second sample alone (another data-parallel slicing)
        # gets the first-frame sigma it got beside the first.
        spec.forward(transformer, {k: v[1:] for k, v in batch.items()}, sigmas[1:], noise[1:], generators=generators(3))
        torch.testing.assert_close(seen["timestep"].view(1, 2, 6)[:, 0], timestep[1:, 0], rtol=0, atol=0)


def generators(*seeds: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed) for seed in seeds]


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


def test_ltx_trains_and_samples_at_the_bucket_frame_rate(tiny_model_factory):
    """RoPE's temporal scale is VAE time compression / frame rate, in training and in the pipeline."""
    spec = build_spec(
        ModelConfig(family="ltx-video", path=str(tiny_model_factory("ltx-video")), max_text_tokens=16), frame_rate=12.0
    )
    assert spec.pipeline_inputs("a cat", BUCKET, 2, 0)["frame_rate"] == 12.0
    assert any("frame_rate=12 but LTXPipeline uses 25" in line for line in spec.inference_mismatches())
    transformer = spec.load_transformer()
    seen = {}
    transformer.register_forward_pre_hook(lambda module, args, kwargs: seen.update(kwargs), with_kwargs=True)
    batch = stage1(spec, batch=1)
    spec.forward(transformer, batch, torch.tensor([0.5]), torch.randn_like(batch["latents"]))
    assert seen["rope_interpolation_scale"] == (
        spec.geometry.temporal / 12.0,
        spec.geometry.spatial,
        spec.geometry.spatial,
    )
