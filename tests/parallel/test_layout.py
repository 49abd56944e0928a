"""`parallel.dp_shard = "auto"` without processes: the config's default, the decision from planned peaks and
a budget, when nothing is planned, and the choice kept in run.dir for a resume (train/parallel/layout.py).
The 2-rank run that picks and trains is a parity row (tests/parallel/test_parity.py, "auto-2")."""

from __future__ import annotations

import json

import pytest
import torch

from vt.shared.config import ParallelConfig, load_config
from vt.train.parallel.dims import ParallelDims
from vt.train.parallel.layout import GIB, LAYOUT_FILE, LayoutChoice, cached_layout, choose, needs_plan, unplanned_reason


def test_auto_is_the_default_and_explicit_degrees_are_kept():
    assert ParallelConfig().dp_shard == "auto"
    assert load_config(None, ["parallel.dp_shard=auto"]).parallel.dp_shard == "auto"
    assert load_config(None, ["parallel.dp_shard=-1"]).parallel.dp_shard == -1
    assert load_config(None, ["parallel.dp_shard=2"]).parallel.dp_shard == 2
    # unresolved (vt-train plan, a world of one): the sharded layout, as -1
    assert ParallelDims.from_config(ParallelConfig(), 4).dp_shard == 4
    assert ParallelDims.from_config(ParallelConfig(), 1).dp_shard == 1


def test_replicates_when_the_replicated_peak_fits_the_budget_else_shards():
    fits = choose(replicated_peak=6 * GIB, sharded_peak=4 * GIB, budget=8 * GIB, data_parallel=4)
    assert (fits.dp_replicate, fits.dp_shard, fits.replicated) == (4, 1, True)
    assert fits.reason == (
        "parallel.dp_shard = auto: replicate (DDP); planned peak per rank 6.00 GiB replicated, "
        "4.00 GiB sharded, budget 8.00 GiB"
    )
    tight = choose(replicated_peak=9 * GIB, sharded_peak=4 * GIB, budget=8 * GIB, data_parallel=4)
    assert (tight.dp_replicate, tight.dp_shard, tight.replicated) == (1, 4, False)
    assert "shard (FSDP2)" in tight.reason and "9.00 GiB replicated" in tight.reason
    exact = choose(replicated_peak=8 * GIB, sharded_peak=4 * GIB, budget=8 * GIB, data_parallel=2)
    assert exact.replicated


@pytest.mark.parametrize(
    "settings, world, why",
    [
        ({"dp_shard": -1}, 4, None),  # explicit: setup_world never asks (dp_shard != "auto"); auto would plan here
        ({"cpu_offload": True}, 4, "CPU offload"),
        ({"dp_replicate": 2}, 4, "dp_replicate = 2 is set"),
        ({"cp": 2}, 4, "without cp, tp and pp"),
        ({"tp": 2}, 2, "without cp, tp and pp"),
        ({"pp": 2}, 4, "without cp, tp and pp"),
        ({}, 1, "one data-parallel rank"),
        ({}, 2, None),
    ],
)
def test_what_is_not_planned(settings, world, why):
    reason = unplanned_reason(ParallelConfig(**settings), world)
    assert (reason is None) if why is None else (why in reason)


@pytest.mark.parametrize(
    "dp_shard, world, planned",
    [("auto", 2, True), ("auto", 8, True), (-1, 2, False), (1, 2, False), (2, 2, False), ("auto", 1, False)],
)
def test_explicit_degrees_win_over_auto(dp_shard, world, planned):
    """setup_world asks rank 0's planner only where auto has a choice; -1 or an integer builds its own layout."""
    assert needs_plan(ParallelConfig(dp_shard=dp_shard), world) is planned


def test_the_choice_is_kept_in_the_run_folder_and_a_resume_does_not_plan_again(tmp_path, caplog):
    config = load_config(None, [f'run.dir="{tmp_path}"'])
    planned = []

    def plan(config, world_size, device, local_ranks):
        planned.append(world_size)
        return choose(GIB, GIB // 2, 2 * GIB, world_size)

    cpu = torch.device("cpu")
    first = cached_layout(config, 2, cpu, 2, tmp_path, plan=plan)
    assert planned == [2] and first.replicated
    kept = json.loads((tmp_path / LAYOUT_FILE).read_text())
    assert kept["choice"] == {"dp_replicate": 2, "dp_shard": 1, "reason": first.reason}
    assert kept["key"]["world_size"] == 2 and kept["key"]["train"]["mode"] == "lora"

    with caplog.at_level("INFO", logger="vt.train.parallel"):
        again = cached_layout(config, 2, cpu, 2, tmp_path, plan=plan)  # the resume
    assert again == first and planned == [2]
    assert f"{first.reason} (kept in {tmp_path / LAYOUT_FILE})" in caplog.text

    # What the plan reads changed (another world size, another LoRA rank): plan again and keep the new choice.
    cached_layout(config, 4, cpu, 4, tmp_path, plan=plan)
    bigger = config.model_copy(update={"adapter": config.adapter.model_copy(update={"rank": 64})})
    cached_layout(bigger, 4, cpu, 4, tmp_path, plan=plan)
    assert planned == [2, 4, 4]
    assert LayoutChoice(**json.loads((tmp_path / LAYOUT_FILE).read_text())["choice"]).dp_replicate == 4


def test_ddp_leaves_a_module_with_nothing_to_train_as_it_is():
    """Auto replicates by default, so a one-expert Wan 2.2 run's frozen validation expert is laid out with DDP:
    torch's DDP refuses a module without trainable parameters at its first forward, so none is wrapped."""
    import torch.distributed as dist
    from torch.distributed._composable.contract import _get_registry

    from vt.train.parallel.ddp import apply_ddp
    from vt.train.parallel.dims import ParallelDims

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = ParallelDims(dp_replicate=1, dp_shard=1, world_size=1).build_mesh("cpu")["dp_replicate"]
        frozen = apply_ddp(torch.nn.Linear(4, 4).requires_grad_(False), mesh)
        with torch.no_grad():
            assert frozen(torch.ones(1, 4)).shape == (1, 4)
        assert "replicate" not in (_get_registry(frozen) or {})
        trained = apply_ddp(torch.nn.Linear(4, 4), mesh)
        assert "replicate" in (_get_registry(trained) or {})
        trained(torch.ones(1, 4)).sum().backward()
        assert trained.weight.grad is not None
    finally:
        dist.destroy_process_group()
