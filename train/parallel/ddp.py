"""DDP: every data-parallel rank holds the whole model; gradients are all-reduced in buckets.

Used when there is nothing to shard (parallel.dp_shard = 1, cp = 1) but there are replicas. We use
the composable `replicate` (the DDP engine applied in place), not the `DistributedDataParallel`
wrapper: the model keeps its class, attributes and parameter names, so the Model Spec's forward
(which reads e.g. `transformer.dtype`), LoRA export and checkpoints see the same module as in a
single-process run. `set_requires_gradient_sync(False)` skips the all-reduce on inner micro-steps. A
module with nothing to train is left as it is.
"""

from __future__ import annotations

from torch import nn


def apply_ddp(model: nn.Module, dp_mesh, bucket_cap_mb: int = 100) -> nn.Module:
    """Replicate `model` over the ranks of `dp_mesh` (1-D); gradients are averaged over them."""
    from torch.distributed._composable.replicate import replicate

    if not any(p.requires_grad for p in model.parameters()):
        # Nothing trains (validation's frozen expert of a one-expert run): no gradients to average, and
        # DDP refuses such a module at its first forward. Every rank filled the same weights already.
        return model
    if dp_mesh.ndim != 1:
        raise ValueError(f"DDP needs a 1-D data-parallel mesh, got {dp_mesh.ndim}-D {dp_mesh.mesh_dim_names}")
    # The process group, not the (sub)mesh: replicate() adds DTensor<->tensor hooks for sliced meshes
    # (its DDP+TP workaround), which plain replicated parameters do not need.
    replicate(model, process_group=dp_mesh.get_group(), bucket_cap_mb=bucket_cap_mb)
    return model
