"""The precompute service on the real clips and the tiny LTX model: resume after eviction, one writer
per rank, idempotent commits, the report, the progress bar and `vt-precompute inspect`.

A crash is simulated in-process by a Window that raises at a chosen commit (before its data is
written, or right after its record is created); the trainer's part (read, checkpoint, evict) is done
by hand between runs, so every record a restarted producer could have learned from is gone.
Crashes of real processes by SIGKILL are in tests/faults/.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vt.precompute.cli import app
from vt.precompute.service import Precompute
from vt.shared import lease
from vt.shared.config import load_config
from vt.shared.shards import encode_shard
from vt.shared.storage import Storage
from vt.shared.window import ProducerConflict, WindowTimeout, Writer, inspect, open_reader, open_writer

from helpers.cli_runs import raw_keys, write_config
from helpers.curation import EVERY_PROCESSOR, scene_keys
from helpers.polling import wait_for


class Crash(Exception):
    """Stands in for a process dying at a commit."""


class CrashingWindow(Writer):
    """A real window writer that dies at its `at`-th publish, before writing the data or after the record."""

    def __init__(self, *args, at: int, when: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.at, self.when, self.publishes = at, when, 0

    def publish(self, record, data):
        self.publishes += 1
        if self.publishes == self.at and self.when == "before_data":
            raise Crash(f"before the data of shard {record.seq}")
        out = super().publish(record, data)
        if self.publishes == self.at and self.when == "after_record":
            raise Crash(f"after the record of shard {record.seq}")
        return out


@pytest.fixture(scope="module")
def raw_with_bad(raw_shards, media, tmp_path_factory) -> Path:
    """The real raw tars plus one tar of two bad samples (no caption, empty caption), sorted first."""
    folder = tmp_path_factory.mktemp("raw-with-bad")
    for tar in sorted(raw_shards.glob("*.tar"))[:2]:  # 8 real samples: enough shards, half the time
        shutil.copy(tar, folder / tar.name)
    clip = media.encode_clip(media.gray_frames(24))
    media.write_tar(folder / "bad-000000.tar", [("nocap.mp4", clip), ("blank.mp4", clip), ("blank.txt", b"  ")])
    return folder


def config_for(tmp_path: Path, model: Path, raw: Path, uri: str, **sections):
    sections = {"precompute": {"workers": 0, "processors": EVERY_PROCESSOR}, "log": {"progress": False}, **sections}
    return load_config(write_config(tmp_path / "run.toml", model, raw, tmp_path / "run", uri, **sections))


def consume_everything(uri: str, harvested: Counter, seen: set) -> None:
    """The trainer's part: read every committed shard, checkpoint past it, evict it (records gone)."""
    window = open_reader(uri, size=64)
    end = window.next_seq(0)
    for seq in range(end):
        record = window.record(0, seq)
        if record is not None and seq not in seen:
            seen.add(seq)
            harvested.update((record.epoch, key) for key in record.keys)
    if end:
        window.publish_read(end)
        window.publish_watermark(end)
        window.evict_read()


def test_restart_after_eviction_commits_every_sample_once(tmp_path, tiny_model_factory, raw_with_bad):
    uri = str(tmp_path / "window")
    config = config_for(
        tmp_path, tiny_model_factory("ltx-video"), raw_with_bad, uri, window={"size": 64}, train={"epochs": 2}
    )
    harvested, seen = Counter(), set()
    reports = []
    for at, when in ((3, "after_record"), (4, "before_data"), (None, None)):
        producer = Precompute(config)
        if at is not None:
            producer.window = CrashingWindow(Storage(uri), 64, 0.01, 30.0, at=at, when=when)
            with pytest.raises(Crash):
                producer.run()
        else:
            producer.run()
        reports.append(json.loads((tmp_path / "run" / "precompute_report.json").read_text()))
        consume_everything(uri, harvested, seen)
        assert open_reader(uri).storage.list("commits") == []  # nothing left to learn from: all evicted

    expected = scene_keys(raw_keys(raw_with_bad) - {"bad-000000/nocap", "bad-000000/blank"})
    assert harvested == Counter({(epoch, key): 1 for epoch in (0, 1) for key in expected})
    assert [r["status"].split(":")[0] for r in reports] == ["failed", "failed", "done"]
    assert [r["resumed_at"] for r in reports] == [0, 3, 3 + 3]  # the crash before data lost shard 6 only
    assert reports[1]["skipped_shards"] == reports[2]["skipped_shards"] == 2  # raw tars not read again
    state = inspect(uri)
    assert state["producers"][0]["done"] and state["orphans"] == [] and state["evicted"] == len(seen)


