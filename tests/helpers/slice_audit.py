"""What each rank trains on, from every rank's own sample log: disjoint data-parallel slices,
identical samples within a tensor-parallel group, one bucket per micro-step on all ranks, and every
sample exactly once per epoch, including a last batch smaller than the data-parallel degree. Every
parity run (test_parity.py) audits its logs with these."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

from vt.train.parallel.dims import MESH_DIMS, ParallelDims

from helpers.dist_runs import sample_log


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
            assert {k: e[k] for k in MESH_DIMS} == dims.coordinate(e["rank"])
            # ranks of one pp/cp/tp group (same dp rank) train on identical samples
            assert slices.setdefault(e["dp_rank"], e["keys"]) == e["keys"], f"step {step}: a cp/tp group disagrees"
        assert sorted(slices) == list(range(dims.dp))
        flat = [k for d in range(dims.dp) for k in slices[d]]
        assert flat == keys, f"step {step}: data-parallel slices are not a disjoint cover of the global batch"
        sizes = [len(slices[d]) for d in range(dims.dp)]
        assert max(sizes) - min(sizes) <= 1, f"step {step}: unbalanced slices {sizes}"
        trained.update(flat)
    return trained


def check_uneven_last_step(run_dir, dims: ParallelDims) -> None:
    """The 4th step holds 1 sample: with several data-parallel ranks, exactly one dp group (its cp x tp
    ranks) trains on it and the others run on a weightless stand-in."""
    last = [e for e in sample_log(run_dir) if e["step"] == 4]
    assert sorted(len(e["keys"]) for e in last) == sorted(
        [1] * (dims.cp * dims.tp) + [0] * (dims.world_size - dims.cp * dims.tp)
    ), "the last sample went astray"
