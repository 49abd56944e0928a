"""Token budgets (`token_budget.tokens_per_batch`): each bucket's batch holds as many samples as fit the budget, so the small
bucket takes twice the samples of the wide one; every layout trains what one process trains, and a killed run
resumes into the same steps.

Wan's tiny preset (LoRA) over the real clips in two buckets: 5x64x64 is 32 transformer tokens a sample (2 latent
frames of 4 x 4), 5x64x128 64, so a budget of 128 tokens makes batches of 4 and 2.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vt.shared.config import load_config
from vt.train.trackers import read_metrics

from helpers.dist_runs import finish, kill_and_resume, single, torchrun

BUDGET = 128
SIZES = {"5x64x64": 4, "5x64x128": 2}


@pytest.fixture(scope="module")
def two_buckets(tmp_path_factory, tiny_model_factory, raw_shards):
    from vt.precompute.service import run_stage1

    from helpers.cli_runs import write_config

    root = tmp_path_factory.mktemp("token-budget")
    model = tiny_model_factory("wan")

    def config(folder: Path, name: str, **train) -> Path:
        return write_config(
            folder / f"{name}.toml",
            model,
            raw_shards,
            folder / name,
            str(root / "window"),
            model={"family": "wan", "max_text_tokens": 64},
            buckets={"sizes": list(SIZES)},
            window={"size": "keep"},
            precompute={"workers": 0},
            token_budget={"tokens_per_batch": BUDGET},
            train={
                "lr": 1e-3,
                "epochs": 2,
                "checkpoint_every": 2,
                "max_grad_norm": 0.05,
                **train,
            },
            log={"progress": False, "samples": True},
        )

    run_stage1(load_config(config(root, "pre")))
    return config


def steps(run_dir: Path) -> dict[int, dict]:
    return {m["step"]: m for m in read_metrics(run_dir / "metrics.jsonl")}  # a re-logged step: the last wins


def batches(run_dir: Path) -> list[tuple[str, int]]:
    """(bucket, samples) of every step, from <run.dir>/samples.jsonl."""
    import json

    seen = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        seen[record["step"]] = (record["bucket"], len(record["keys"]))
    return [seen[step] for step in sorted(seen)]


@pytest.mark.xdist_group("token-budget")
def test_a_token_budget_fills_each_bucket_and_every_layout_and_a_resume_train_alike(tmp_path, two_buckets):
    log = tmp_path / "reference.log"
    finish(single(two_buckets(tmp_path, "reference"), log=log), log)
    expected = steps(tmp_path / "reference")
    trained = batches(tmp_path / "reference")
    full = {bucket for bucket, samples in trained if samples == SIZES[bucket]}
    assert full == set(SIZES), trained  # both buckets filled to their budget at least once
    assert all(samples <= SIZES[bucket] for bucket, samples in trained), trained
    for name, overrides in (
        ("ddp-2", ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
        ("fsdp-2", ["parallel.dp_shard=2"]),
    ):
        log = tmp_path / f"{name}.log"
        finish(torchrun(two_buckets(tmp_path, name), 2, *overrides, log=log), log)
        got = steps(tmp_path / name)
        assert sorted(got) == sorted(expected), name
        for step, metrics in expected.items():
            assert got[step]["batch"] == metrics["batch"], (name, step)
            assert got[step]["loss"] == pytest.approx(metrics["loss"], rel=1e-4), (name, step)
            assert got[step]["grad_norm"] == pytest.approx(metrics["grad_norm"], rel=1e-4), (name, step)
    kill_and_resume(two_buckets(tmp_path, "resumed"), "train.after_checkpoint@2", tmp_path)  # after step 4's
    got = steps(tmp_path / "resumed")
    assert sorted(got) == sorted(expected)
    for step, metrics in expected.items():
        assert got[step]["loss"] == pytest.approx(metrics["loss"], rel=1e-6), ("resumed", step)
