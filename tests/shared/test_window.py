"""The shard window contract, on a local folder and on a real moto S3 server.

Crash safety is shown with a real producer process killed by SIGKILL between its data write and its
commit; timing independence with producer threads committing in scrambled orders; backpressure with
a producer thread that polls until the reader publishes its position.
"""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import threading

import pytest
import torch

from vt.shared.shards import decode_shard, encode_shard
from vt.shared.storage import Storage
from vt.shared.window import (
    Reader,
    ShardCorruptError,
    WindowTimeout,
    Writer,
    commit_path,
    data_path,
    inspect,
    open_reader,
    open_writer,
)

from helpers.polling import wait_for

FAST = {"poll_seconds": 0.01, "timeout_seconds": 30.0}


class Both:
    """A producer's writer and a trainer's reader of one window over one storage, for the tests that play both
    sides of the protocol in one process."""

    def __init__(
        self,
        uri: str,
        size: int | str = 8,
        poll_seconds: float = 0.2,
        timeout_seconds: float = 1800.0,
        storage: Storage | None = None,
    ):
        self.writer = open_writer(uri, size, poll_seconds, timeout_seconds, storage)
        self.reader = open_reader(uri, size, poll_seconds, timeout_seconds, self.writer.storage)


@pytest.fixture(params=["local", "s3"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "window")
    return request.getfixturevalue("s3_bucket") + "/window"


def shard(rank: int, seq: int) -> bytes:
    keys = [f"p{rank}-s{seq}-a", f"p{rank}-s{seq}-b"]
    latents = torch.full((2, 4, 2, 2), float(rank * 100 + seq)).to(torch.bfloat16)
    return encode_shard({"latents": latents}, keys, {"bucket": "9x64x64"})


def data_of(w: Reader, rank: int, seq: int) -> str:
    """Where shard (rank, seq) landed: data files are named by seq and content, as its record says."""
    return w.record(rank, seq).data


def commit(w: Writer, rank: int, seq: int):
    w.wait_for_room(rank)
    return w.commit(
        rank,
        seq,
        epoch=0,
        data=shard(rank, seq),
        bucket="9x64x64",
        keys=[f"p{rank}-s{seq}-a", f"p{rank}-s{seq}-b"],
        fingerprint="fp",
    )


def produce(w: Writer, rank: int, world: int, count: int):
    w.register_producer(rank, world)
    for seq in range(count):
        commit(w, rank, seq)
    w.finish_producer(rank, count)


def slots(w: Reader, start: int = 0):
    return [(pos, r.producer, r.seq) for pos, r in w.order(start)]


CHILD = r"""
import sys
from vt.shared.storage import Storage
from vt.shared.window import open_writer

uri, shard0, shard1 = sys.argv[1:]
create = Storage.create_exclusive

def stall_before_second_record(self, rel, data):
    if rel.endswith("00000001.json"):  # shard 1's data is fully written; its record is next
        print("DATA-WRITTEN", flush=True)
        sys.stdin.readline()  # the parent SIGKILLs us here
    return create(self, rel, data)

Storage.create_exclusive = stall_before_second_record
w = open_writer(uri)
w.register_producer(0, 1)
for seq, path in enumerate([shard0, shard1]):
    w.commit(0, seq, 0, open(path, "rb").read(), "9x64x64", ["a", "b"], "fp")
"""


def test_sigkill_before_commit(uri, tmp_path):
    files = []
    for seq in range(2):
        files.append(tmp_path / f"shard{seq}.safetensors")
        files[-1].write_bytes(shard(0, seq if seq == 0 else 11))  # the killed run's shard 1 differs
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, uri, *map(str, files)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    line = proc.stdout.readline()
    assert line == b"DATA-WRITTEN\n", proc.stderr.read().decode()
    proc.send_signal(signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    proc.stdin.close(), proc.stdout.close(), proc.stderr.close()

    storage = Storage(uri)
    orphan = data_path(0, 1, hashlib.sha256(files[1].read_bytes()).hexdigest())
    assert storage.exists(orphan) and not storage.exists(commit_path(0, 1))
    impatient = open_reader(uri, poll_seconds=0.01, timeout_seconds=0.3)
    order = impatient.order()
    assert next(order)[1].seq == 0
    with pytest.raises(WindowTimeout, match="producer 0 shard 1"):
        next(order)  # the orphan is invisible: the reader still waits for shard 1's record

    restarted = Both(uri, **FAST)
    assert restarted.reader.next_seq(0) == 1
    assert restarted.writer.clean_orphans(0) == []  # seq 1 is not committed yet: kept until it is
    commit(restarted.writer, 0, 1)
    assert not storage.exists(orphan)  # committing seq 1 deleted the killed run's bytes for it
    restarted.writer.finish_producer(0, 2)
    records = [r for _, r in open_reader(uri).order()]
    assert [r.seq for r in records] == [0, 1]
    assert storage.list("data") == [r.data for r in records]
    tensors, keys, _ = decode_shard(restarted.reader.read_shard(records[1]))
    assert keys == ["p0-s1-a", "p0-s1-b"] and tensors["latents"][0, 0, 0, 0].item() == 1.0


def _run_schedule(uri: str, counts: dict[int, int], schedule: list[tuple[int, int]]):
    """Producers commit exactly in `schedule` order (threads + events) while a reader follows."""
    turns = {step: threading.Event() for step in schedule}
    following = dict(zip(schedule, schedule[1:]))
    errors = []

    def producer(rank):
        try:
            w = open_writer(uri, size="keep", **FAST)
            w.register_producer(rank, len(counts))
            for seq in range(counts[rank]):
                assert turns[(rank, seq)].wait(30)
                w.commit(rank, seq, 0, shard(rank, seq), "9x64x64", ["a", "b"], "fp")
                if (rank, seq) in following:
                    turns[following[(rank, seq)]].set()
            w.finish_producer(rank, counts[rank])
        except BaseException as err:  # surfaced in the main thread
            errors.append(err)

    seen = []
    reader = threading.Thread(target=lambda: seen.extend(slots(open_reader(uri, **FAST))))
    threads = [reader] + [threading.Thread(target=producer, args=(r,)) for r in counts]
    for t in threads:
        t.start()
    turns[schedule[0]].set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return seen


def test_fixed_order_scrambled(uri):
    counts = {0: 3, 1: 5}
    expected = [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1), (4, 0, 2), (5, 1, 2), (6, 1, 3), (7, 1, 4)]
    p1_first = [(1, 0), (1, 1), (1, 2), (1, 3), (0, 0), (1, 4), (0, 1), (0, 2)]
    p0_first = [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3), (1, 4)]
    assert _run_schedule(uri + "/a", counts, p1_first) == expected
    assert _run_schedule(uri + "/b", counts, p0_first) == expected
    assert slots(open_reader(uri + "/a", **FAST), start=5) == expected[5:]  # a restarted reader


