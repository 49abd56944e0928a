"""FSDP2 (and HSDP): parameters, gradients and optimizer state sharded over the data-parallel ranks.

`fully_shard` is applied per transformer block (the spec's block list), then to the root, so each
block's parameters are all-gathered just before it runs and freed after; the root group holds the
rest (embeddings, norms, projections). A 1-D mesh shards over all its ranks (FSDP); a 2-D mesh
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
"""

from __future__ import annotations

import torch
from torch import nn


def apply_fsdp(model: nn.Module, spec, mesh, param_dtype: torch.dtype | None = None,
               reduce_dtype: torch.dtype | None = torch.float32, cpu_offload: bool = False) -> nn.Module:
    """Shard each block, then the root, over `mesh` (1-D: FSDP, 2-D (replicate, shard): HSDP)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh.ndim not in (1, 2):
        raise ValueError(f"FSDP needs a 1-D (shard) or 2-D (replicate, shard) mesh, got {mesh.mesh_dim_names}")
    if param_dtype is None:
        reduce_dtype = None  # fp32 parameters already reduce in fp32
    block_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    root_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    blocks = spec.blocks(model)
    for index, block in enumerate(blocks):
        # The last block's parameters are needed first in backward: keep them gathered after forward.
        fully_shard(block, mesh=mesh, mp_policy=block_policy, reshard_after_forward=index < len(blocks) - 1,
                    offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=root_policy, offload_policy=offload)  # the root keeps its too
    for module in (blocks[-1], model) if blocks else (model,):
        module._vt_keep_after_forward = True  # what inference (validation) turns off for its forwards
    return model