def test_a_lane_restarted_again_and_again_while_its_window_is_full_resumes_every_time(
    tmp_path, tiny_model_factory, raw_with_bad
):
    """Each start while no trainer reads takes the lane as a new generation, finds its share of the window full and
    stops at window.timeout_seconds, committing nothing, so it writes no progress record. Restarted like that three
    times (a Slurm array resubmitted while the trainer is down), the lane still resumes where its last commit left
    it; then the trainer's part runs between starts and every sample is committed once."""
    uri = str(tmp_path / "window")
    config = config_for(
        tmp_path,
        tiny_model_factory("ltx-video"),
        raw_with_bad,
        uri,
        window={"size": 2, "poll_seconds": 0.01, "timeout_seconds": 0.3},
    )
    report_path = tmp_path / "run" / "precompute_report.json"
    resumed = []
    for _ in range(4):  # the 4th start's generation is 3 past the last one that wrote a progress record
        with pytest.raises(WindowTimeout):
            Precompute(config).run()
        resumed.append(json.loads(report_path.read_text())["resumed_at"])
    assert resumed == [0, 2, 2, 2]
    assert lease.newest_generation(Storage(uri), 0) == 4

    harvested, seen = Counter(), set()
    for _ in range(20):
        consume_everything(uri, harvested, seen)
        try:
            Precompute(config).run()
            break
        except WindowTimeout:
            continue
    consume_everything(uri, harvested, seen)
    expected = scene_keys(raw_keys(raw_with_bad) - {"bad-000000/nocap", "bad-000000/blank"})
    assert harvested == Counter({(0, key): 1 for key in expected})
    assert json.loads(report_path.read_text())["status"] == "done"


def test_a_trainer_that_waits_in_vain_on_a_lane_names_its_producers_and_why_they_stopped(
    tmp_path, tiny_model_factory, raw_shards
):
    """The reader's window timeout on a shard tells what the window's producer records say of that lane: here its
    one producer stopped at its third commit, and the trainer's error says so rather than only asking whether
    vt-precompute runs."""
    uri = str(tmp_path / "window")
    config = config_for(tmp_path, tiny_model_factory("ltx-video"), raw_shards, uri, window={"size": "keep"})
    producer = Precompute(config)
    producer.window = CrashingWindow(Storage(uri), "keep", 0.01, 30.0, at=3, when="before_data")
    with pytest.raises(Crash):
        producer.run()
    impatient = open_reader(uri, poll_seconds=0.01, timeout_seconds=0.2)
    order = impatient.order()
    assert [next(order)[1].seq for _ in range(2)] == [0, 1]
    with pytest.raises(WindowTimeout) as waited:
        next(order)
    told = str(waited.value)
    assert "producer 0 shard 2" in told, told
    assert f"{producer.name} failed: Crash: before the data of shard 2" in told, told


def test_a_silent_holders_lane_is_taken_over_and_the_old_holder_is_fenced(tmp_path, tiny_model_factory, raw_shards):
    """A producer whose heartbeat stopped mid-commit loses its lane to a second one after claim_seconds of
    silence; the second resumes after the last commit, the first is fenced at its commit and drops the lane."""
    uri = str(tmp_path / "window")
    config = config_for(
        tmp_path,
        tiny_model_factory("ltx-video"),
        raw_shards,
        uri,
        window={"size": "keep"},
        precompute={"workers": 0, "claim_seconds": 0.4, "processors": EVERY_PROCESSOR},
    )
    reached, release = threading.Event(), threading.Event()

    class PausingWindow(Writer):
        def publish(self, record, data):
            if record.seq == 1 and not release.is_set():
                reached.set()
                release.wait(60)
            return super().publish(record, data)

    first = Precompute(config)
    first.window = PausingWindow(Storage(uri), "keep", 0.01, 30.0)
    errors = []
    thread = threading.Thread(target=lambda: _run_catching(first, errors))
    thread.start()
    wait_for(reached.is_set, what="the first producer to reach its second commit")
    first.holder._stop.set()  # its heartbeat stops: the lane's lease falls silent
    second = Precompute(config).run()  # takes the lane once it was silent for claim_seconds
    release.set()
    thread.join(60)

    assert errors == [] and first.report.status == "done" and first.report.shards == 1
    keys = Counter(key for _, record in open_reader(uri).order() for key in record.keys)
    assert set(keys) == scene_keys(raw_keys(raw_shards)) and set(keys.values()) == {1}
    assert second.generation == 2 and second.resumed_at == 1
    assert inspect(uri)["orphans"] == []  # the fenced writer removed its own bytes