def test_order_ends_when_done(uri):
    w = Both(uri, **FAST)
    produce(w.writer, 0, 3, 2)
    produce(w.writer, 1, 3, 0)  # a producer with nothing to write
    produce(w.writer, 2, 3, 1)
    assert slots(w.reader) == [(0, 0, 0), (1, 2, 0), (2, 0, 1)]
    state = inspect(w.reader.uri)
    assert state["committed"] == 3 and state["world_size"] == 3
    assert all(p["done"] for p in state["producers"].values())


class PollCountingStorage(Storage):
    """Real storage that counts a producer's backpressure polls: each poll of wait_for_room evicts, and
    eviction lists the rank's data folder once."""

    polls = 0

    def sizes(self, prefix=""):
        self.polls += prefix == "data/p0"
        return super().sizes(prefix)


def test_backpressure(uri):
    w = Both(uri, size=4, **FAST)
    for rank in (0, 1):
        w.writer.register_producer(rank, 2)
        for seq in range(2):  # share = 4 // 2 = 2 each
            commit(w.writer, rank, seq)
    assert inspect(w.reader.uri)["unread"] == 4
    impatient = open_writer(uri, size=4, poll_seconds=0.01, timeout_seconds=0.2)
    with pytest.raises(WindowTimeout, match="2 committed shards .* are unread"):
        impatient.wait_for_room(0)

    counting = PollCountingStorage(uri)
    blocked = open_writer(uri, size=4, storage=counting, **FAST)
    room = threading.Event()
    thread = threading.Thread(target=lambda: (blocked.wait_for_room(0), room.set()))
    thread.start()
    wait_for(lambda: counting.polls >= 2, what="the producer to poll while the window is full")
    assert not room.is_set()
    open_reader(uri, size=4).publish_read(1)  # position 0 = producer 0 shard 0
    thread.join(30)
    assert room.is_set()
    with pytest.raises(WindowTimeout):
        impatient.wait_for_room(1)  # producer 1 has nothing read yet: still full
    commit(w.writer, 0, 2)
    assert inspect(w.reader.uri)["unread"] == 4


