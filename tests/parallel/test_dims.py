"""ParallelDims and the data split, without processes: validation messages, rank coordinates, slices
and per-sample noise; then one 4-process gloo group checks the DeviceMesh against the coordinates."""

from __future__ import annotations

import pytest
import torch

from vt.train.data import Batch
from vt.train.parallel.batching import draw_inputs, slice_bounds, take_slice
from vt.train.parallel.dims import ParallelConfigError, ParallelDims


def test_dp_shard_minus_one_takes_the_rest_and_strategies_follow():
    dims = ParallelDims(dp_replicate=2, dp_shard=-1, cp=1, tp=2, world_size=8)
    assert (dims.dp_shard, dims.dp) == (2, 4)
    assert dims.hsdp_enabled and dims.fsdp_enabled and not dims.ddp_enabled
    assert ParallelDims(dp_replicate=4, dp_shard=1, world_size=4).ddp_enabled
    assert ParallelDims(dp_shard=1, cp=2, world_size=2).fsdp_enabled  # cp ranks' gradients are averaged by FSDP
    assert ParallelDims(dp_shard=1, cp=2, world_size=2).fsdp_mesh_dims() == ("dp_shard_cp",)
    assert ParallelDims(dp_replicate=2, dp_shard=2, world_size=4).fsdp_mesh_dims() == ("dp_replicate", "dp_shard")
    assert not ParallelDims(world_size=1).distributed


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (dict(dp_replicate=2, dp_shard=2, world_size=2), "Launch 4 processes"),
        (dict(dp_replicate=3, world_size=4), "Launch a multiple of 3 processes"),
        (dict(tp=0, world_size=2), "parallel.tp must be >= 1"),
        (dict(dp_shard=-2, world_size=2), "parallel.dp_shard must be >= 1 or -1"),
    ],
)
def test_a_wrong_product_stops_with_the_fix(kwargs, fix):
    with pytest.raises(ParallelConfigError, match=fix):
        ParallelDims(**kwargs)


def test_coordinates_are_row_major_and_cp_tp_peers_share_a_data_slice():
    dims = ParallelDims(dp_replicate=2, dp_shard=2, cp=2, tp=2, world_size=16)
    assert dims.coordinate(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert dims.coordinate(1) == {
        "pp": 0,
        "dp_replicate": 0,
        "dp_shard": 0,
        "cp": 0,
        "tp": 1,
    }  # tp peers are neighbours
    assert dims.coordinate(13) == {"pp": 0, "dp_replicate": 1, "dp_shard": 1, "cp": 0, "tp": 1}
    groups = {}
    for rank in range(16):
        groups.setdefault(dims.dp_rank(rank), []).append(rank)
    assert groups == {0: [0, 1, 2, 3], 1: [4, 5, 6, 7], 2: [8, 9, 10, 11], 3: [12, 13, 14, 15]}


def batch(n: int) -> Batch:
    latents = torch.arange(n * 2 * 2 * 2 * 2, dtype=torch.float32).reshape(n, 2, 2, 2, 2)
    return Batch("9x64x64", 0, [f"k{i}" for i in range(n)], {"latents": latents, "prompt_embeds": torch.ones(n, 3, 4)})


@pytest.mark.parametrize("n, parts", [(4, 2), (3, 2), (13, 4), (1, 2), (2, 4)])
def test_slices_cover_a_batch_once_and_differ_by_at_most_one(n, parts):
    bounds = [slice_bounds(n, d, parts) for d in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [stop - start for start, stop in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_an_empty_slice_runs_a_weightless_stand_in():
    parts = [take_slice(batch(1), d, 2, offset=5) for d in range(2)]
    assert (parts[0].keys, parts[0].count, parts[0].first_index) == (["k0"], 1, 5)
    assert (parts[1].keys, parts[1].count) == ([], 0)
    assert parts[1].tensors["latents"].shape[0] == 1  # a real row keeps the forward and its collectives


def test_noise_and_sigmas_do_not_depend_on_the_slicing():
    whole = take_slice(batch(4), 0, 1)
    sigmas, noise = draw_inputs(whole, seed=3, step=7, scheme="logit_normal", shift=1.0)
    halves = [draw_inputs(take_slice(batch(4), d, 2), 3, 7, "logit_normal", 1.0) for d in range(2)]
    assert torch.equal(torch.cat([h[0] for h in halves]), sigmas)
    assert torch.equal(torch.cat([h[1] for h in halves]), noise)
    # the second micro-batch of an accumulated step continues the indices: same as one big batch
    big_sigmas, big_noise = draw_inputs(take_slice(batch(8), 0, 1), 3, 7, "logit_normal", 1.0)
    second = draw_inputs(take_slice(batch(4), 0, 1, offset=4), 3, 7, "logit_normal", 1.0)
    assert torch.equal(big_sigmas[4:], second[0]) and torch.equal(big_noise[4:], second[1])
    assert not torch.equal(sigmas[:2], sigmas[2:])  # samples (and so dp ranks) draw differently
    other_step = draw_inputs(whole, 3, 8, "logit_normal", 1.0)
    assert not torch.equal(other_step[0], sigmas)


def test_the_device_mesh_matches_the_coordinates(tmp_path):
    import json

    from helpers import HELPERS
    from helpers.dist_runs import finish
    from helpers.forkserver import launch_ranks

    world = 4
    log, out = tmp_path / "ranks.log", tmp_path / "mesh"
    finish(
        launch_ranks(str(HELPERS / "mesh_worker.py"), world, str(world), str(tmp_path / "store"), str(out), log=log),
        log,
    )
    results = {rank: json.loads(out.with_name(f"mesh.{rank}").read_text()) for rank in range(world)}
    for rank, per_layout in results.items():
        for kwargs, coords, sizes, fsdp_dims, dp_sum in per_layout:
            dims = ParallelDims(**kwargs, world_size=world)
            assert coords == dims.coordinate(rank), (kwargs, rank)
            assert sizes == {"dp": dims.dp, "dp_shard_cp": dims.dp_shard * dims.cp}
            assert (tuple(fsdp_dims) if fsdp_dims else None) == (dims.fsdp_mesh_dims() if dims.fsdp_enabled else None)
            assert dp_sum == sum(range(dims.dp))


def test_the_trainer_stops_before_joining_a_group_when_degrees_do_not_fit(monkeypatch):
    import torch.distributed as dist

    from vt.shared.config import ParallelConfig
    from vt.train.parallel.world import setup_world

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ParallelConfigError, match="but 2 processes were launched"):
        setup_world(ParallelConfig(dp_replicate=2, dp_shard=2), "cpu")
    assert not dist.is_initialized()
