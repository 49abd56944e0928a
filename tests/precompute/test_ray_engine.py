"""`precompute.engine = "ray"`: the decode chain on a real Ray cluster (`ray start --head` in a session of its own,
started and torn down by this module), reached through RAY_ADDRESS as on a real cluster, with a decode actor's
process killed mid-run: the producers exit 0, the killed actor is replaced, every sample is committed exactly once."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
from collections import Counter

import pytest
from ray_head import RAY_ENV, session_processes, start_head, stop_head

from vt.shared.window import open_reader

from helpers.cli_runs import raw_keys, write_config
from helpers.forkserver import launch
from helpers.polling import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="needs ray (pip install 'vt[ray]')"),
]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """RAY_ADDRESS of a 2-CPU head started here (scripts/ray_head.py: its own session) and its session id."""
    head, address = start_head(tmp_path_factory.mktemp("ray") / "head.log")
    try:
        yield address, head.pid
    finally:
        stop_head(head)


def decode_actors(sid: int) -> list[int]:
    return [p.pid for p in session_processes(sid) if any("DecodeActor" in part for part in (p.info["cmdline"] or []))]


def test_a_killed_decode_actor_costs_a_retry_never_a_sample(tmp_path, tiny_model_factory, raw_shards, ray_cluster):
    """Two producers (processes) on one Ray cluster share the window's two lanes, each with a decode actor; one
    actor's process is killed mid-run: both exit 0, the actor is replaced, every sample is committed once."""
    address, sid = ray_cluster
    window = tmp_path / "window"
    config = write_config(
        tmp_path / "ray.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run",
        str(window),
        window={"size": "keep"},
        precompute={"engine": "ray", "ray_actors": 1, "samples_per_shard": 1, "encode_batch": 1, "lanes": 2},
    )
    # The producers fork from the warm interpreter (no import bill; it never imports ray, so each producer's own
    # import reads RAY_ENV): the test is about a decode actor's death, and the actors stay Ray's fresh workers.
    env = {**RAY_ENV, "RAY_ADDRESS": address}
    logs = [tmp_path / f"producer{i}.log" for i in range(2)]
    producers = [launch("vt-precompute", "run", str(config), env=env, log=log) for log in logs]
    try:
        actors = wait_for(
            lambda: len(decode_actors(sid)) == 2 and decode_actors(sid),
            timeout=180,
            what="a decode actor per producer on the cluster",
        )
        wait_for(lambda: any((window / "commits").rglob("*.json")), timeout=180, what="a first committed shard")
        os.kill(actors[0], signal.SIGKILL)  # mid-run: its producer has samples left to decode
        for producer, log in zip(producers, logs):
            assert producer.wait(timeout=600) == 0, log.read_text()[-4000:]
    finally:
        for producer in producers:
            if producer.poll() is None:
                producer.kill()
                producer.wait()
    reports = [json.loads(path.read_text()) for path in (tmp_path / "run").glob("precompute_report.*.json")]
    assert len(reports) == 2 and {r["status"] for r in reports} <= {"done", "already done"}, reports
    assert sum(r["decode_restarts"] for r in reports) >= 1 and sum(r["rejected_total"] for r in reports) == 0
    assert sorted(lane for r in reports for lane in r["lanes"]) == [0, 1]
    assert any("decode actors replaced: " in log.read_text() for log in logs)
    keys = Counter(key for _, record in open_reader(str(window)).order() for key in record.keys)
    assert set(keys) == raw_keys(raw_shards) and set(keys.values()) == {1}  # every sample, exactly once


def test_a_producer_whose_driver_cannot_reach_the_head_stops_at_once_saying_why(ray_cluster):
    """A producer that imported ray without RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 dials the node's own address, where
    this loopback-only head does not listen: it stops at once, saying which setting differs (before: `ray.init`
    retried for many minutes; CI's pytest worker, which had imported ray by the way, failed two tests after that)."""
    from ray._common.network_utils import node_ip_address_from_perspective

    if node_ip_address_from_perspective() in ("127.0.0.1", "::1"):
        pytest.skip("this machine's only address is loopback: a driver dials the head's own")
    env = {name: value for name, value in os.environ.items() if name != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    script = "from vt.precompute.ray_pool import RayDecodePool; RayDecodePool(1)"
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "RAY_ADDRESS": ray_cluster[0]},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0, done.stderr[-3000:]
    assert "listens on loopback only" in done.stderr and "set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0" in done.stderr


