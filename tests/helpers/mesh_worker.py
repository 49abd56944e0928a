"""Worker of test_dims' mesh check: a script the test starts as torchrun's ranks, forked from the warm interpreter
(tests/helpers/forkserver.py); each rank writes its results to OUT.<rank> as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

from vt.train.parallel.dims import MESH_DIMS, ParallelDims

LAYOUTS = (
    dict(dp_replicate=2, dp_shard=2),
    dict(dp_shard=2, tp=2),
    dict(cp=2, tp=2, dp_shard=1),
    dict(pp=2, dp_shard=2),
)


def check_mesh(rank: int, world: int, store_path: str, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    results = []
    try:
        for kwargs in LAYOUTS:
            dims = ParallelDims(**kwargs, world_size=world)
            meshes = dims.build_mesh("cpu")
            coords = {name: meshes[name].get_local_rank() for name in MESH_DIMS}
            sizes = {name: meshes[name].size() for name in ("dp", "dp_shard_cp")}
            fsdp = meshes[dims.fsdp_mesh_dims()] if dims.fsdp_enabled else None
            # all-reduce over "dp": ranks of one cp/tp group contribute once per data slice
            value = torch.tensor([float(dims.dp_rank(rank))])
            dist.all_reduce(value, group=meshes["dp"].get_group())
            results.append((kwargs, coords, sizes, fsdp.mesh_dim_names if fsdp else None, value.item()))
        with open(f"{out}.{rank}", "w") as f:
            json.dump(results, f)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":  # WORLD STORE OUT; RANK from torchrun's environment
    world, store, out = sys.argv[1:]
    check_mesh(int(os.environ["RANK"]), int(world), store, out)
