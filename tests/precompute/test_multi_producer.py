"""Two lanes feed one window: torchrun starts two producers, the window interleaves the lanes in a fixed order.

The same data is produced twice: once by `torchrun --nproc-per-node 2` (two lanes, each rank takes its own,
timing as it falls) and once by a single producer working both lanes one after the other. The windows
differ in timing and in who made which shard only, so the order the trainer reads (shards, then its
batches) must be identical, every accepted sample must be committed exactly once, and the lane with less
data ends early (its done marker) while the reader carries on with the other lane.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from vt.precompute.service import Precompute
from vt.shared.config import load_config
from vt.shared.window import inspect, open_reader
from vt.train.data import BatchReader

from helpers.cli_runs import raw_keys, write_config
from helpers.curation import EVERY_PROCESSOR, scene_keys

pytestmark = pytest.mark.slow


def reader_order(uri: str) -> list[tuple[str, tuple[str, ...]]]:
    """The trainer's batches (bucket, keys) in the order its reader yields them."""
    return [(batch.bucket, tuple(batch.keys)) for batch in BatchReader(open_reader(uri), 2, on_read=lambda p: None)]


def test_two_ranks_under_torchrun_match_a_rank_by_rank_rerun(tmp_path, tiny_model_factory, raw_shards):
    model = tiny_model_factory("ltx-video")

    def config(name: str) -> Path:
        return write_config(
            tmp_path / f"{name}.toml",
            model,
            raw_shards,
            tmp_path / name,
            str(tmp_path / name / "window"),
            window={"size": "keep"},
            precompute={"workers": 0, "processors": EVERY_PROCESSOR},
            log={"progress": False},
        )

    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    log = tmp_path / "torchrun.log"
    with open(log, "wb") as out:
        code = subprocess.call(
            [
                str(torchrun),
                "--standalone",
                "--nproc-per-node",
                "2",
                "-m",
                "vt.precompute",
                "run",
                str(config("torchrun")),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=300,
        )
    assert code == 0, log.read_text()[-4000:]

    alone = Precompute(load_config(config("rerun"), ["precompute.lanes=2"])).run()  # one producer, both lanes
    assert sorted(alone.lanes) == [0, 1]

    first, second = str(tmp_path / "torchrun" / "window"), str(tmp_path / "rerun" / "window")
    state = inspect(first)
    assert state["world_size"] == 2 and all(p["done"] for p in state["producers"].values())
    counts = {rank: p["committed"] for rank, p in state["producers"].items()}
    assert counts[0] != counts[1]  # unequal shares: one rank runs out first, the order goes on

    records = [record for _, record in open_reader(first).order()]
    keys = Counter(key for record in records for key in record.keys)
    assert set(keys) == scene_keys(raw_keys(raw_shards)) and set(keys.values()) == {1}
    ranks = [record.producer for record in records]
    short = min(counts, key=counts.get)
    assert ranks[: 2 * counts[short]] == [0, 1] * counts[short]  # round-robin while both have shards

    slots = lambda uri: [(r.producer, r.seq, r.bucket, tuple(r.keys)) for _, r in open_reader(uri).order()]
    assert slots(first) == slots(second)
    assert reader_order(first) == reader_order(second)
    reports = [
        json.loads((tmp_path / "torchrun" / f"precompute_report.rank{rank}.json").read_text()) for rank in (0, 1)
    ]
    assert sorted(lane for report in reports for lane in report["lanes"]) == [0, 1]  # a rank slow to start may find
    assert {report["status"] for report in reports} <= {"done", "already done"}  # both lanes taken by the other
    for lane in (0, 1):
        assert (tmp_path / "torchrun" / f"rejects.lane{lane}.jsonl").read_text() == ""  # per lane
