"""Both CLIs as separate processes at the same time on real clips, through a 2-shard window."""

from __future__ import annotations

import json
import math
import re
import threading
from collections import Counter

import pytest

from vt.shared.storage import Storage
from vt.train.trackers import read_metrics

from helpers.cli_runs import finish, raw_keys, start, write_config

pytestmark = pytest.mark.slow


def slot(path: str) -> tuple[int, int]:
    """'commits/p0/00000003.json' or 'data/p0/00000003[-suffix].safetensors' -> (0, 3)"""
    rank, name = path.split("/")[-2:]
    return int(rank[1:]), int(re.match(r"\d+", name).group())


class WindowWatcher(threading.Thread):
    """Samples the window's storage until stopped: the most committed-unread and uncommitted shards seen."""

    def __init__(self, uri: str):
        super().__init__(daemon=True)
        self.storage = Storage(uri)
        self.stop = threading.Event()
        self.max_unread = 0
        self.max_uncommitted = 0
        self.observations = 0
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self._watch()
        except Exception as err:  # surfaced by the test, not lost in a thread
            self.error = err

    def _watch(self) -> None:
        while not self.stop.is_set():
            commits = self.storage.list("commits")
            data = self.storage.list("data")
            consumer = json.loads(self.storage.read("consumer.json")) if self.storage.exists("consumer.json") else {}
            read = {int(k): v for k, v in consumer.get("read", {}).items()}
            watermark = {int(k): v for k, v in consumer.get("watermark", {}).items()}
            unread = sum(seq >= read.get(rank, 0) for rank, seq in map(slot, commits))
            committed = set(map(slot, commits))
            # data without a record, above the watermark: being written (below it: being evicted)
            writing = [s for s in map(slot, data) if s not in committed and s[1] >= watermark.get(s[0], 0)]
            self.max_unread = max(self.max_unread, unread)
            self.max_uncommitted = max(self.max_uncommitted, len(writing))
            self.observations += 1
            self.stop.wait(0.01)


@pytest.mark.parametrize("epochs", [2])
def test_both_stages_at_once_through_a_two_shard_window(tmp_path, tiny_model_factory, raw_shards, epochs):
    run_dir = tmp_path / "run"
    window = str(tmp_path / "window")
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        run_dir,
        window,
        train={"epochs": epochs, "checkpoint_every": 3},
        log={"samples": True, "progress": False},
    )
    watcher = WindowWatcher(window)
    watcher.start()
    producer = start("precompute", config, log=tmp_path / "precompute.log")
    trainer = start("train", config, log=tmp_path / "train.log")
    try:
        finish(producer, tmp_path / "precompute.log")
        finish(trainer, tmp_path / "train.log")
    finally:
        producer.kill(), trainer.kill()
        watcher.stop.set()
        watcher.join()

    report = json.loads((run_dir / "precompute_report.json").read_text())
    expected = raw_keys(raw_shards)
    assert report["rejected_total"] == 0 and report["committed"] == len(expected) * epochs

    seen = Counter()
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        entry = json.loads(line)
        seen.update((entry["epoch"], key) for key in entry["keys"])
    for epoch in range(epochs):
        assert {k for (e, k) in seen if e == epoch} == expected, f"epoch {epoch} missed or added samples"
    assert set(seen.values()) == {1}, "a sample was trained on more than once in an epoch"

    assert watcher.error is None and watcher.observations > 10
    assert watcher.max_unread <= 2, f"window held {watcher.max_unread} committed unread shards"
    assert watcher.max_uncommitted <= 1

    losses = [m["loss"] for m in read_metrics(run_dir / "metrics.jsonl") if "loss" in m]
    assert losses and all(math.isfinite(x) for x in losses)
    assert (run_dir / "lora" / "pytorch_lora_weights.safetensors").is_file()
    assert (run_dir / "loss.png").stat().st_size > 1000
