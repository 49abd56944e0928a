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
from vt.shared.log import get_logger
from vt.train.parallel.dims import Meshes, ParallelDims
from vt.train.parallel.layout import needs_plan, unplanned_reason

log = get_logger("vt.train.parallel")


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

    def gather_objects(self, value) -> list | None:
        """Every rank's `value` (any picklable object), in rank order, on rank 0 (None elsewhere); over the CPU
        backend, as `broadcast_object`."""
        if self.mesh is None:
            return [value]
        out = [None] * self.dims.world_size if self.is_main else None
        dist.gather_object(value, out, dst=0)
        return out

    def barrier(self) -> None:
        if self.mesh is not None:
            dist.barrier()

    @property
    def comm_device(self) -> torch.device:
        """Where collective buffers live: NCCL needs them on the GPU, gloo on the CPU."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def setup_world(parallel, device_name: str = "auto", auto_layout=None) -> World:
    """Check the degrees against torchrun's WORLD_SIZE, join the process group, build the mesh.

    `parallel.dp_shard = "auto"`: where there is a choice (parallel/layout.py), rank 0 calls
    `auto_layout(device)` -> LayoutChoice and every rank takes its degrees; without `auto_layout`, or
    where there is no choice, auto shards as -1 does."""
    world_size = runtime.world_size()
    device = runtime.pick_device(device_name)
    dims = ParallelDims.from_config(parallel, world_size)  # a bad product stops here, on every rank
    unplanned = unplanned_reason(parallel, world_size) if parallel.dp_shard == "auto" else None
    if unplanned and world_size > 1 and runtime.rank() == 0:
        log.info("parallel.dp_shard = auto: shard (the rest of the world), not planned: %s", unplanned)
    if auto_layout is not None and needs_plan(parallel, world_size):
        _join(device, world_size)
        dp_replicate, dp_shard = _agree_on_layout(device, auto_layout)
        picked = parallel.model_copy(update={"dp_replicate": dp_replicate, "dp_shard": dp_shard})
        dims = ParallelDims.from_config(picked, world_size)
    if not dims.distributed:
        return World(dims, 0, 0, device, None)
    _join(device, world_size)
    mesh = dims.build_mesh(device.type)
    return World(dims, dist.get_rank(), runtime.local_rank(), device, mesh)


def _join(device: torch.device, world_size: int) -> None:
    """Initialise the default process group once (gloo on CPU, NCCL for CUDA tensors plus gloo for CPU ones)."""
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


def _agree_on_layout(device: torch.device, auto_layout) -> tuple[int, int]:
    """Rank 0's `auto_layout(device)` degrees on every rank (a broadcast); a failure there stops every rank."""
    degrees = torch.zeros(2, dtype=torch.int64, device=device if device.type == "cuda" else "cpu")
    failure = None
    if dist.get_rank() == 0:
        try:
            choice = auto_layout(device)
            degrees[0], degrees[1] = choice.dp_replicate, choice.dp_shard
        except Exception as err:  # the others must not wait for a choice that never comes
            failure = err
    dist.broadcast(degrees, src=0)
    if failure is not None:
        raise failure
    dp_replicate, dp_shard = (int(v) for v in degrees.tolist())
    if dp_replicate < 1:
        raise RuntimeError(
            "rank 0 could not plan parallel.dp_shard = auto (its log says why); "
            "set parallel.dp_shard to -1 or a degree to skip planning"
        )
    return dp_replicate, dp_shard


def shutdown_world() -> None:
    """Leave the process group (end of a run, also after an error) so the job exits cleanly."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
