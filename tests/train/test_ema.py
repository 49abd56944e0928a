"""The average of the trained weights (train/parts/ema.py): its arithmetic, and that it is what the model computes with
inside `swapped_in` and nothing after. Layout parity and resume at another world size: the ltx-video rows of
tests/parallel (FAMILY_TRAIN sets ema.decay there; assert_same_training compares <run.dir>/ema/)."""

from __future__ import annotations

import torch

from vt.train.parts.ema import EMA


def test_the_average_follows_the_weights_at_its_decay_and_swaps_in_and_out():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].requires_grad_(False)  # frozen: not averaged
    ema = EMA(model, decay=0.75)
    assert set(ema.state_dict()) == {"0.weight", "0.bias"}
    start = model[0].weight.detach().clone()
    history = [start]
    for _ in range(3):
        with torch.no_grad():
            model[0].weight.add_(1.0)  # what an optimizer step does: in place
        ema.update()
        history.append(model[0].weight.detach().clone())
    expected = start
    for weights in history[1:]:
        expected = 0.75 * expected + 0.25 * weights
    torch.testing.assert_close(ema.state_dict()["0.weight"], expected)
    trained = model[0].weight.detach().clone()
    x = torch.randn(4, 3)
    with ema.swapped_in():
        torch.testing.assert_close(model[0].weight, expected)
        averaged = model(x)
    assert torch.equal(model[0].weight, trained)  # its own weights again
    assert not torch.allclose(averaged, model(x))
