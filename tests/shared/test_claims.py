"""Claims on a window's lanes (shared/claims.py, shared/lease.py), on local disk and a real S3 server: a lane is
free when never held, released, its holder's process gone (judged only in the taker's own host, boot and pid
namespace), or its beat silent for claim_seconds on the taker's clock; of two takers one wins; the loser of a
takeover is fenced."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vt.shared import lease
from vt.shared.claims import HOST, Liveness, free, look, process_gone
from vt.shared.identity import identity
from vt.shared.storage import Storage

from helpers.polling import wait_for


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(params=["local", "s3"])
def storage(request, tmp_path):
    if request.param == "local":
        return Storage(str(tmp_path / "window"))
    return Storage(request.getfixturevalue("s3_bucket") + "/window")


def alive() -> dict:
    return {"producer": "me", **identity()}


def judge(storage, lane: int, liveness: Liveness) -> bool:
    return free(storage, lane, look(storage, 2)[lane], liveness)


def test_a_lane_is_free_until_claimed_and_of_two_takers_one_wins(storage):
    liveness = Liveness(60.0, Clock())
    assert judge(storage, 0, liveness)
    assert lease.claim(storage, 0, None, alive()) == 1
    assert lease.claim(storage, 0, None, alive()) is None  # saw the same newest generation: refused
    assert not judge(storage, 0, liveness) and look(storage, 2)[0].generation == 1
    assert judge(storage, 1, liveness)  # lanes are independent


def test_released_gone_and_done(storage):
    liveness = Liveness(60.0, Clock())
    generation = lease.claim(storage, 0, None, alive())
    lease.release(storage, 0, generation)
    assert judge(storage, 0, liveness)

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    assert lease.claim(storage, 0, 1, {"producer": "gone", **identity(), "pid": dead.pid}) == 2
    assert judge(storage, 0, liveness)  # its process is gone from this host and pid namespace: at once
    counted = CountingStorage(storage.uri)
    assert lease.claim(storage, 0, 2, {"producer": "far", "host": "another-host", "pid": dead.pid}) == 3
    assert not judge(counted, 0, liveness) and counted.reads == 0  # another host's: silence only, no read
    assert look(storage, 2)[0].host == "another-host"
    storage.put_atomic("done/p0", b"")
    lease.release(storage, 0, 3)
    assert not judge(storage, 0, liveness) and look(storage, 2)[0].done  # done: never taken again


class CountingStorage(Storage):
    def __init__(self, uri):
        super().__init__(uri)
        self.reads = 0

    def read(self, rel):
        self.reads += 1
        return super().read(rel)


def test_a_silent_holder_is_taken_over_after_claim_seconds_on_the_takers_clock(storage):
    clock = Clock()
    liveness = Liveness(60.0, clock)
    generation = lease.claim(storage, 0, None, {"producer": "far", "host": "another-host", "pid": 1})
    record = lease.read_lease(storage, 0, generation)
    counted = CountingStorage(storage.uri)
    assert not judge(counted, 0, liveness)  # first seen now
    clock.now += 14
    assert not judge(counted, 0, liveness)
    clock.now += 45
    assert not judge(counted, 0, liveness)
    lease.renew(storage, 0, generation, record)  # a beat: the watch starts again
    assert not judge(counted, 0, liveness) and counted.reads == 0  # a holder on another host: listings only
    clock.now += 59
    assert not judge(counted, 0, liveness)
    clock.now += 2
    assert judge(counted, 0, liveness)  # 61 s without a beat

    assert lease.claim(storage, 0, 1, alive()) == 2
    with pytest.raises(lease.ProducerFenced, match="lane 0 of .* was taken over by generation 2"):
        lease.check(storage, 0, generation)  # the silent holder, back, finds it at its next commit


def test_a_holder_in_another_pid_namespace_of_this_host_is_not_judged_gone_by_its_pid(storage):
    """Containers with host networking share the hostname, not the pids: a pid gone here may run in the holder's
    namespace. Only a holder of this host, boot and pid namespace is judged by its pid; any other by silence."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=60)
    with open("/proc/sys/kernel/random/boot_id") as boot:
        here = {
            "host": HOST,
            "boot_id": boot.read().strip(),
            "pid_ns": os.readlink("/proc/self/ns/pid"),
            "pid": dead.pid,
        }
    elsewhere = {**here, "pid_ns": "pid:[4026500001]"}
    assert not process_gone(elsewhere) and not process_gone({**here, "boot_id": "another-boot"})
    assert process_gone(here)

    liveness = Liveness(60.0, Clock())
    assert lease.claim(storage, 0, None, {"producer": "container", **elsewhere}) == 1
    assert not judge(storage, 0, liveness)  # its lease is read (this host), its pid not trusted
    assert lease.claim(storage, 0, 1, {"producer": "sibling", **here}) == 2
    assert judge(storage, 0, liveness)  # the same namespace: its process is gone, the lane free at once


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def test_a_holder_on_this_host_is_read_when_new_and_once_per_missed_beat_never_per_beat(storage):
    clock = Clock()
    liveness = Liveness(60.0, clock)
    generation = lease.claim(storage, 0, None, alive())
    record = lease.read_lease(storage, 0, generation)
    counted = CountingStorage(storage.uri)
    assert not judge(counted, 0, liveness) and counted.reads == 1  # a new generation here: is its pid alive?
    clock.now += 14
    lease.renew(storage, 0, generation, record)
    assert not judge(counted, 0, liveness) and counted.reads == 1  # a beat is not a new holder
    clock.now += 16
    assert not judge(counted, 0, liveness) and counted.reads == 2  # it missed a beat: read once
    clock.now += 16
    assert not judge(counted, 0, liveness) and counted.reads == 2


def test_a_zombie_is_gone_and_a_live_process_is_not():
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        wait_for(lambda: state(zombie.pid) == "Z", timeout=60, what="the child to exit (not reaped)")
        assert process_gone({**identity(), "pid": zombie.pid})
    finally:
        zombie.wait(timeout=60)
    assert not process_gone(alive())
