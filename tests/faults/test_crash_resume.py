"""SIGKILL the producer and the trainer at their worst moments, restart them, and lose nothing.

Real `vt-precompute run` and `vt-train run` processes share a 4-shard rolling window (2 epochs of the
real clips). Every kill is a real SIGKILL from a fault point (vt.shared.faults):

1. producer killed between writing a shard's data and creating its record; trainer killed right
   after its first checkpoint published the watermark, before it evicted anything;
2. restarted one after the other (locally the trainer first, on S3 the producer first): the
   trainer killed mid-epoch, before its next checkpoint; the producer, finding the window full,
   evicts below the watermark and is killed between deleting the records and deleting their data;
3. both restarted at once: the producer killed half-way through writing shard data;
4. the producer restarted while the trainer runs on; both run to the end. On S3 the server is
   killed and restarted (with its objects) meanwhile, and both must ride it out on retries.

A watcher reads every commit record it ever sees and checks its data. Afterwards every raw sample
was committed exactly once and trained on exactly once per epoch, no record ever named missing or
partial data, and nothing is left behind: no data, no record, no temp file, no multipart upload.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections import Counter
from pathlib import Path

import pytest

from vt.shared.shards import CommitRecord
from vt.shared.storage import RetryPolicy, Storage
from vt.shared.window import ShardCorruptError, inspect, open_reader

from helpers.cli_runs import raw_keys, start, write_config
from helpers.curation import EVERY_PROCESSOR, scene_keys
from helpers.polling import wait_for

pytestmark = pytest.mark.slow

EPOCHS = 2
PATIENT = {"VT_STORAGE_RETRIES": "40"}  # the processes must outlast the S3 restart (~2 min of retries)


class RecordWatcher(threading.Thread):
    """Reads every commit record that appears and checks its data, until stopped."""

    def __init__(self, uri: str):
        super().__init__(daemon=True)
        self.window = open_reader(uri, storage=Storage(uri, retry=RetryPolicy(attempts=200, max_seconds=0.5)))
        self.stop = threading.Event()
        self.records: dict[tuple[int, int], CommitRecord] = {}
        self.problems: list[str] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                self.poll()
                self.stop.wait(0.02)
            self.poll()
        except BaseException as err:  # reported by the test
            self.error = err

    def poll(self) -> None:
        for rel in self.window.storage.list("commits"):
            rank, seq = int(rel.split("/")[1][1:]), int(rel.rsplit("/", 1)[1][:8])
            if (rank, seq) in self.records:
                continue
            record = self.window.record(rank, seq)
            if record is None:
                continue  # evicted between the listing and the read
            try:
                self.window.read_shard(record)
            except ShardCorruptError as err:
                if self.window.record(rank, seq) is not None:  # still committed: its data must be whole
                    self.problems.append(str(err))
                    continue
            self.records[rank, seq] = record

    def catch_up(self, timeout: float = 300) -> set[tuple[int, int]]:
        """Wait until the watcher has read every record there is now (call it while no process runs,
        so none comes or goes meanwhile); returns them. A loaded machine slows the polls, so the records
        seen while processes run vary; these are seen on every run."""
        present = {
            (int(rel.split("/")[1][1:]), int(rel.rsplit("/", 1)[1][:8])) for rel in self.window.storage.list("commits")
        }
        wait_for(
            lambda: self.error is not None or present <= self.records.keys(),
            timeout=timeout,
            what=f"the watcher to read records {sorted(present)}",
        )
        return present


def trained_keys(run_dir: Path) -> Counter:
    """(epoch, key) -> times trained; a step re-run after a resume replaces the killed run's entry."""
    steps = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        entry = json.loads(line)
        steps[entry["step"]] = entry
    return Counter((e["epoch"], key) for e in steps.values() for key in e["keys"])