def _run_catching(producer, errors):
    try:
        producer.run()
    except Exception as err:
        errors.append(err)


def test_a_rerun_commit_with_the_same_samples_counts_as_done(tmp_path):
    uri = str(tmp_path / "window")
    import torch

    def data(value: float) -> bytes:
        return encode_shard({"latents": torch.full((2, 4), value)}, ["a", "b"], {"bucket": "9x64x64"})

    first, rerun, other = open_writer(uri), open_writer(uri), open_writer(uri)
    first.register_producer(0, 1)
    same = rerun.prepare(0, 0, 0, data(1.0), "9x64x64", ["a", "b"], "fp")  # all three start at seq 0
    different = other.prepare(0, 0, 0, data(2.0), "9x64x64", ["c", "d"], "fp")
    committed = first.commit(0, 0, 0, data(1.0), "9x64x64", ["a", "b"], "fp")
    assert rerun.publish(same, data(1.0)) == committed  # same samples (not the same bytes): done
    with pytest.raises(ProducerConflict, match="already exists .* with other content"):
        other.publish(different, data(2.0))
    assert open_reader(uri).storage.list("data") == [committed.data]  # the losers' bytes are gone


def test_report_progress_bar_and_inspect(tmp_path, tiny_model_factory, raw_with_bad, capsys):
    uri = str(tmp_path / "window")
    config = config_for(
        tmp_path, tiny_model_factory("ltx-video"), raw_with_bad, uri, window={"size": "keep"}, log={"progress": True}
    )
    Precompute(config).run()
    bar = capsys.readouterr().err
    report = json.loads((tmp_path / "run" / "precompute_report.json").read_text())
    assert f"precompute[{report['producer']}]" in bar and "clip/s" in bar and "MB=" in bar and "window=keep" in bar

    expected = scene_keys(raw_keys(raw_with_bad) - {"bad-000000/nocap", "bad-000000/blank"})
    assert report["seen"] == len(expected) + 2 and report["committed"] == len(expected)
    assert report["rejected"] == {"empty_caption": 1, "missing_caption": 1}
    assert set(report["seconds"]) == {"read", "decode", "text_encode", "vae_encode", "write", "wait"}
    assert report["seconds"]["vae_encode"] > 0 and report["seconds"]["decode"] > 0
    assert report["bytes"] == inspect(uri)["bytes"] > 0

    result = CliRunner().invoke(app, ["inspect", uri])
    assert result.exit_code == 0, result.output
    state = inspect(uri)
    assert f"committed {state['committed']} shards" in result.output
    assert "size=keep " in result.output and state["size"] == "keep"  # as the producer registered it
    for bucket, counts in state["buckets"].items():
        assert f"{bucket:<11} {counts['shards']:>6}  {counts['samples']:>7}" in result.output
    assert sum(c["samples"] for c in state["buckets"].values()) == len(expected)
    assert state["fingerprints"] == [state["producers"][0]["fingerprint"]]
    assert state["fingerprints"][0] in result.output
    as_json = json.loads(CliRunner().invoke(app, ["inspect", uri, "--json"]).output)
    assert as_json["committed"] == state["committed"] and as_json["buckets"] == state["buckets"]

    status = CliRunner().invoke(app, ["status", uri])
    assert status.exit_code == 0, status.output
    assert (
        "1 lanes over 3 raw shards" in status.output
        and "raw shards: 3 complete, 0 being worked, 0 waiting" in status.output
    )
    assert f"{report['producer']:<27} 0         done" in status.output
    assert "rejected: empty_caption 1, missing_caption 1" in status.output

    missing = CliRunner().invoke(app, ["inspect", str(tmp_path / "nothing-here")])
    assert missing.exit_code == 1 and "holds no window" in missing.output
