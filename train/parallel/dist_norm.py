"""RMSNorm over channels that are spread across tensor-parallel ranks.

Some transformers normalise queries and keys with one RMSNorm over all heads' channels
("rms_norm_across_heads"). Once the q/k projections are split column-wise, each rank holds only
its heads' channels, so a local norm would divide by the wrong root-mean-square. This norm sums
the squares locally, all-reduces that sum over the tp group and divides by the full channel count,
so every rank normalises its channels exactly as one process would. Its weight is sharded like the
channels (a DTensor with Shard(0) on the tp mesh), so FSDP2 and DCP see one logical parameter.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from vt.shared.errors import UserError
from vt.train.parallel.ulysses import all_reduce_sum


class ShardedRMSNorm(nn.Module):
    """RMSNorm whose input holds this rank's chunk of `full_dim` channels; the rest live on the mesh's other ranks."""

    def __init__(self, weight: Tensor | None, full_dim: int, eps: float | None, mesh: DeviceMesh):
        super().__init__()
        self.full_dim = full_dim
        self.eps = eps
        self.mesh = mesh
        self.weight = weight if weight is None else nn.Parameter(weight, requires_grad=weight.requires_grad)

    @classmethod
    def from_rmsnorm(cls, norm: nn.RMSNorm, mesh: DeviceMesh) -> "ShardedRMSNorm":
        """Replaces torch's RMSNorm over all channels; the weight is split in rank order, as ColwiseParallel splits."""
        if not isinstance(norm, nn.RMSNorm) or len(norm.normalized_shape) != 1:
            raise TypeError(
                f"the TP plan's head norms must be torch.nn.RMSNorm over one dim, got {type(norm).__name__}"
            )
        (full_dim,) = norm.normalized_shape
        if full_dim % mesh.size():
            raise UserError(f"a query/key norm over {full_dim} channels cannot be split over tp={mesh.size()} ranks")
        weight = None
        if norm.weight is not None:
            # Every rank loaded the same weights, so each takes its own shard without communication.
            weight = distribute_tensor(norm.weight.detach(), mesh, [Shard(0)], src_data_rank=None)
            weight.requires_grad_(norm.weight.requires_grad)
        return cls(weight, full_dim, norm.eps, mesh)

    def forward(self, x: Tensor) -> Tensor:
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        squares = x.float().pow(2).sum(dim=-1, keepdim=True)
        mean = all_reduce_sum(squares, self.mesh.get_group()) / self.full_dim
        out = x.float() * torch.rsqrt(mean + eps)  # as torch's rms_norm: upcast, scale, weight, cast back
        if self.weight is not None:
            out = out * (self.weight.to_local() if isinstance(self.weight, DTensor) else self.weight)
        return out.type_as(x)

    def extra_repr(self) -> str:
        return f"full_dim={self.full_dim}, eps={self.eps}, tp={self.mesh.size()}"
