import math

import pytest
import torch

from vt.shared.models.flow import Prediction
from vt.shared.runtime import keyed_generator
from vt.train.objectives import flow_matching_loss, sample_sigmas, shift_sigmas


def test_generator_is_reproducible_and_differs_per_key():
    draw = lambda *key: torch.randn(4, generator=keyed_generator(*key))
    assert torch.equal(draw(0, 5, "spec", 0), draw(0, 5, "spec", 0))
    assert not torch.equal(draw(0, 5, "spec", 0), draw(0, 6, "spec", 0))
    assert not torch.equal(draw(0, 5, "spec", 0), draw(0, 5, "spec", 1))
    assert not torch.equal(draw(0, 5, "spec", 0), draw(0, 5, "sample", 0))
    assert not torch.equal(draw(0, 5, "spec", 0), draw(1, 5, "spec", 0))


def step_generator(seed: int, step: int) -> torch.Generator:
    return keyed_generator(seed, step, 0, 0)


def test_sigmas_in_range_and_shift_pushes_them_up():
    for scheme in ("logit_normal", "uniform"):
        sigmas = sample_sigmas(1000, scheme, 1.0, step_generator(0, 0))
        assert sigmas.min() >= 0 and sigmas.max() <= 1
    base = torch.linspace(0.05, 0.95, 10)
    shifted = shift_sigmas(base, 3.0)
    assert torch.all(shifted > base)
    assert torch.allclose(shift_sigmas(torch.tensor([0.0, 1.0]), 3.0), torch.tensor([0.0, 1.0]))


def test_weighted_loss_ignores_masked_elements():
    target = torch.zeros(2, 3, 4)
    prediction = torch.ones(2, 3, 4)
    prediction[:, 0] = 100.0  # left out by the weight
    weight = torch.ones(1, 3, 1)
    weight[:, 0] = 0
    assert flow_matching_loss(Prediction(prediction, target, weight)).item() == 1.0
    assert flow_matching_loss(Prediction(prediction, target, None)).item() > 1.0


def test_each_sampling_scheme_has_its_density():
    """SD3's densities (diffusers' compute_density_for_timestep_sampling and its cosmap): logit-normal centred at
    sigmoid(mean), "mode" heavier in the middle than uniform for mode_scale > 0, cosmap's sigma is 1 - 1/(tan + 1)."""
    import math

    n = 20000
    draws = {
        scheme: sample_sigmas(n, scheme, 1.0, step_generator(0, 0))
        for scheme in ("logit_normal", "uniform", "mode", "cosmap")
    }
    assert all(0 <= d.min() and d.max() <= 1 for d in draws.values())
    middle = {k: ((d > 0.3) & (d < 0.7)).float().mean().item() for k, d in draws.items()}
    assert middle["mode"] > middle["uniform"] + 0.05 and middle["logit_normal"] > middle["uniform"] + 0.05
    shifted = sample_sigmas(n, "logit_normal", 1.0, step_generator(0, 0), logit_mean=1.0)
    assert abs(shifted.median().item() - 1 / (1 + math.exp(-1.0))) < 0.01
    u = torch.rand(5, generator=step_generator(0, 0))
    assert torch.allclose(
        sample_sigmas(5, "cosmap", 1.0, step_generator(0, 0)), 1 - 1 / (torch.tan(math.pi * u / 2) + 1)
    )
    # mode_scale 0 is uniform sigma = 1 - u
    assert torch.allclose(sample_sigmas(5, "mode", 1.0, step_generator(0, 0), mode_scale=0.0), 1 - u)
    # the defaults draw what logit-normal drew before the parameters existed (pinned numbers unchanged)
    assert torch.equal(
        sample_sigmas(5, "logit_normal", 1.0, step_generator(0, 0)),
        torch.sigmoid(torch.randn(5, generator=step_generator(0, 0))),
    )


