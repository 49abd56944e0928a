"""The process's place in the job: process group from torchrun's environment, device, mesh, collectives.

One `World` per trainer. With WORLD_SIZE unset or 1 it is a plain single process: no process group,
no mesh, and every collective below is the identity, so the training loop has one code path; the
exception is CPU offload, an FSDP2 policy, for which one process joins a group of one over an
in-memory store.
Under torchrun (one node or many, c10d rendezvous) it initialises the default process group from
the environment: gloo on CPU, NCCL for CUDA tensors plus gloo for CPU ones (object collectives,
CPU-offloaded state-dict gathers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vt.shared import runtime
from vt.train.parallel.dims import Meshes, ParallelDims


@dataclass
class World:
    dims: ParallelDims
    rank: int
    local_rank: int
    device: torch.device
    mesh: Meshes | None  # the named meshes when distributed

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.dims.dp_rank(self.rank)

    def group(self, name: str):
        """The process group of one (possibly flattened) mesh dimension; None when single-process."""
        return None if self.mesh is None else self.mesh[name].get_group()

    # -- collectives (identity when single-process) --------------------------------------------------
    def sum(self, value: torch.Tensor, over: str = "dp") -> torch.Tensor:
        """Sum a tensor over the ranks of mesh dimension `over` (default: the data-parallel ranks)."""
        if self.mesh is not None:
            value = value.clone()
            dist.all_reduce(value, op=dist.ReduceOp.SUM, group=self.group(over))
        return value

    def gather_floats(self, value: float) -> list[float]:
        """One float from every rank, in rank order (e.g. per-rank peak memory)."""
        if self.mesh is None:
            return [float(value)]
        local = torch.tensor([float(value)], dtype=torch.float64, device=self.comm_device)
        out = [torch.zeros_like(local) for _ in range(self.dims.world_size)]
        dist.all_gather(out, local)
        return [float(t.item()) for t in out]

    def broadcast_object(self, value, src: int = 0):
        """Rank `src`'s `value` (any picklable object) on every rank; `value` is ignored elsewhere. Over the CPU
        backend (gloo), in a CUDA job too: small host-side objects, no GPU copy or sync."""
        if self.mesh is None:
            return value
        box = [value if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=torch.device("cpu"))
        return box[0]

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: NCCL needs them on the GPU, gloo on the CPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def setup_world(parallel, device_name: str = "auto") -> World:
    """Check the degrees against torchrun's WORLD_SIZE, join the process group, build the mesh."""
    world_size = runtime.world_size()
    dims = ParallelDims.from_config(parallel, world_size)  # a bad product stops here, on every rank
    device = runtime.pick_device(device_name)
    if not dims.distributed:
        return World(dims, 0, 0, device, None)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if world_size == 1:  # one process sharding over itself (CPU offload): no launcher, an in-memory store
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        else:
            dist.init_process_group(backend=backend)
    if dist.get_world_size() != world_size:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE says {world_size}")
    mesh = dims.build_mesh(device.type)
    return World(dims, dist.get_rank(), runtime.local_rank(), device, mesh)


def shutdown_world() -> None:
    """Leave the process group (end of a run, also after an error) so the job exits cleanly."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
