"""What each rank trains on, from every rank's own sample log: disjoint data-parallel slices,
identical samples within a tensor-parallel group, one bucket per micro-step on all ranks, and every
sample exactly once per epoch, including a last batch smaller than the data-parallel degree."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from cli_runs import raw_keys
from dist_runs import assert_same_training, finish, sample_log, torchrun

from vt.train.parallel.dims import ParallelDims


def check_slices(run_dir, dims: ParallelDims) -> Counter:
    """Assert the slice rules for every micro-step; returns how often each sample was trained on."""
    entries = sample_log(run_dir)
    global_batches = defaultdict(list)  # step -> [keys of micro-batch 0, 1, ...] as rank 0 read them
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        entry = json.loads(line)
        global_batches[entry["step"]].append((entry["bucket"], entry["keys"]))
    by_micro = defaultdict(list)
    for entry in entries:
        by_micro[entry["step"], entry["micro"]].append(entry)
    assert sorted(by_micro) == sorted((s, m) for s, batches in global_batches.items() for m in range(len(batches)))
    trained = Counter()
    for (step, micro), ranks in by_micro.items():
        bucket, keys = global_batches[step][micro]
        assert sorted(e["rank"] for e in ranks) == list(range(dims.world_size)), f"step {step}: ranks missing"
        assert {e["bucket"] for e in ranks} == {bucket}, f"step {step}: ranks used different buckets"
        slices = {}
        for e in ranks:
            assert e["dp_rank"] == dims.dp_rank(e["rank"])
            assert {k: e[k] for k in ("dp_replicate", "dp_shard", "cp", "tp")} == dims.coordinate(e["rank"])
            # ranks of one cp/tp group (same dp rank) train on identical samples
            assert slices.setdefault(e["dp_rank"], e["keys"]) == e["keys"], f"step {step}: a cp/tp group disagrees"
        assert sorted(slices) == list(range(dims.dp))
        flat = [k for d in range(dims.dp) for k in slices[d]]
        assert flat == keys, f"step {step}: data-parallel slices are not a disjoint cover of the global batch"
        sizes = [len(slices[d]) for d in range(dims.dp)]
        assert max(sizes) - min(sizes) <= 1, f"step {step}: unbalanced slices {sizes}"
        trained.update(flat)
    return trained


def test_slices_are_disjoint_across_dp_identical_within_tp_and_cover_the_epoch(tmp_path, run_config, reference,
                                                                               raw_shards):
    dims = ParallelDims(dp_shard=2, tp=2, world_size=4)
    config = run_config(tmp_path, "wan", "fsdp-tp")
    finish(torchrun(config, 4, "parallel.dp_shard=2", "parallel.tp=2", log=tmp_path / "run.log"), tmp_path / "run.log")

    trained = check_slices(tmp_path / "fsdp-tp", dims)
    assert set(trained) == raw_keys(raw_shards) and set(trained.values()) == {1}, "not every sample exactly once"
    last = [e for e in sample_log(tmp_path / "fsdp-tp") if e["step"] == 4]  # step 4: 1 sample, 2 dp ranks
    assert sorted(len(e["keys"]) for e in last) == [0, 0, 1, 1], "the last sample should go to one tp group only"
    assert_same_training(tmp_path / "fsdp-tp", reference("wan"))  # the stand-in adds nothing to loss or gradients
