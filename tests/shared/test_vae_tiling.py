"""VAE tiling (vt.shared.vae_tiling): diffusers' own tiled passes, switched on where the untiled pass would not
fit, and the plan counting whichever pass runs."""

from __future__ import annotations

import pytest
import torch

from vt.shared.buckets import parse_buckets
from vt.shared.config import Config, build
from vt.shared.models import spec_for
from vt.shared.vae_tiling import decide, pass_peak, tiling

BIG = "5x320x320"  # past diffusers' smallest tile (256 pixels): tiling splits it
FRAME = "1x320x320"  # as wide, one frame: the tiles are spatial, and the decodes a third of BIG's cost


def _config(model, family: str, bucket: str = BIG) -> Config:
    return build(
        Config,
        {
            "model": {"family": family, "path": str(model), "max_text_tokens": 16},
            "buckets": {"sizes": [bucket]},
            "validation": {"prompts": ["a fox"]},
        },
    )


def test_auto_tiles_only_what_would_not_fit():
    assert decide("auto", 10, None, True) == (False, "the untiled pass (0.0 GiB) fits")
    assert decide("auto", 10, 100, True)[0] is False
    tiled, why = decide("auto", 2 * 2**30, 2**30, True)
    assert tiled and why == "the untiled pass (2.0 GiB) does not fit in the 1.0 GiB free"
    assert decide(True, 0, None, True)[0] and not decide(False, 2**40, 1, True)[0]
    assert decide("auto", 2**40, 1, False) == (False, "the VAE cannot tile")


def test_tiling_switches_diffusers_spatial_and_temporal_tiling_and_restores_it(tiny_model_factory):
    ltx = spec_for(_config(tiny_model_factory("ltx-video"), "ltx-video", "9x64x96")).load_component("vae")
    with tiling(ltx, True):
        assert ltx.use_tiling and ltx.use_framewise_decoding and ltx.use_framewise_encoding
    assert not ltx.use_tiling and not ltx.use_framewise_decoding  # as it was
    mochi = spec_for(_config(tiny_model_factory("mochi"), "mochi", "7x64x96")).load_component("vae")
    with tiling(mochi, True):  # Mochi's framewise path changes its padding (a private switch): spatial only
        assert mochi.use_tiling and not mochi.use_framewise_decoding


def test_a_tiled_decode_matches_the_untiled_one_and_holds_less(tiny_model_factory):
    spec = spec_for(_config(tiny_model_factory("wan"), "wan", FRAME))
    vae = spec.load_component("vae", dtype=torch.float32)
    latents = torch.randn(1, *spec.latent_shape(parse_buckets([FRAME])[0]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        untiled = vae.decode(latents).sample
        with tiling(vae, True):
            tiled = vae.decode(latents).sample
    assert tiled.shape == untiled.shape and not torch.equal(tiled, untiled)  # tiles, blended at their seams
    assert (tiled - untiled).abs().mean() < 0.1 * untiled.abs().mean()
    shape = tuple(latents.shape)
    peaks = [pass_peak(spec.empty_component("vae", torch.float32), "decode", shape, tiled=on) for on in (False, True)]
    assert peaks[1] < 0.7 * peaks[0]


@pytest.mark.parametrize("family", ["wan", "hunyuan-video-1.5"])
def test_the_plan_decodes_tiled_when_the_untiled_decode_would_not_fit(tiny_model_factory, family):
    from vt.train.plan import make_plan

    config = _config(tiny_model_factory(family), family)
    roomy = make_plan(config, 1, "cpu", stage1=False)
    assert not roomy.vae_tiled and "decode_tiled" not in roomy.validation
    # Just too small for the untiled decode beside what stays resident: "auto" tiles, and the plan counts it.
    budget = roomy.rank.resident + roomy.validation["frozen"] + roomy.validation["decode"] - 1
    tight = make_plan(config, 1, "cpu", stage1=False, budget=budget)
    assert tight.vae_tiled and tight.validation["decode_tiled"] < roomy.validation["decode"]
    assert tight.rank.validation < roomy.rank.validation
    untiled = make_plan(
        config.model_copy(update={"validation": config.validation.model_copy(update={"vae_tiling": False})}),
        1,
        "cpu",
        stage1=False,
        budget=budget,
    )
    assert not untiled.vae_tiled and untiled.rank.validation == roomy.rank.validation
