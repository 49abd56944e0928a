"""Which transformer trains which rows of a slice: the only one, or, when a run trains all experts of a
family (`model.expert = "all"`), the expert whose noise range holds each sample's sigma.

Every expert runs at every micro-step on every rank: on its own rows, or on one stand-in row with
weight 0 when it has none here. So DDP's and FSDP2's collectives stay in step across ranks whatever
the sigmas drew, and every expert's gradient is a tensor (zero, not None) in every layout, so AdamW
treats it the same way in one process and in any parallel layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Route:
    expert: str | None  # None: the run's one transformer
    rows: torch.Tensor  # row indices into the slice's tensors (one stand-in row when `count` is 0)
    count: int  # real samples: the route's weight in the loss


def expert_modules(model: nn.Module) -> dict[str | None, nn.Module]:
    """Expert -> transformer of a run over all experts (an nn.ModuleDict), else {None: the model}."""
    return dict(model.items()) if isinstance(model, nn.ModuleDict) else {None: model}


def routes(spec, sigmas: torch.Tensor, count: int) -> list[Route]:
    """The routes of a slice with `count` real rows (its first ones) and their `sigmas`."""
    experts = spec.trained_experts
    if not experts:
        return [Route(None, torch.arange(len(sigmas)), count)]
    owners = [spec.expert_of(float(sigma)) for sigma in sigmas[:count]]
    out = []
    for name in experts:
        rows = [index for index, owner in enumerate(owners) if owner == name]
        out.append(Route(name, torch.tensor(rows or [0]), len(rows)))
    return out
