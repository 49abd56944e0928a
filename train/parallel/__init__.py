"""Parallel training: one small function per strategy, composed in one fixed order.

    parallelize(model, spec, world, ...):
        pipeline stages (pp.py: the blocks other stages own become relays) -> TP (tp.py) -> CP (cp.py) -> activation checkpointing per block (ac.py)
        -> torch.compile per block (compile.py) -> FSDP2/HSDP per block then root (fsdp.py)
        -> materialize (the caller's: storage + weights for the shards that now exist) -> DDP (ddp.py)

The order matters: TP and CP rewrite the blocks' layers and attention, checkpointing wraps the
rewritten blocks, compile sees the wrapped blocks, and FSDP shards whatever parameters result. A
model built on the meta device is laid out first and filled after, so each rank only ever holds its
shards (train/model_build.py); DDP comes last because it broadcasts real weights from rank 0.
`ParallelDims` (dims.py) decides which strategies are on; `World` (world.py) holds the mesh.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vt.shared.log import get_logger
from vt.train.parallel.ac import apply_ac
from vt.train.parallel.compile import apply_compile
from vt.train.parallel.cp import apply_cp
from vt.train.parallel.ddp import apply_ddp
from vt.train.parallel.dims import ParallelConfigError, ParallelDims
from vt.train.parallel.fsdp import apply_fsdp
from vt.train.parallel.pp import keep_last_output, split_blocks
from vt.train.parallel.tp import apply_tp

__all__ = [
    "ParallelDims",
    "ParallelConfigError",
    "parallelize",
    "apply_ac",
    "apply_compile",
    "apply_cp",
    "apply_ddp",
    "apply_fsdp",
    "apply_tp",
]

log = get_logger("vt.train.parallel")


def parallelize(
    model: nn.Module,
    spec,
    world,
    *,
    activation_checkpointing: bool = False,
    compile: bool = False,
    param_dtype: torch.dtype | None = None,
    cpu_offload: bool = False,
    materialize: Callable[[nn.Module], None] | None = None,
) -> nn.Module:
    """Apply every enabled strategy to `model` in place, in the fixed order; returns `model`.
    `materialize(model)`, if given, runs once the shards exist and before DDP replicates the weights."""
    dims: ParallelDims = world.dims
    mesh = world.mesh
    split = None
    if dims.pp > 1:
        if dims.cp > 1:
            raise ParallelConfigError(
                "parallel.pp > 1 with parallel.cp > 1 is not supported: context parallel splits "
                "the sequence at the first block and gathers it after the last, which pipeline "
                "stages own separately; set parallel.cp = 1 or parallel.pp = 1"
            )
        split = split_blocks(model, spec, dims.coordinate(world.rank)["pp"], dims.pp, world.group("pp"))
    if dims.tp > 1:
        apply_tp(model, spec, mesh["tp"])
    if dims.cp > 1:
        apply_cp(model, spec, mesh["cp"])
    if activation_checkpointing:
        apply_ac(model, spec)
    if compile:
        apply_compile(model, spec)
    if dims.fsdp_enabled:
        apply_fsdp(
            model,
            spec,
            mesh[dims.fsdp_mesh_dims()],
            param_dtype=param_dtype,
            cpu_offload=cpu_offload,
            split_blocks=not compile,
        )
    if materialize is not None:
        materialize(model)
    if dims.ddp_enabled:
        apply_ddp(model, mesh["dp_replicate"])
    if split is not None:
        keep_last_output(model, spec, split)
    log.info(
        "parallel layout: %s%s%s%s",
        dims.describe(),
        ", activation checkpointing" if activation_checkpointing else "",
        ", compiled blocks" if compile else "",
        ", CPU offload" if cpu_offload and dims.fsdp_enabled else "",
    )
    return model
