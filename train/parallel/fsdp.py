"""FSDP2 (and HSDP): parameters, gradients and optimizer state sharded over the data-parallel ranks.

`fully_shard` is applied per transformer block (the spec's block list), then to the root, so each
block's parameters are all-gathered just before it runs and freed after; the root group holds the
rest (embeddings, norms, projections). A block's large parts (attention, FFN: `units`) are sharded as
units of their own first, so a gather holds one part: gathering costs (3 + 1/N) times the unit at its
peak (the unsharded copy, the all-gather's output and this rank's shard, and the next unit fetched
ahead), and a part is at most ~60% of a block (a feed-forward of 4x width). The root's large parts (the text and time
embedders) are units too, gathered only while they run. Not with torch.compile, whose per-block graphs
would break at every inner unit's hooks. A 1-D mesh shards over all its ranks (FSDP); a 2-D mesh
(dp_replicate, dp_shard_cp) shards within a row and replicates across rows (HSDP).

Mixed precision: with `param_dtype=bfloat16` the all-gathered copies the blocks compute with are
bf16 while the sharded parameters the optimizer updates stay fp32 (the master weights), and
gradients are reduced in `reduce_dtype` (fp32). The root does not cast its forward inputs: the
spec passes the flow-matching timestep in fp32, as the diffusers pipelines do, and autocast covers
the root's own layers.

CPU offload (`parallel.cpu_offload`): FSDP2's CPUOffloadPolicy keeps the sharded parameters, their
gradients and the optimizer state in CPU memory (pinned when the compute is on a GPU); each block's
parameters are copied to the GPU for its all-gather and the optimizer steps on the CPU. GPU memory
then holds little more than activations (still checkpointed per block when asked).

Outputs that are views: FSDP2 hooks a sharded module's outputs to all-gather its parameters before
their backward, and an in-place op on an output that is a view would skip that hook (torch warns
"FSDP2-wrapped module ... returned a view tensor"). Every family's sharded modules return views: a
unit ending in an `nn.Linear` on a contiguous 3-D input (attention's `to_out`, the FFN's last
projection), which torch computes as one matmul over the flattened rows and `.view`s back to 3-D; a
unit splitting one tensor into several outputs (a joint attention slicing text and video
apart, a norm's `chunk`ed gates); and the root's unpatchify (reshape, permute, flatten), ending in a
view. `_own_outputs`, run just before FSDP2's post-forward hook, copies exactly those outputs (the
ones that need a gradient and are views: what torch warns about), so each owns its storage: one
activation-sized copy per unit, whose backward passes the gradient through untouched.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_fsdp(
    model: nn.Module,
    spec,
    mesh,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = torch.float32,
    cpu_offload: bool = False,
    split_blocks: bool = True,
) -> nn.Module:
    """Shard each block (its large parts first, with `split_blocks`), then the root, over `mesh` (1-D: FSDP,
    2-D (replicate, shard): HSDP)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh.ndim not in (1, 2):
        raise ValueError(f"FSDP needs a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh.mesh_dim_names}")
    if param_dtype is None:
        reduce_dtype = None  # fp32 parameters already reduce in fp32
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    blocks = spec.blocks(model)
    kept = [model]  # what stays gathered after forward: the root, and the last block, needed first in backward
    for index, block in enumerate(blocks):
        last = index == len(blocks) - 1
        for unit in units(block) if split_blocks else ():
            fully_shard(unit, mesh=mesh, mp_policy=block_policy, reshard_after_forward=not last, offload_policy=offload)
            kept += [unit] if last else []
        fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=not last, offload_policy=offload)
    kept += blocks[-1:]
    lists = {id(getattr(model, name)) for name in spec.block_lists}
    for child in model.children() if split_blocks else ():  # the root's large parts (embedders): gathered when used
        if id(child) not in lists and sum(p.numel() for p in child.parameters()) >= ROOT_UNIT:
            fully_shard(child, mesh=mesh, mp_policy=root_policy, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # runs before FSDP2's own post-forward hook, which registers on the output
            module.register_forward_hook(_own_outputs, prepend=True)
    for module in kept:
        module._vt_keep_after_forward = True  # what inference (validation) turns off for its forwards
    return model


ROOT_UNIT = 1 << 20  # parameters: a part of the root this large (text and time embedders) is a unit of its own


def units(block: nn.Module) -> list[nn.Module]:
    """A block's large parts (each at least an eighth of its parameters: attention, FFN), sharded as units
    of their own so that one gather holds one part, not the whole block; [] when one part is the block."""
    inner = getattr(block, "_checkpoint_wrapped_module", block)  # under activation checkpointing
    total = sum(p.numel() for p in inner.parameters())
    large = [child for child in _called_parts(inner) if 8 * sum(p.numel() for p in child.parameters()) >= total]
    return large if len(large) > 1 else []


def _called_parts(module: nn.Module):
    """`module`'s children, each container among them (a module with no forward of its own, which its parent never
    calls: a ModuleList, Kandinsky 6's per-stream halves of a fused block) replaced by its own parts: FSDP2 gathers
    a unit in its forward, so a unit must be a module that runs."""
    for child in module.children():
        if type(child).forward is nn.Module.forward:
            yield from _called_parts(child)
        else:
            yield child


def _own_outputs(module: nn.Module, args, output):
    """The output with each tensor that needs a gradient and is a view replaced by a copy (see the module's
    docstring); tuples, lists and dicts walked, a dict (diffusers' BaseOutput) updated in place so that its
    attributes follow. None (keep the output) when nothing needed a copy, or without gradients."""
    if not torch.is_grad_enabled():
        return None
    owned = _owned(output)
    return None if owned is output else owned


def _owned(value):
    if isinstance(value, torch.Tensor):
        return value.clone() if value.requires_grad and value._base is not None else value
    if isinstance(value, (tuple, list)):
        items = [_owned(item) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return type(value)(items) if not hasattr(value, "_fields") else type(value)(*items)
    if isinstance(value, dict):
        changed = {key: new for key, item in value.items() if (new := _owned(item)) is not item}
        for key, new in changed.items():
            value[key] = new  # BaseOutput's __setitem__ sets the attribute too
        return value
    return value
