"""Pinned numbers per family: a seeded LoRA run's first losses and a slice of its first prediction.

Parity compares every layout with one process, so a change that moves all of them alike (a latent
normalisation, a timestep scale, a mask, the loss) passes it; these numbers do not move unless the
family's training does. Each case builds the family's tiny preset (seed 0) the way the trainer does
(`build_transformer`: LoRA on the default targets, adapters keyed by name), feeds a seeded batch in the
shapes stage 1 stores (`condition_shapes`: random conditions, all-ones masks), and takes three AdamW
steps with the trainer's own sigma, noise and loss functions, at the family's default [flow] settings (its reference
training recipe: `flow_settings`, ModelSpec.flow_recipe; docs/families.md).

After a deliberate change, rewrite them and review the diff: `pytest tests/shared/test_reference_numbers.py
--update-reference-numbers` (tests/assets/reference_numbers.json).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vt.shared.buckets import Bucket
from vt.shared.config import ModelConfig, ParallelConfig
from vt.shared.models import FAMILIES, build_spec, get_spec_class
from vt.shared.part_configs import FlowConfig
from vt.train.model_build import build_transformer
from vt.train.objectives import (
    flow_matching_loss,
    flow_settings,
    loss_weights,
    sample_noise,
    sample_sigmas,
    scheduler_shift,
)
from vt.train.parallel import parallelize
from vt.train.parallel.world import setup_world

ASSET = Path(__file__).resolve().parents[1] / "assets" / "reference_numbers.json"
CASES = [(family, task) for family in FAMILIES for task in get_spec_class(family).tasks]
STEPS, BATCH, SLICE = 3, 2, 8
RTOL, ATOL = 1e-3, 1e-5  # float32 on CPUs of another instruction set: sums in other orders, nothing more


def smallest_bucket(spec) -> Bucket:
    """Two latent frames of 2 x 2 tokens: the least the VAE and patch geometry allow."""
    g = spec.geometry
    side = g.spatial * g.patch * 2
    return Bucket(g.temporal + 1, side, side)


def seeded_batch(spec, bucket: Bucket, generator: torch.Generator) -> dict[str, torch.Tensor]:
    masks = set(spec.text_masks.values())
    batch = {}
    for name, shape in sorted(spec.condition_shapes(bucket).items()):
        if name in masks:
            batch[name] = torch.ones(BATCH, *shape, dtype=torch.long)
        else:
            batch[name] = torch.randn(BATCH, *shape, generator=generator)
    return batch


def run(spec, draw=None) -> dict[str, list[float]]:
    """The seeded LoRA run; `draw(step, batch) -> (sigmas, noise)` replaces its sigma and noise draws (which
    come from the batch's generator, after the batch)."""
    world = setup_world(ParallelConfig(), "cpu")
    transformer = build_transformer(
        spec,
        spec.trained_component,
        world,
        mode="lora",
        lora={"rank": 4, "alpha": 4.0, "targets": []},
        storage_dtype=None,
        compute_dtype=torch.float32,
        frozen_dtype=torch.float32,
        seed=0,
        parallelize=lambda model, fill: parallelize(model, spec, world, materialize=fill),
    )
    optimizer = torch.optim.AdamW([p for p in transformer.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    batch = seeded_batch(spec, smallest_bucket(spec), generator)
    low, high = spec.sigma_range()

    flow = flow_settings(FlowConfig(), spec)  # the family's defaults
    shift = flow.shift
    if shift == "auto":
        shift = scheduler_shift(dict(spec.load_config("scheduler")), spec.tokens_per_sample(batch["latents"].shape[1:]))

    def seeded_draw(step, batch):
        sigmas = low + (high - low) * sample_sigmas(BATCH, flow.sigma_sampling, shift, generator)
        return sigmas, sample_noise(batch["latents"], generator)

    losses, prediction = [], None
    for step in range(STEPS):
        sigmas, noise = (draw or seeded_draw)(step, batch)
        out = spec.forward(transformer, batch, sigmas, noise)
        loss = flow_matching_loss(out, loss_weights(sigmas, flow.loss_weighting))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        if prediction is None:
            prediction = out.prediction.detach().flatten()[:SLICE].tolist()
    return {"losses": losses, "prediction": prediction}


@pytest.fixture(scope="module")
def pinned(request):
    numbers = json.loads(ASSET.read_text()) if ASSET.is_file() else {}
    yield numbers
    if request.config.getoption("update_reference_numbers"):
        ASSET.parent.mkdir(parents=True, exist_ok=True)
        ASSET.write_text(json.dumps(dict(sorted(numbers.items())), indent=1) + "\n")


@pytest.mark.parametrize("family, task", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_seeded_lora_run_gives_the_pinned_numbers(tiny_model_factory, pinned, request, family, task):
    spec = build_spec(ModelConfig(family=family, path=str(tiny_model_factory(family, task=task)), task=task), 16.0)
    check_pinned(pinned, request, f"{family}-{task}", run(spec))


def check_pinned(pinned: dict, request, key: str, got: dict[str, list[float]]) -> None:
    """`got` equals the pinned numbers of `key`, or replaces them under --update-reference-numbers."""
    if request.config.getoption("update_reference_numbers"):
        pinned[key] = got
        return
    assert key in pinned, (
        f"no pinned numbers for {key}: run pytest {__file__} -k {key} --update-reference-numbers "
        "and commit its entry in tests/assets/reference_numbers.json"
    )
    for name in ("losses", "prediction"):
        torch.testing.assert_close(
            torch.tensor(got[name]),
            torch.tensor(pinned[key][name]),
            rtol=RTOL,
            atol=ATOL,
            msg=lambda m, name=name: (
                f"{key} {name} moved from the pinned numbers (tests/assets/reference_numbers.json): {m}"
            ),
        )
