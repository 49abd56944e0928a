"""Gradient bookkeeping that must be global: sync only on the last micro-step, one norm over all shards.

Gradient accumulation: on inner micro-steps DDP skips its all-reduce and FSDP2 its reduce-scatter
(gradients accumulate locally, unsharded); the last micro-step syncs the sum once. Clipping happens
once per optimizer step on the synced gradients. Under FSDP2 a gradient is a DTensor shard; the
norm of DTensors is a partial result that `full_tensor()` completes, so every rank gets the norm of
the whole model and scales its shard by the same factor.
The norm is computed, combined and applied on the device and returned as a tensor: nothing here reads
a value to the host, so a step does not wait for the GPU (the trainer reads the norm when it logs).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
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


def _by_layout(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """Parameters grouped by their gradients' layout (plain; DTensors per mesh and placements), in order."""
    groups: dict[object, list[nn.Parameter]] = {}
    for p in params:
        layout = (p.grad.device_mesh, tuple(p.grad.placements)) if isinstance(p.grad, DTensor) else None
        groups.setdefault(layout, []).append(p)
    return list(groups.values())


def _total_norm(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The 2-norm of the gradients of `params` over all their shards, a float32 scalar on `device`.

    The groups' norms meet on one device (not the host: a `.cpu()` here would wait for the backward)."""
    norms = [torch.zeros((), device=device)]
    for group in _by_layout(params):
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        if isinstance(norm, DTensor):  # a partial norm: complete it across the shards
            norm = norm.full_tensor()
        norms.append(norm.float().to(device))
    return torch.linalg.vector_norm(torch.stack(norms))


def clip_grad_norm(params: Iterable[nn.Parameter], max_norm: float, pipeline=None) -> torch.Tensor:
    """Clip to `max_norm` (0: no clipping) by the global 2-norm; returns that norm (before clipping) as a
    0-d float32 tensor on the device, without reading it to the host.

    Gradients are grouped by layout (plain tensors; DTensors per mesh and placements, e.g. FSDP
    shards vs tensor-parallel splits), each group's norm is completed across its ranks, and the
    groups combine as a root of summed squares. Groups come in parameter order, the same on every
    rank, so the collectives line up. A non-finite norm clips nothing (the factor becomes 1 on the
    device, as the host-side check did before); the trainer stops at its next loss check.
    """
    with_grads = [p for p in params if p.grad is not None]
    if pipeline is None:
        if not with_grads:
            return torch.zeros(())
        total = _total_norm(with_grads, with_grads[0].grad.device)
    else:  # each block's parameters live on one stage, the rest (their gradients summed) on all of them
        device = pipeline.world.comm_device
        names = {id(p): name for name, p in pipeline.params}
        staged = [p for p in with_grads if pipeline.staged(names[id(p)])]
        replicated = [p for p in with_grads if not pipeline.staged(names[id(p)])]
        squares = _total_norm(staged, device) ** 2
        dist.all_reduce(squares, group=pipeline.group)
        total = (squares + _total_norm(replicated, device) ** 2).sqrt()
    if max_norm and max_norm > 0:
        clipping = torch.where(torch.isfinite(total), total, torch.zeros_like(total))  # 0: a factor of 1
        for group in _by_layout(with_grads):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, clipping.to(group[0].grad.device))
    return total