def test_watermark_eviction(uri):
    w = Both(uri, size=8, **FAST)
    for rank in (0, 1):
        produce(w.writer, rank, 2, 3)
    # order: (0,0) (1,0) (0,1) (1,1) (0,2) (1,2)
    w.reader.publish_read(6)
    assert w.writer.evict() == []  # nothing below a watermark yet
    w.reader.publish_watermark(3)  # positions 0..2: producer 0 seqs 0-1, producer 1 seq 0
    names = {(r.producer, r.seq): r.data for _, r in w.reader.order()}
    evicted = w.writer.evict()
    gone = [(0, 0), (0, 1), (1, 0)]
    kept = [(0, 2), (1, 1), (1, 2)]
    assert sorted(evicted) == sorted([commit_path(*s) for s in gone] + [names[s] for s in gone])
    assert evicted.index(commit_path(0, 0)) < evicted.index(names[0, 0])  # record first
    storage = Storage(uri)
    for s in kept:
        assert storage.exists(commit_path(*s)) and storage.exists(names[s])

    fresh = open_reader(uri, size=8, **FAST)  # a restart recomputes everything from storage
    assert fresh.next_seq(0) == 3 and fresh.next_seq(1) == 3
    records = list(fresh.order(start=3))
    assert [(p, r.producer, r.seq) for p, r in records] == [(3, 1, 1), (4, 0, 2), (5, 1, 2)]
    assert all(decode_shard(fresh.read_shard(r))[1][0].startswith(f"p{r.producer}") for _, r in records)
    with pytest.raises(RuntimeError, match="evicted"):
        next(fresh.order(start=0))
    fresh.publish_watermark(1)  # never moves back
    state = inspect(fresh.uri)
    assert state["watermark"] == 3 and state["evicted"] == 3 and state["present"] == 3
    assert state["bytes"] == sum(r.nbytes for _, r in records)


def test_the_trainers_eviction_lists_once_then_deletes_from_the_order_it_holds(tmp_path):
    """`evict_read` (the trainer's rank 0 after a checkpoint): the first time in a process it lists the producers'
    folders (what an earlier trainer left below the watermark); after that it deletes the records, then the data,
    of the positions it read and the watermark passed, with no listing, whatever the number of producers."""
    uri = str(tmp_path / "window")
    for rank in range(4):
        produce(open_writer(uri, 12, **FAST), rank, 4, 3)
    earlier = open_reader(uri, 12, **FAST)  # a trainer that read 4 positions and checkpointed, then stopped
    list(zip(range(4), earlier.order()))
    earlier.publish_read(4)
    earlier.publish_watermark(2)
    reader = open_reader(uri, 12, **FAST)
    records = dict(reader.order(start=2))
    before = {p: r.data for p, r in earlier.order()}  # what the earlier trainer read: positions 0 and 1
    listings = []
    reader.storage.list = lambda prefix="", _list=reader.storage.list: listings.append(prefix) or _list(prefix)
    reader.publish_read(12)
    reader.publish_watermark(5)
    first = reader.evict_read()
    assert listings and sorted(first) == sorted(
        [
            commit_path(0, 0),
            commit_path(1, 0),
            before[0],
            before[1],
            commit_path(2, 0),
            commit_path(3, 0),
            commit_path(0, 1),
            records[2].data,
            records[3].data,
            records[4].data,
        ]
    )
    listings.clear()
    reader.publish_watermark(9)
    second = reader.evict_read(background=True)  # as the trainer does it: the deletes on a thread of their own
    reader.wait_evictions()
    assert listings == [], f"the trainer's eviction listed {listings}"
    assert second == [commit_path(r.producer, r.seq) for r in (records[p] for p in range(5, 9))] + [
        records[p].data for p in range(5, 9)
    ]  # records first, then data
    left = Storage(uri)
    assert not any(left.exists(rel) for rel in second)
    assert sorted(left.list("commits")) == sorted(commit_path(records[p].producer, records[p].seq) for p in (9, 10, 11))
    assert reader.evict_read() == []


