"""Stage 1's encoders at real size: offloaded text encoders encode exactly what resident ones do, tiling is
part of the provenance, and a clip the VAE cannot hold stops the run naming what to change."""

from __future__ import annotations

import pytest
import torch

from vt.precompute.encoders import VaeOutOfMemory, encode_videos, layer_paths, load_encoders, text_phase
from vt.shared.config import Config, ModelConfig, PrecomputeConfig
from vt.shared.models import build_spec
from vt.shared.provenance import fingerprint, provenance

CAPTIONS = ["a big rabbit walks in the meadow", "people riding bikes on a sunny street"]


# The child names group offloading descends through to each family's text encoder layers.
LAYER_PATHS = {"wan": ["encoder"], "ltx-2": ["language_model", "model"]}  # UMT5 encoder.block, Gemma 3's layers


@pytest.mark.parametrize("family", list(LAYER_PATHS))
def test_offloaded_text_encoders_encode_what_resident_ones_do(tiny_model_factory, family):
    spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family)), max_text_tokens=16), 8.0)
    cpu = torch.device("cpu")
    expected = spec.encode_text(load_encoders(spec, cpu, "none", vae_tiling=False), CAPTIONS)
    for offload in ("model", "blocks"):
        encoders = load_encoders(spec, cpu, offload, vae_tiling=False)
        with text_phase(encoders, spec, cpu, offload):
            got = spec.encode_text(encoders, CAPTIONS)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), offload
    streamed = encoders["text_encoder"]
    assert layer_paths(streamed) == LAYER_PATHS[family]
    hooked = [name for name, module in streamed.named_modules() if hasattr(module, "_diffusers_hook")]
    assert len(hooked) > 2, "group offloading did not reach the encoder's layers"


def test_vae_tiling_is_applied_and_changes_the_fingerprint(tiny_model_factory):
    config = Config(model=ModelConfig(family="wan", path=str(tiny_model_factory("wan"))))
    spec = build_spec(config.model, 8.0)
    encoders = load_encoders(spec, torch.device("cpu"), "none", vae_tiling=True)
    assert encoders["vae"].use_tiling
    tiled = config.model_copy(update={"precompute": PrecomputeConfig(vae_tiling=True)})
    assert fingerprint(provenance(config, spec=spec)) != fingerprint(provenance(tiled, spec=spec))
    auto = config.model_copy(update={"precompute": PrecomputeConfig(vae_tiling="auto")})  # the default
    assert fingerprint(provenance(config, spec=spec)) == fingerprint(provenance(auto, spec=spec))


def test_auto_tiles_the_buckets_whose_untiled_encode_would_not_fit(tiny_model_factory, monkeypatch):
    """precompute.vae_tiling = "auto" on a GPU with the memory free after loading: the untiled encode of each
    bucket, traced on fake tensors, against it; the tiled bucket's clips encode through diffusers' tiling."""
    from vt.precompute import encoders as module
    from vt.precompute.encoders import encode_videos, tiled_buckets
    from vt.shared.buckets import parse_buckets

    config = Config(model=ModelConfig(family="wan", path=str(tiny_model_factory("wan"))))
    spec = build_spec(config.model, 8.0)
    cpu = torch.device("cpu")
    encoders = load_encoders(spec, cpu, "none", vae_tiling="auto")
    small, large = parse_buckets(["5x64x64", "1x320x320"])  # one frame: the tiles are spatial
    assert tiled_buckets(spec, encoders, [small, large], cpu, "auto") == set()  # a CPU: host memory, untiled
    assert tiled_buckets(spec, encoders, [small, large], cpu, True) == {"5x64x64", "1x320x320"}
    from vt.shared.vae_tiling import pass_peak

    needs = pass_peak(spec.empty_component("vae", torch.float32), "encode", (1, 3, 1, 320, 320), run=spec.vae_mode)
    monkeypatch.setattr(module, "free_device_memory", lambda device: needs - 1)  # a GPU just too small for it
    assert tiled_buckets(spec, encoders, [small, large], cpu, "auto") == {"1x320x320"}
    video = torch.rand(3, 1, 320, 320, generator=torch.Generator().manual_seed(0)) * 2 - 1
    plain = encode_videos(spec, encoders, [video], 1, cpu, "1x320x320", False)["latents"][0]
    tiled = encode_videos(spec, encoders, [video], 1, cpu, "1x320x320", True)["latents"][0]
    assert not encoders["vae"].use_tiling  # only inside the tiled bucket's encode
    assert tiled.shape == plain.shape and not torch.equal(tiled, plain)
    assert (tiled - plain).abs().mean() < 0.2 * plain.abs().mean()


class SmallDeviceVae(torch.nn.Module):
    """The real VAE on a device that holds `capacity` pixels per encode: beyond that it raises torch's
    out-of-memory error, as a GPU does."""

    def __init__(self, vae, capacity: int):
        super().__init__()
        self.vae, self.capacity, self.calls = vae, capacity, []

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.vae, name)

    def encode(self, video):
        self.calls.append(video.shape[0])
        if video.numel() > self.capacity:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.vae.encode(video)


def test_a_batch_out_of_memory_retries_clip_by_clip_and_a_clip_that_cannot_fit_names_the_key(tiny_model_factory):
    spec = build_spec(ModelConfig(family="wan", path=str(tiny_model_factory("wan"))), 8.0)
    encoders = spec.load_stage1()
    videos = [torch.rand(3, 9, 64, 96) * 2 - 1 for _ in range(3)]
    expected = torch.cat([spec.encode_video(encoders, v[None])["latents"] for v in videos])
    small = SmallDeviceVae(encoders["vae"], capacity=videos[0].numel())
    out = encode_videos(spec, {**encoders, "vae": small}, videos, 3, torch.device("cpu"), "9x64x96", tiled=False)
    assert small.calls == [3, 1, 1, 1]  # the batch, then each clip alone
    torch.testing.assert_close(torch.cat(out["latents"]), expected)
    tiny = SmallDeviceVae(encoders["vae"], capacity=10)
    with pytest.raises(VaeOutOfMemory, match=r"bucket 9x64x96.*set precompute.vae_tiling = true"):
        encode_videos(spec, {**encoders, "vae": tiny}, videos, 2, torch.device("cpu"), "9x64x96", tiled=False)
    with pytest.raises(VaeOutOfMemory, match=r"use smaller buckets.sizes"):
        encode_videos(spec, {**encoders, "vae": tiny}, videos, 2, torch.device("cpu"), "9x64x96", tiled=True)
