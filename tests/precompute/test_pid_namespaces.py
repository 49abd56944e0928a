"""Producers in containers on one host: the hostname is shared, the pids are not.

Two `vt-precompute run` processes, each in a pid namespace of its own (`unshare --pid --fork --mount-proc`, as
containers with host networking run), share one local window of two lanes. Neither may judge the other "gone"
from a pid that means another process in its own namespace: the lane of a live holder is never taken over.

The test holds lane 1 itself until A (first lane 1, by its Slurm task index) has taken lane 0 and filled its
share of the window; A is then paused (SIGSTOP: a live holder that does nothing) while B (first lane 0) starts,
looks at A's lane first and must take the lane the test let go. Then A goes on, the window opens (the test stands
in for the trainer) and both finish: every sample committed exactly once, each lane by the one holder it was
handed to. A producer without a launcher index is named with its pid namespace there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from vt.precompute.sources import list_raw_shards
from vt.shared import lease
from vt.shared.claims import HOST
from vt.shared.shards import CommitRecord
from vt.shared.storage import Storage
from vt.shared.window import ledger

from helpers.cli_runs import raw_keys, run_bounded, write_config
from helpers.forkserver import BASE_ENV
from helpers.polling import wait_for

pytestmark = pytest.mark.slow

UNSHARE = ["unshare", "--pid", "--fork", "--mount-proc"]


def namespaces_work() -> bool:
    if shutil.which("unshare") is None:
        return False
    return subprocess.run([*UNSHARE, "true"], capture_output=True, timeout=30).returncode == 0


def start_in_namespace(config: Path, log: Path, task: int, pid: int = 1) -> subprocess.Popen:
    """`vt-precompute run CONFIG` in a pid namespace of its own, as pid `pid` there (1, or one its shell sets with
    ns_last_pid): a pid that names no process nor thread of the other producer's namespace."""
    command = [str(Path(sys.executable).with_name("vt-precompute")), "run", str(config)]
    if pid != 1:
        command = ["sh", "-c", f'echo {pid - 1} > /proc/sys/kernel/ns_last_pid; "$@"; exit $?', "sh", *command]
    env = {**os.environ, **BASE_ENV, "SLURM_ARRAY_TASK_ID": str(task)}
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*UNSHARE, *command], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def held_by(storage: Storage, producer: str) -> list[str]:
    """The leases naming `producer`."""
    return [
        rel
        for rel in storage.list("leases")
        if rel.endswith(".json") and json.loads(storage.read(rel))["producer"] == producer
    ]


def generations(storage: Storage, lane: int) -> list[int]:
    return sorted(lease.generation_of(rel) for rel in storage.list(f"leases/p{lane}") if rel.endswith(".json"))


@pytest.mark.skipif(not namespaces_work(), reason="unshare --pid needs root (or user namespaces) here")
def test_producers_in_separate_pid_namespaces_never_take_each_others_lanes(tmp_path, tiny_model_factory, raw_shards):
    uri = str(tmp_path / "window")
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run",
        uri,
        window={"size": 2, "poll_seconds": 0.05, "timeout_seconds": 600.0},
        precompute={"workers": 0, "lanes": 2, "claim_seconds": 600.0},
    )
    storage = Storage(uri)
    assert ledger.fix_lanes(storage, 2, len(list_raw_shards(str(raw_shards)))) == 2
    # The test holds lane 1 for B. Its record names its host and pid, no pid namespace: never judged gone by pid.
    assert lease.claim(storage, 1, None, {"producer": "test", "host": HOST, "pid": os.getpid()}) == 1
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b")}
    procs = {"a": start_in_namespace(config, logs["a"], task=1, pid=5000)}
    try:
        wait_for(lambda: storage.list("commits/p0"), timeout=300, what="A's first commit on lane 0")
        os.killpg(procs["a"].pid, signal.SIGSTOP)  # A holds lane 0, alive, silent
        assert generations(storage, 1) == [1], "lane 1 was taken from the test, a live holder in another namespace"
        lease.release(storage, 1, 1)
        procs["b"] = start_in_namespace(config, logs["b"], task=0)
        wait_for(lambda: held_by(storage, "task0"), timeout=300, what="B to take a lane")  # after judging lane 0
        assert generations(storage, 0) == [1], "B took lane 0 from A, alive in another namespace"
        os.killpg(procs["a"].pid, signal.SIGCONT)
        ledger.write_consumer(
            storage, {"read": {0: 10**6, 1: 10**6}, "watermark": {}, "read_position": 0, "watermark_position": 0}
        )  # the trainer read everything: room for all
        for name, proc in procs.items():
            assert proc.wait(timeout=300) == 0, logs[name].read_text()[-3000:]
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)

    assert generations(storage, 0) == [1] and generations(storage, 1) == [1, 2]  # never taken over
    holders = [lease.read_lease(storage, 0, 1), lease.read_lease(storage, 1, 2)]
    assert [(h["producer"], h["host"], h["pid"]) for h in holders] == [("task1", HOST, 5000), ("task0", HOST, 1)]
    assert holders[0]["pid_ns"] != holders[1]["pid_ns"]  # one hostname, a pid namespace each
    records = [CommitRecord.from_json(storage.read(rel)) for rel in storage.list("commits")]
    committed = Counter(key for record in records for key in record.keys)
    assert set(committed) == raw_keys(raw_shards) and set(committed.values()) == {1}
    assert {(record.producer, record.data.split("-")[1]) for record in records} == {(0, "g1"), (1, "g2")}
    reports = {
        name: json.loads((tmp_path / "run" / f"precompute_report.task{task}.json").read_text())
        for name, task in (("a", 1), ("b", 0))
    }
    assert reports["a"]["lanes"] == [0] and reports["b"]["lanes"] == [1]
    assert {r["status"] for r in reports.values()} == {"done"}


@pytest.mark.skipif(not namespaces_work(), reason="unshare --pid needs root (or user namespaces) here")
def test_a_producer_in_a_pid_namespace_of_its_own_is_named_with_it():
    """Containers sharing a hostname may each run their producer as pid 1: its name (workers/<name>.json, its
    report) carries its pid namespace, so two never write one record."""
    code = "from vt.precompute.lanes import producer_name; print(producer_name())"
    done = run_bounded([*UNSHARE, sys.executable, "-c", code], timeout=120, env={**os.environ, **BASE_ENV})
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(rf"{re.escape(HOST)}-1-ns\d+", done.stdout.strip()), done.stdout
