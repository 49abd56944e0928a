"""Producers come and go while the trainer reads: the losses are those of an undisturbed run.

Three lanes over the real clips' raw shards, a rolling window of 6 shards (2 per lane), 2 epochs, the
trainer reading from the start. Two producers start; a third is added once the first shard is in; the
first is SIGKILLed after its second commit and never restarted (its lane is taken over: its process is
gone). Every sample is trained once per epoch and the trainer's loss at every step equals, within 1e-6,
that of a run fed by one producer working all three lanes undisturbed: which producer made a shard never
shows in the order.
"""

from __future__ import annotations

import json
import signal
from collections import Counter

import pytest
from typer.testing import CliRunner

from vt.precompute.cli import app
from vt.precompute.sources import list_raw_shards
from vt.shared.storage import Storage
from vt.train.trackers import read_metrics

from helpers.cli_runs import finish, raw_keys, start, write_config
from helpers.curation import EVERY_PROCESSOR, scene_keys
from helpers.polling import wait_for

pytestmark = pytest.mark.slow

EPOCHS = 2


def losses(run_dir) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_metrics(run_dir / "metrics.jsonl")}


def trained(run_dir) -> Counter:
    entries = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return Counter((e["epoch"], key) for e in entries for key in e["keys"])


def test_producers_added_and_killed_mid_run_train_as_one_undisturbed(tmp_path, tiny_model_factory, raw_shards):
    model = tiny_model_factory("ltx-video")

    def config(name: str):
        return write_config(
            tmp_path / f"{name}.toml",
            model,
            raw_shards,
            tmp_path / name,
            str(tmp_path / name / "window"),
            window={"size": 6, "poll_seconds": 0.05, "timeout_seconds": 300.0},
            precompute={"workers": 0, "lanes": 3, "processors": EVERY_PROCESSOR},
            train={"epochs": EPOCHS, "batch_size": 2, "checkpoint_every": 3},
            log={"samples": True, "progress": False},
        )

    reference = config("reference")
    producer, trainer = (
        start("precompute", reference, log=tmp_path / "ref-p.log"),
        start("train", reference, log=tmp_path / "ref-t.log"),
    )
    finish(producer, tmp_path / "ref-p.log")
    finish(trainer, tmp_path / "ref-t.log")

    elastic = config("elastic")
    window = Storage(str(tmp_path / "elastic" / "window"))
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "c", "t")}
    trainer = start("train", elastic, log=logs["t"])
    first = start("precompute", elastic, log=logs["a"], env={"VT_FAULT_AT": "window.commit.after_record@2"})
    second = start("precompute", elastic, log=logs["b"])
    wait_for(lambda: window.list("commits"), timeout=300, what="the first commit")
    third = start("precompute", elastic, log=logs["c"])
    try:
        assert first.wait(timeout=300) == -signal.SIGKILL, logs["a"].read_text()[-3000:]
        for proc, name in ((second, "b"), (third, "c"), (trainer, "t")):
            finish(proc, logs[name])
    finally:
        for proc in (first, second, third, trainer):
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    expected = scene_keys(raw_keys(raw_shards))
    counts = trained(tmp_path / "elastic")
    assert set(counts) == {(epoch, key) for epoch in range(EPOCHS) for key in expected}
    assert set(counts.values()) == {1}
    want, got = losses(tmp_path / "reference"), losses(tmp_path / "elastic")
    assert got.keys() == want.keys() and len(want) >= 8
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), f"loss at step {step}"
    taken_over = [line for name in ("b", "c") for line in logs[name].read_text().splitlines() if "took lane" in line]
    assert taken_over, "the killed producer's lane was not taken over"

    status = CliRunner().invoke(app, ["status", str(tmp_path / "elastic" / "window"), "--json"])
    assert status.exit_code == 0, status.output
    found = json.loads(status.output)
    assert found["lanes"] == 3 and {lane["state"] for lane in found["by_lane"].values()} == {"done"}
    assert found["complete"] == found["raw_shards"] == len(list_raw_shards(str(raw_shards)))
    assert len(found["producers"]) == 3, found["producers"]  # the killed one's record stays, as it last wrote it
