"""Gradient bookkeeping that must be global: sync only on the last micro-step, one norm over all shards.

Gradient accumulation: on inner micro-steps DDP skips its all-reduce and FSDP2 its reduce-scatter
(gradients accumulate locally, unsharded); the last micro-step syncs the sum once. Clipping happens
once per optimizer step on the synced gradients. Under FSDP2 a gradient is a DTensor shard; the
norm of DTensors is a partial result that `full_tensor()` completes, so every rank gets the norm of
the whole model and scales its shard by the same factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def set_gradient_sync(model: nn.Module, enabled: bool) -> None:
    """Turn gradient communication on (last micro-step) or off (inner micro-steps); no-op if local.

    A container of separately wrapped models (several experts) sets each of them."""
    setter = getattr(model, "set_requires_gradient_sync", None)  # FSDP2 and composable DDP both have it
    if setter is not None:
        setter(enabled)
    elif isinstance(model, nn.ModuleDict):
        for module in model.values():
            set_gradient_sync(module, enabled)


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float) -> float:
    """Clip to `max_norm` (0: no clipping) by the global 2-norm; returns that norm (before clipping).

    Gradients are grouped by layout (plain tensors; DTensors per mesh and placements, e.g. FSDP
    shards vs tensor-parallel splits), each group's norm is completed across its ranks, and the
    groups combine as a root of summed squares. Groups come in parameter order, the same on every
    rank, so the collectives line up.
    """
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            layout = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
            groups.setdefault(layout, []).append(p)
    if not groups:
        return 0.0
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        if isinstance(norm, DTensor):  # a partial norm: complete it across the shards
            norm = norm.full_tensor()
        norms.append(norm.float().cpu())
    total = torch.linalg.vector_norm(torch.stack(norms))
    if max_norm and max_norm > 0 and math.isfinite(float(total)):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return float(total)