def test_loss_weighting_scales_each_samples_error_by_its_sigma():
    from vt.train.objectives import loss_weights

    sigmas = torch.tensor([0.25, 0.5])
    assert loss_weights(sigmas, "none") is None
    assert torch.allclose(loss_weights(sigmas, "sigma_sqrt"), torch.tensor([16.0, 4.0]))
    assert torch.allclose(loss_weights(sigmas, "cosmap"), 2 / (torch.pi * (1 - 2 * sigmas + 2 * sigmas**2)))
    prediction, target = torch.ones(2, 3), torch.zeros(2, 3)
    prediction[1] = 2.0  # errors 1 and 4
    weighted = flow_matching_loss(Prediction(prediction, target, None), torch.tensor([16.0, 4.0]))
    assert weighted.item() == (16 * 1 + 4 * 4) / 2


def test_auto_shift_is_the_family_schedulers_own_at_each_buckets_size(tiny_model_factory):
    """`flow.shift = "auto"`: LTX-Video's scheduler shifts by resolution (`use_dynamic_shifting`): the trainer's
    shift at a bucket's token count is the pipeline's `calculate_shift` through the scheduler's own `time_shift`;
    Wan's UniPC takes its fixed `flow_shift`; a config takes "auto" or a number, nothing else."""
    import math

    import pytest
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    from vt.shared.config import Config, build
    from vt.train.objectives import scheduler_shift

    config = dict(
        FlowMatchEulerDiscreteScheduler.load_config(str(tiny_model_factory("ltx-video")), subfolder="scheduler")
    )
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    sigmas = torch.linspace(0.05, 0.95, 7)
    shifts = []
    for tokens in (256, 1024, 2048, 4096):
        mu = calculate_shift(
            tokens, config["base_image_seq_len"], config["max_image_seq_len"], config["base_shift"], config["max_shift"]
        )
        shift = scheduler_shift(config, tokens)
        assert shift == pytest.approx(math.exp(mu))
        assert torch.allclose(shift_sigmas(sigmas, shift), scheduler.time_shift(mu, 1.0, sigmas).float(), atol=1e-6)
        shifts.append(shift)
    assert shifts == sorted(shifts) and shifts[0] < shifts[-1]  # larger clips: more noise
    unipc = dict(UniPCMultistepScheduler.load_config(str(tiny_model_factory("wan")), subfolder="scheduler"))
    assert scheduler_shift(unipc, 10**5) == scheduler_shift(unipc, 10) == unipc["flow_shift"] == 3.0  # Wan's, fixed
    assert build(Config, {"flow": {"shift": "auto"}}).flow.shift == "auto"
    with pytest.raises(ValueError, match="shift"):
        build(Config, {"flow": {"shift": "resolution"}})


def test_the_trainer_resolves_auto_shift_per_bucket(tiny_model_factory):
    """The step's sigma draws (train/step.py) take `flow.shift` as it is, or with "auto" the scheduler's at the
    batch's bucket: the LTX-Video tiny preset's larger bucket (more tokens) draws with the larger shift."""
    import torch

    from vt.shared.config import Config, build
    from vt.shared.models import spec_for
    from vt.train.objectives import scheduler_shift
    from vt.train.parts import Parts, RunContext
    from vt.train.step import LossPath

    model = tiny_model_factory("ltx-video")

    def path(shift) -> LossPath:
        config = build(Config, {"model": {"family": "ltx-video", "path": str(model)}, "flow": {"shift": shift}})
        spec = spec_for(config)
        return LossPath(config, spec, torch.device("cpu"), None, Parts(config), RunContext(spec, torch.device("cpu")))

    auto = path("auto")
    scheduler = dict(auto.spec.load_config("scheduler"))
    small, large = (2, 2, 2, 3), (2, 3, 4, 6)
    assert auto.shift(small) == scheduler_shift(scheduler, auto.spec.tokens_per_sample(small))
    assert auto.shift(large) > auto.shift(small)
    assert path(3.0).shift(large) == 3.0