def test_a_hung_clip_runs_again_on_a_fresh_actor_and_a_killer_clip_is_rejected(ray_cluster, tmp_path, monkeypatch):
    """The pool's own contract, order kept: a clip whose actor passes the deadline runs again on a fresh actor; a
    clip that kills every actor it runs on is rejected (`on_crash`) after `tries` actors; the rest are unharmed."""
    from vt.precompute.ray_pool import RayDecodePool

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster[0])
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    marker = str(tmp_path / "hung-once")

    def decode(item):  # local, so Ray sends it by value to actors that cannot import this module
        import os
        import signal
        import threading

        if item == 2 and not os.path.exists(marker):
            open(marker, "w").close()
            threading.Event().wait()  # a clip that hangs its actor for good: the pool's deadline ends it
        if item == 4:
            os.kill(os.getpid(), signal.SIGKILL)  # a clip that kills every actor it runs on
        return item * 10

    pool = RayDecodePool(2, tries=2, timeout_seconds=5)
    try:
        out = list(pool.map(decode, range(7), inflight=3, on_crash=lambda item: ("rejected", item)))
    finally:
        pool.close()
    assert out == [0, 10, 20, 30, ("rejected", 4), 50, 60]
    assert pool.crashes == 1 and pool.restarts >= 2  # the hung actor, then the one clip 4 killed (at least)


def test_a_clips_deadline_counts_its_own_run_not_its_actors_start(ray_cluster, tmp_path, monkeypatch):
    """On a loaded machine an actor takes longer to start (its process imports torch and PyAV) than a clip may run:
    the deadline is the clip's own, so every clip decodes on the actors it was given, none replaced or rejected.
    Here every actor's start waits, on a named pipe, until the driver has waited for a start (this code) or replaced
    an actor whose first clip passed its deadline (before: the first clip of each actor was timed from its
    submission, start-up included, and every clip was rejected)."""
    from vt.precompute.ray_pool import RayDecodePool

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster[0])
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    gate = str(tmp_path / "start-gate")
    os.mkfifo(gate)

    def slow_start():  # an actor's start held until the test opens the gate (the pipe has a writer)
        open(gate, "rb").close()

    pool = RayDecodePool(2, initializer=slow_start, tries=2, timeout_seconds=0.5)
    out: list = []
    decoding = threading.Thread(
        target=lambda: out.extend(pool.map(lambda item: item * 10, range(4), inflight=2, on_crash=lambda i: ("x", i)))
    )
    decoding.start()
    try:
        wait_for(
            lambda: getattr(pool, "awaiting_start", None) is not None or pool.restarts > 0,
            what="the driver to wait on a start",
        )
        opened = os.open(gate, os.O_RDWR | os.O_NONBLOCK)  # every start waiting now or later goes on
        decoding.join(120)
        os.close(opened)
    finally:
        pool.close()
    assert not decoding.is_alive() and out == [0, 10, 20, 30] and pool.restarts == 0 and pool.crashes == 0


def test_an_actor_that_dies_while_starting_is_replaced_and_one_that_always_does_stops_saying_why(
    ray_cluster, tmp_path, monkeypatch
):
    """A decode actor whose process is killed before it has started (the producer still in `warm_up`; in one full
    run the killed-actor test above killed the other producer's actor there) is replaced like one killed mid-clip:
    the clips decode on its successor. One that dies at every start stops the producer after `tries`, saying why
    (before: Ray's ActorDiedError out of `warm_up`, the producer exiting 1 at the first death)."""
    from vt.precompute.ray_pool import RayDecodePool
    from vt.shared.errors import UserError

    monkeypatch.setenv("RAY_ADDRESS", ray_cluster[0])
    for name, value in RAY_ENV.items():
        monkeypatch.setenv(name, value)
    marker = str(tmp_path / "died-once")

    def dies_once():  # the first actor's process is killed while it starts; its successor starts
        import os
        import signal

        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

    pool = RayDecodePool(1, initializer=dies_once, tries=2, timeout_seconds=60)
    try:
        pool.warm_up()
        out = list(pool.map(lambda item: item * 10, range(3), inflight=2, on_crash=lambda item: ("rejected", item)))
    finally:
        pool.close()
    assert out == [0, 10, 20] and pool.restarts == 1 and pool.crashes == 0

    def always_dies():
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)

    pool = RayDecodePool(1, initializer=always_dies, tries=2, timeout_seconds=60)
    try:
        with pytest.raises(UserError, match="died while starting, 2 times in a row"):
            pool.warm_up()
    finally:
        pool.close()
    assert pool.restarts == 1
