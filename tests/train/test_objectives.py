import torch

from vt.shared.models.flow import Prediction
from vt.train.objectives import flow_matching_loss, sample_sigmas, shift_sigmas, step_generator


def test_generator_is_reproducible_and_differs_per_step_and_rank():
    draw = lambda *key: torch.randn(4, generator=step_generator(*key))
    assert torch.equal(draw(0, 5, 0, 0), draw(0, 5, 0, 0))
    assert not torch.equal(draw(0, 5, 0, 0), draw(0, 6, 0, 0))
    assert not torch.equal(draw(0, 5, 0, 0), draw(0, 5, 0, 1))
    assert not torch.equal(draw(0, 5, 0, 0), draw(1, 5, 0, 0))


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
