"""Exact resume from every checkpoint of a run whose latent shards are larger than the batch.

Shards of 5 samples with batches of 2 leave full batches pending after a shard is read, buckets
interleave, each bucket ends an epoch with an uneven tail, and the learning rate warms up. The run
checkpoints after every step; a resume from each of those checkpoints must train the very same
sample keys at every later step, with the same losses, as the uninterrupted run.
"""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest

from vt.shared.config import load_config
from vt.train.trackers import read_metrics

from helpers.cli_runs import write_config

SETTINGS = dict(
    window={"size": "keep"},
    precompute={"workers": 0, "samples_per_shard": 5, "encode_batch": 5},
    train={"batch_size": 2, "epochs": 2, "checkpoint_every": 1, "lr": 1e-3},
    lr_schedule={"warmup_steps": 3},
    log={"samples": True},
)


def steps(run_dir) -> dict[int, tuple[list[str], float]]:
    """step -> (its sample keys, its loss), from samples.jsonl and metrics.jsonl."""
    keys: dict[int, list[str]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        record = json.loads(line)
        keys.setdefault(record["step"], []).extend(record["keys"])
    losses = {m["step"]: m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")}
    return {step: (keys[step], losses[step]) for step in keys}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_model_factory, clips_dir):
    """The window and the uninterrupted run, with every checkpoint kept.

    The clips' 1.8 s pieces, interleaved as a crawl mixes sources: 7 wide samples (one bucket), 4
    near-square ones (another), so shards of 5 alternate buckets and the wide bucket ends odd. (Each
    resume trains to the end: the test's cost grows with the square of the steps, 12 here.)
    """
    from make_sample_shards import make_sample_shards

    from vt.precompute.service import Precompute
    from vt.train.trainer import Trainer

    root = tmp_path_factory.mktemp("positions")
    raw = root / "raw"
    make_sample_shards(sorted(clips_dir.glob("*.mp4")), raw, seconds=1.8, per_shard=4, max_side=128, interleave=True)
    config = write_config(
        root / "run.toml", tiny_model_factory("ltx-video"), raw, root / "reference", str(root / "window"), **SETTINGS
    )
    Precompute(load_config(config)).run()
    trainer = Trainer(load_config(config))
    trainer.checkpointer.keep = 10**6
    trainer.run()
    return config, root / "reference"


def test_the_reference_run_takes_the_paths_a_resume_must_repeat(reference):
    """The data really has what makes resume hard: several buckets interleaved, shards larger than
    the batch, uneven tails; each sample once per epoch."""
    from vt.shared.window import open_reader

    config, run_dir = reference
    records = [record for _, record in open_reader(load_config(config).window.uri).order()]
    buckets = [record.bucket for record in records]
    assert len(set(buckets)) >= 2 and any(a != b for a, b in zip(buckets, buckets[1:]))
    assert max(len(record.keys) for record in records) > 2  # a shard holds more than one batch
    trained = steps(run_dir)
    sizes = Counter(len(keys) for keys, _ in trained.values())
    assert sizes[1] >= 1  # an uneven tail
    keys = [key for step_keys, _ in trained.values() for key in step_keys]
    all_keys = {key for record in records for key in record.keys}
    assert Counter(keys) == Counter({key: 2 for key in all_keys})  # two epochs, each sample once each


def test_resume_from_every_checkpoint_repeats_the_run(reference, tmp_path):
    from vt.train.trainer import Trainer

    config, run_dir = reference
    expected = steps(run_dir)
    last = max(expected)
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    assert [int(p.name.split("-")[1]) for p in checkpoints] == list(range(1, last + 1))
    for checkpoint in checkpoints[:-1]:
        at = int(checkpoint.name.split("-")[1])
        resumed = tmp_path / f"from-{at}"
        shutil.copytree(checkpoint, resumed / "checkpoints" / checkpoint.name)
        # the resumed run's own checkpoints are never read: saving them would only cost time
        Trainer(load_config(config, [f'run.dir="{resumed}"', "train.checkpoint_every=0"])).run()
        got = steps(resumed)
        assert sorted(got) == list(range(at + 1, last + 1)), f"resumed at step {at}"
        for step in got:
            assert got[step][0] == expected[step][0], f"resumed at step {at}: step {step} trained other samples"
            assert got[step][1] == pytest.approx(expected[step][1], rel=1e-6), f"resumed at {at}: loss of step {step}"


def test_a_log_interval_longer_than_the_run_still_logs_and_plots_the_last_step(reference, tmp_path):
    from vt.train.trainer import Trainer

    config, _ = reference
    run_dir = tmp_path / "sparse"
    summary = Trainer(
        load_config(
            config,
            [
                f'run.dir="{run_dir}"',
                "log.every_steps=100",
                "train.max_steps=3",
                "log.samples=false",
                "train.checkpoint_every=0",
            ],
        )
    ).run()
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [3]
    assert summary["steps"] == 3 and (run_dir / "loss.png").stat().st_size > 0