class ThreadCountingStorage(Storage):
    """Real storage that counts the requests made on the thread that created it (the training thread)."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.owner = threading.current_thread()
        self.requests = 0

    def _count(self) -> None:
        self.requests += threading.current_thread() is self.owner

    def read(self, rel):
        self._count()
        return super().read(rel)

    def list(self, prefix=""):
        self._count()
        return super().list(prefix)

    def put_atomic(self, rel, data):
        self._count()
        return super().put_atomic(rel, data)

    def delete(self, rel):
        self._count()
        return super().delete(rel)


def test_the_trainers_requests_per_shard_do_not_grow_with_the_producers(tmp_path):
    """Rank 0's walk as the trainer makes it (a record per position, the read position each shard, a watermark and
    an eviction every 4): once the first round has found every producer (a registration and a listing each, once),
    its own thread makes the same requests per shard over 1 producer's window as over 8 producers' (16 shards
    each): the records come read ahead on other threads, eviction deletes what it read without listing; the end of
    the order costs each producer its done marker, once."""
    per_shard = {}
    for producers in (1, 8):
        uri = str(tmp_path / f"window-{producers}")
        for rank in range(producers):
            produce(open_writer(uri, 16, **FAST), rank, producers, 16 // producers)
        storage = ThreadCountingStorage(uri)
        reader = open_reader(uri, 16, storage=storage, **FAST)
        for position in range(8):  # the first round: every producer found
            assert reader.record_at(position) is not None
        reader.publish_read(8)
        reader.publish_watermark(8)
        reader.evict_read()  # the first eviction in a process lists; what follows must not
        start = storage.requests
        for position in range(8, 16):
            assert reader.record_at(position) is not None
            reader.publish_read(position + 1)
            if (position + 1) % 4 == 0:
                reader.publish_watermark(position + 1)
                reader.evict_read()
        per_shard[producers] = (storage.requests - start) / 8
        start = storage.requests
        assert reader.record_at(16) is None  # the end: each producer's done marker read once, when it is reached
        assert storage.requests - start <= 3 * producers
    assert per_shard[8] == per_shard[1] == 3.25, per_shard  # a read position each, and per 4: a watermark, 8 deletes


def test_keep_never_evicts(uri):
    w = Both(uri, size="keep", poll_seconds=0.01, timeout_seconds=0.2)
    produce(w.writer, 0, 1, 5)  # wait_for_room never blocks although nothing is read
    assert slots(w.reader) == [(i, 0, i) for i in range(5)]
    w.reader.publish_read(5)
    w.reader.publish_watermark(5)
    assert w.writer.evict() == []
    assert Storage(uri).list("data") == [data_of(w.reader, 0, i) for i in range(5)]
    assert slots(w.reader) == [(i, 0, i) for i in range(5)]  # a second epoch reads it all again


def test_corrupt_data_fails_read(uri):
    w = Both(uri, **FAST)
    w.writer.register_producer(0, 1)
    record = commit(w.writer, 0, 0)
    storage = Storage(uri)
    good = storage.read(record.data)
    storage.put_atomic(record.data, good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(ShardCorruptError, match="sha256"):
        w.reader.read_shard(record)
    storage.put_atomic(record.data, good[:-4])
    with pytest.raises(ShardCorruptError, match=f"{len(good) - 4} bytes but its commit record says"):
        w.reader.read_shard(record)
    storage.put_atomic(record.data, good)
    assert w.reader.read_shard(record) == good


def test_misuse_gets_clear_errors(uri):
    w = Both(uri, **FAST)
    w.writer.acquire(0)
    w.writer.register_producer(0, 2)
    with pytest.raises(ValueError, match="world size 2"):
        w.writer.register_producer(1, 3)
    with pytest.raises(ValueError, match="must commit seq 0 next, got 1"):
        w.writer.commit(0, 1, 0, shard(0, 1), "9x64x64", ["a", "b"], "fp")
    commit(w.writer, 0, 0)
    other = open_writer(uri, **FAST)  # a second process that wrongly also runs as rank 0
    other.acquire(0)  # its lease is newer: w is fenced at its next commit
    commit(other, 0, 1)
    with pytest.raises(RuntimeError, match="lane 0 of .* was taken over by generation"):
        commit(w.writer, 0, 1)  # w still expects seq 1, but a newer producer holds rank 0 now
    with pytest.raises(ValueError, match="finish with num_shards=2"):
        w.writer.finish_producer(0, 3)
    with pytest.raises(ValueError, match="past the shards committed"):
        w.reader.publish_read(3)
    with pytest.raises(ValueError, match="positive integer"):
        open_writer(uri, size=0)


def test_walking_the_order_again_asks_storage_nothing(tmp_path):
    """publish_read runs for every shard read: a long run must not re-walk the order from position 0."""
    uri = str(tmp_path / "window")
    for rank in range(2):
        produce(open_writer(uri, "keep", **FAST), rank, 2, 5 - rank)
    reader = open_reader(uri, "keep", **FAST)
    expected = slots(reader)
    assert len(expected) == 9

    listings = []
    reader.storage.list = lambda prefix="", _list=reader.storage.list: listings.append(prefix) or _list(prefix)
    reader.publish_read(9)
    reader.publish_watermark(8)
    assert listings == [], f"the known order was walked through storage again: {listings}"
    assert slots(reader, start=7) == expected[7:]


def test_state_shows_the_size_producers_registered(uri):
    """inspect opens a window without knowing its size: the size comes from the registrations."""
    from typer.testing import CliRunner

    from vt.precompute.cli import app
    from vt.shared.window import producer_path

    open_writer(uri, size=2, **FAST).register_producer(0, 2)
    assert inspect(uri)["size"] == 2  # open_writer(uri) itself defaults to 8
    open_writer(uri, size=2, **FAST).register_producer(1, 2)
    state = inspect(uri)
    assert state["size"] == 2 and [p["size"] for p in state["producers"].values()] == [2, 2]
    assert "size=2 " in CliRunner().invoke(app, ["inspect", uri]).output
    open_writer(uri, size=6, **FAST).register_producer(0, 2)  # a restart with another size: kept current
    assert inspect(uri)["size"] == "p0=6, p1=2"
    open_writer(uri, size=6, **FAST).register_producer(1, 2)
    assert inspect(uri)["size"] == 6
    # A window whose registrations hold no size (written by an older vt): unknown, never a made-up 8.
    storage = Storage(uri)
    storage.put_atomic(producer_path(0), b'{"rank": 0, "world_size": 1, "done": false, "num_shards": null}')
    storage.delete(producer_path(1))
    assert inspect(uri)["size"] == "unknown"
    assert "size=unknown " in CliRunner().invoke(app, ["inspect", uri]).output


def test_a_restart_with_other_settings_is_refused(uri):
    """A producer restarted into a window its rank wrote with another fingerprint stops, naming both."""
    w = open_writer(uri, size=4, **FAST)
    w.acquire(0)
    assert w.register_producer(0, 1, fingerprint="fp")
    commit(w, 0, 0)
    restarted = open_writer(uri, size=4, **FAST)
    restarted.acquire(0)
    with pytest.raises(ValueError, match=r"other settings \(fingerprint fp, now other\).*fresh window.uri"):
        restarted.register_producer(0, 1, fingerprint="other")
    assert restarted.register_producer(0, 1, fingerprint="fp")  # the same settings continue


KILLED_WRITE = r"""
import sys
from vt.shared.window import open_reader, open_writer