def test_ltx_video_trainers_shifted_logit_normal_is_the_logit_normal_at_the_auto_shift(tiny_model_factory):
    """LTX-Video-Trainer's default density (docs/families.md): sigmoid(N(mu, 1)) with mu linear in the token count
    through (1024, 0.95) and (4096, 2.05). vt's family default draws logit-normal at the scheduler's `auto` shift:
    the same sigmas from the same normal draws, at every size."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from vt.shared.config import ModelConfig
    from vt.shared.models import build_spec
    from vt.shared.part_configs import FlowConfig
    from vt.train.objectives import flow_settings, scheduler_shift

    model = tiny_model_factory("ltx-video")
    flow = flow_settings(FlowConfig(), build_spec(ModelConfig(family="ltx-video", path=str(model)), 24.0))
    assert (flow.sigma_sampling, flow.shift, flow.loss_weighting) == ("logit_normal", "auto", "none")
    scheduler = dict(FlowMatchEulerDiscreteScheduler.load_config(str(model), subfolder="scheduler"))
    for tokens in (8, 1024, 3000, 4096, 9000):
        mu = 0.95 + (2.05 - 0.95) / (4096 - 1024) * (tokens - 1024)
        theirs = torch.sigmoid(torch.randn(64, generator=torch.Generator().manual_seed(tokens)) + mu)
        ours = sample_sigmas(
            64, "logit_normal", scheduler_shift(scheduler, tokens), torch.Generator().manual_seed(tokens)
        )
        assert scheduler_shift(scheduler, tokens) == pytest.approx(math.exp(mu))
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def test_the_stretched_logit_normal_is_ltx2s_density():
    """LTX-2's trainer: the shifted logit-normal sigmoid(x + log s) stretched between its values at the normal's 0.5%
    and 99.9% quantiles, reflected above 1e-3, clamped to [0, 1], and a tenth of the draws uniform over [1e-3, 1)."""
    shift = 2.5
    got = sample_sigmas(4000, "stretched_logit_normal", shift, torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(0)
    normal, fallback = torch.randn(4000, generator=generator), torch.rand(4000, generator=generator)
    pick = torch.rand(4000, generator=generator)
    mu = math.log(shift)
    low, high = torch.sigmoid(torch.tensor(-2.5758 + mu)), torch.sigmoid(torch.tensor(3.0902 + mu))
    raw = (torch.sigmoid(normal + mu) - low) / (high - low)
    raw = torch.where(raw >= 1e-3, raw, 2e-3 - raw).clamp(0, 1)
    want = torch.where(pick > 0.1, raw, 1e-3 + (1 - 1e-3) * fallback)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert 0 <= float(got.min()) and float(got.max()) <= 1 and 0.08 < float((pick <= 0.1).float().mean()) < 0.12


def test_unset_flow_keys_take_the_familys_reference_recipe_and_set_ones_win():
    """`flow_settings`: each family's declared recipe fills the keys a config leaves unset (and is a value [flow]
    accepts); a key the config sets is kept."""
    from vt.shared.models import FAMILIES, get_spec_class
    from vt.shared.part_configs import FlowConfig
    from vt.train.objectives import flow_settings

    recipes = {}
    for family in FAMILIES:
        spec = get_spec_class(family)
        resolved = flow_settings(FlowConfig(), spec)
        FlowConfig(**resolved.model_dump())  # valid [flow] values
        recipes[family] = (resolved.sigma_sampling, resolved.shift, resolved.loss_weighting)
        kept = flow_settings(FlowConfig(sigma_sampling="cosmap", shift=2.0, loss_weighting="sigma_sqrt"), spec)
        assert (kept.sigma_sampling, kept.shift, kept.loss_weighting) == ("cosmap", 2.0, "sigma_sqrt")
    assert recipes["mochi"] == recipes["cogvideox"] == ("uniform", 1.0, "none")
    assert recipes["hunyuan-video"] == ("logit_normal", 7.0, "none")
    assert recipes["hunyuan-video-1.5"] == ("logit_normal", 3.0, "none")
    assert recipes["ltx-2"] == ("stretched_logit_normal", "auto", "none")
    assert recipes["wan"] == recipes["minimax-h3"] == ("logit_normal", 1.0, "none")  # no reference recipe