class Pipeline:
    """Starts and waits for the two CLIs of one run; logs go to tmp_path/<name>.log."""

    def __init__(self, tmp_path: Path, config: Path, window: str):
        self.tmp_path, self.config, self.window = tmp_path, config, window
        self.storage = Storage(window, retry=RetryPolicy(attempts=200, max_seconds=0.5))
        self.procs = []

    def start(self, stage: str, name: str, fault: str | None = None):
        env = {**PATIENT, **({"VT_FAULT_AT": fault} if fault else {})}
        proc = start(stage, self.config, log=self.tmp_path / f"{name}.log", env=env)
        proc.name = name
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp_path / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def started(self, proc, generation: int | None = None) -> None:
        """Wait until `proc` did something visible: a producer took its lease, a trainer resumed."""
        if generation is not None:
            what = f"leases/p0/{generation:08d}.json"
            wait_for(lambda: proc.poll() is not None or self.storage.exists(what), timeout=300, what=what)
        else:
            wait_for(
                lambda: proc.poll() is not None or "resumed from" in self.log(proc.name),
                timeout=300,
                what=f"{proc.name} to resume",
            )

    def expect(self, proc, code: int) -> None:
        got = proc.wait(timeout=400)
        assert got == code, f"{proc.name} exited with {got}, expected {code}:\n{self.log(proc.name)[-3000:]}"

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def crash_and_resume(tmp_path: Path, raw_shards: Path, model: Path, window: str, s3=None) -> None:
    run_dir = tmp_path / "run"
    config = write_config(
        tmp_path / "run.toml",
        model,
        raw_shards,
        run_dir,
        window,
        # a loaded CI machine (two xdist workers with their ranks) may keep a side waiting minutes
        window={"size": 4, "poll_seconds": 0.05, "timeout_seconds": 300.0},
        precompute={"workers": 0, "processors": EVERY_PROCESSOR},
        train={"epochs": EPOCHS, "checkpoint_every": 2, "batch_size": 2},
        log={"samples": True, "progress": False},
    )
    pipe = Pipeline(tmp_path, config, window)
    watcher = RecordWatcher(window)
    watcher.start()
    try:
        # Round 1: the producer dies between writing its third shard's data and creating its record;
        # the trainer right after its first checkpoint published the watermark, before evicting.
        p1 = pipe.start("precompute", "p1", "window.commit.after_data@3")
        t1 = pipe.start("train", "t1", "window.publish_watermark@1")
        pipe.expect(p1, -signal.SIGKILL)
        pipe.expect(t1, -signal.SIGKILL)
        checked = watcher.catch_up()
        state = inspect(window)
        assert state["producers"][0]["committed"] == 2 and state["watermark"] == 2
        assert [int(rel.rsplit("/", 1)[1][:8]) for rel in state["orphans"]] == [2]  # data, no record: invisible

        # Round 2, one after the other: the trainer dies mid-epoch, before its next checkpoint, inside its
        # second consumer.json write (a temp file left, which its next start cleans); the producer fills
        # the window, evicts below the watermark and dies between records and data.
        first, second = (
            ("train", "t2", "storage.put.mid_write:consumer.json@2"),
            ("precompute", "p2", "window.evict.mid@1"),
        )
        if s3 is not None:
            first, second = second, first
        a = pipe.start(*first)
        pipe.started(a, generation=2 if first[0] == "precompute" else None)
        b = pipe.start(*second)
        pipe.expect(a, -signal.SIGKILL)
        pipe.expect(b, -signal.SIGKILL)
        checked |= watcher.catch_up()
        state = inspect(window)
        assert state["producers"][0]["committed"] >= 6
        assert [int(rel.rsplit("/", 1)[1][:8]) for rel in state["orphans"]] == [0, 1]  # not dangling records
        if s3 is None:
            assert [rel for rel in state["leftovers"] if rel.startswith(".consumer.json.vt-tmp-")], state["leftovers"]

        # Round 3: both restarted at once; the producer dies half-way through writing shard data.
        p3, t3 = pipe.start("precompute", "p3", "storage.put.mid_write:data@1"), pipe.start("train", "t3")
        pipe.expect(p3, -signal.SIGKILL)
        if s3 is None:
            temp = [
                n
                for _, _, files in os.walk(window)
                for n in files
                if ".vt-tmp-" in n and not n.startswith(".consumer.json")
            ]  # t2's: t3 cleans it at its start
            assert len(temp) == 1, temp  # the half-written shard, invisible to readers

        # Round 4: the producer again, while the trainer runs on; on S3 the server is killed and
        # restarted (with its objects) meanwhile. Both run to the end.
        p4 = pipe.start("precompute", "p4")
        if s3 is not None:
            pipe.started(p4, generation=4)
            pipe.started(t3)
            s3.gate.down()
            wait_for(
                lambda: all("storage retry" in pipe.log(n) for n in ("p4", "t3")),
                timeout=300,
                what="both processes to meet the S3 outage",
            )
            s3.moto.crash_and_restart()
            s3.gate.open(s3.moto.port)
        pipe.expect(p4, 0)
        pipe.expect(t3, 0)
    finally:
        pipe.kill_all()
        watcher.stop.set()
        watcher.join(120)

    assert watcher.error is None, watcher.error
    assert not watcher.problems, watcher.problems
    expected = scene_keys(raw_keys(raw_shards))
    per_epoch = Counter()
    for record in watcher.records.values():
        per_epoch.update((record.epoch, key) for key in record.keys)
    assert set(per_epoch.values()) == {1}, "a sample was committed twice"
    assert len(checked) >= 6 and checked <= watcher.records.keys()  # read at the quiet points between rounds

    trained = trained_keys(run_dir)
    for epoch in range(EPOCHS):
        assert {k for e, k in trained if e == epoch} == expected, f"epoch {epoch} lost samples"
    assert set(trained.values()) == {1}, "a sample was trained on twice in one epoch"
    report = json.loads((run_dir / "precompute_report.json").read_text())
    assert report["status"] == "done" and report["generation"] == 4 and report["resumed_at"] >= 6

    storage = Storage(window)
    assert storage.list("commits") == [] and storage.list("data") == []  # all trained, evicted, no orphans
    if s3 is None:
        assert not [n for _, _, files in os.walk(window) for n in files if ".vt-tmp-" in n]
    else:
        assert s3.gate.refused > 0
        import boto3

        uploads = boto3.client("s3", endpoint_url=s3.gate.url).list_multipart_uploads(Bucket=s3.bucket)
        assert not uploads.get("Uploads")


def test_crash_and_resume_local(tmp_path, raw_shards, tiny_model_factory):
    crash_and_resume(tmp_path, raw_shards, tiny_model_factory("ltx-video"), str(tmp_path / "window"))


def test_crash_and_resume_s3_with_server_restart(tmp_path, raw_shards, tiny_model_factory, gated_s3):
    crash_and_resume(tmp_path, raw_shards, tiny_model_factory("ltx-video"), gated_s3.uri + "/window", s3=gated_s3)