uri, role = sys.argv[1:]
if role == "consumer":
    open_reader(uri).publish_read(1)  # killed inside consumer.json's write
else:
    writer = open_writer(uri)
    writer.acquire(0)
    writer.write_progress(0, {"samples": 4})  # killed inside progress/p0's write
"""


def killed_inside_a_write(uri: str, role: str, point: str) -> None:
    """A real process SIGKILLed with half of its atomic write in a temp file (shared/faults.py)."""
    import os

    env = {**os.environ, "VT_FAULT_AT": point}
    done = subprocess.run([sys.executable, "-c", KILLED_WRITE, uri, role], env=env, capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()


def test_killed_writers_temp_files_are_shown_and_cleaned_by_the_role_that_owns_them(tmp_path):
    """A trainer killed inside its consumer.json write and a producer killed inside its progress write leave
    hidden temp files: `inspect` lists them, each role's cleaner removes its own and not the other's, and a
    temp file whose writer cannot be checked (another host) goes once older than STALE_TEMP_SECONDS."""
    import os
    import time

    from vt.precompute.cli import format_state
    from vt.shared.storage import STALE_TEMP_SECONDS

    uri = str(tmp_path / "window")
    w = Both(uri, **FAST)
    w.writer.acquire(0)
    w.writer.register_producer(0, 1)
    commit(w.writer, 0, 0)
    killed_inside_a_write(uri, "consumer", "storage.put.mid_write:consumer.json")
    killed_inside_a_write(uri, "producer", "storage.put.mid_write:progress")
    leftovers = inspect(w.reader.uri)["leftovers"]
    consumer_tmp = [rel for rel in leftovers if rel.startswith(".consumer.json.vt-tmp-")]
    progress_tmp = [rel for rel in leftovers if rel.startswith("progress/p0/.")]
    assert len(consumer_tmp) == 1 and len(progress_tmp) == 1 and len(leftovers) == 2, leftovers
    assert all(0 <= age < 600 for age in leftovers.values())
    assert consumer_tmp[0] in format_state(inspect(w.reader.uri)) and "unfinished writes" in format_state(
        inspect(w.reader.uri)
    )
    assert not any(".vt-tmp-" in rel for rel in Storage(uri).list(""))  # listings never show temp files

    assert open_writer(uri).clean_orphans(0) == progress_tmp  # the producer cleans its own folders only
    assert list(inspect(w.reader.uri)["leftovers"]) == consumer_tmp
    assert open_reader(uri).clean_consumer_debris() == consumer_tmp  # the trainer's rank 0, at its start
    assert inspect(w.reader.uri)["leftovers"] == {}

    foreign = tmp_path / "window" / ".consumer.json.vt-tmp-otherhost-1-abcdef012345"
    foreign.write_bytes(b"half")  # another host's writer: its pid cannot be checked, only its age
    assert w.reader.clean_consumer_debris() == []
    old = time.time() - STALE_TEMP_SECONDS - 60
    os.utime(foreign, (old, old))
    assert w.reader.clean_consumer_debris() == [foreign.name] and not foreign.exists()


def test_a_noted_read_position_is_written_once_flushed_or_before_the_reader_waits(tmp_path):
    """The trainer's rank 0 notes the read position per shard and writes it once a step (`flush_read`); it
    must also write it before it waits for a commit, or a producer waiting for room and the reader would
    wait on each other."""
    from vt.shared.window import ledger

    w = Both(str(tmp_path / "w"), size=2, poll_seconds=2.0, timeout_seconds=0.5)  # a write per 2 s at most
    w.writer.register_producer(0, 1)
    commit(w.writer, 0, 0)
    commit(w.writer, 0, 1)
    read = lambda: ledger.consumer(w.reader.storage)["read_position"]  # noqa: E731
    assert w.reader.record_at(0) is not None
    w.reader.note_read(1)
    assert read() == 0, "noted, not written yet"
    w.reader.flush_read()
    assert read() == 1
    assert w.reader.record_at(1) is not None
    w.reader.note_read(2)
    w.reader.flush_read()
    assert read() == 1, "at most one write per poll_seconds"
    with pytest.raises(WindowTimeout):
        w.reader.record_at(2)  # shard 2 never comes: the reader waits, and writes its position first
    assert read() == 2
