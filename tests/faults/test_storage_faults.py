"""Storage under a failing S3 store: transient failures are retried with backoff, answers never are.

The store is a real moto server behind a socket-level gate (tests/helpers/s3_gate.py) that refuses connections,
answers 503 SlowDown, or applies a request and loses its reply, and a server that is killed and
restarted with its objects while clients keep working.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import boto3
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from vt.shared.storage import RetryPolicy, Storage, StorageUnavailable, is_transient

from helpers.polling import wait_for

FAST = RetryPolicy(attempts=8, base_seconds=0.02, max_seconds=0.2)


def client_error(status: int, code: str) -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "GetObject"
    )


def test_transient_or_not():
    assert is_transient(ConnectionRefusedError()) and is_transient(TimeoutError())
    assert is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert is_transient(client_error(503, "SlowDown")) and is_transient(client_error(500, "InternalError"))
    assert is_transient(client_error(400, "RequestTimeout"))
    wrapped = OSError(5, "server said 502")  # how s3fs hands over an unknown ClientError
    wrapped.__cause__ = client_error(502, "BadGateway")
    assert is_transient(wrapped)
    for answer in (
        FileNotFoundError("gone"),
        FileExistsError("412"),
        PermissionError("403"),
        client_error(404, "NoSuchKey"),
        client_error(412, "PreconditionFailed"),
        ValueError("bad"),
    ):
        assert not is_transient(answer), answer


def test_busy_and_refused_are_retried(gated_s3, caplog):
    storage = Storage(gated_s3.uri + "/w", retry=FAST)
    storage.put_atomic("a.bin", b"payload")
    gated_s3.gate.busy = 2
    with caplog.at_level(logging.WARNING, logger="vt.storage"):
        assert storage.read("a.bin") == b"payload"
    assert gated_s3.gate.answered_busy == 2
    assert sum("storage retry" in r.message for r in caplog.records) == 2

    gated_s3.gate.down()
    opener = threading.Thread(
        target=lambda: (wait_for(lambda: gated_s3.gate.refused >= 2, what="refusals"), gated_s3.gate.open())
    )
    opener.start()
    storage.put_atomic("b.bin", b"written through an outage")
    opener.join()
    assert gated_s3.gate.refused >= 2
    assert storage.read("b.bin") == b"written through an outage"


def test_answers_are_not_retried(gated_s3, caplog):
    def requests_for(storage: Storage) -> int:
        before = gated_s3.moto.requests()
        with pytest.raises(FileNotFoundError):
            storage.read("missing.json")
        assert storage.create_exclusive("r.json", b"second") is False  # 412: an answer, not a failure
        return gated_s3.moto.requests() - before

    assert Storage(gated_s3.uri + "/w").create_exclusive("r.json", b"first")
    single_try = requests_for(Storage(gated_s3.uri + "/w", retry=RetryPolicy(attempts=1)))
    with caplog.at_level(logging.WARNING, logger="vt.storage"):
        assert requests_for(Storage(gated_s3.uri + "/w", retry=FAST)) == single_try
    assert not caplog.records


def test_give_up_after_the_budget(gated_s3):
    storage = Storage(gated_s3.uri + "/w", retry=RetryPolicy(attempts=3, base_seconds=0.01, max_seconds=0.02))
    gated_s3.gate.down()
    with pytest.raises(StorageUnavailable, match="failed 3 times .*VT_STORAGE_RETRIES"):
        storage.read("a.bin")
    assert gated_s3.gate.refused >= 3


def test_lost_reply_of_an_exclusive_create(gated_s3):
    """The PUT lands but its reply is lost: the retry meets 412 and must still report our own create."""
    storage = Storage(gated_s3.uri + "/w", retry=FAST)
    gated_s3.gate.lose_replies = 1
    assert storage.create_exclusive("c.json", b"ours") is True
    assert gated_s3.gate.replies_lost == 1 and storage.read("c.json") == b"ours"
    gated_s3.gate.lose_replies = 1
    assert storage.create_exclusive("c.json", b"someone else's") is False  # bytes differ: not ours


def test_server_restart_keeps_objects_and_clients_carry_on(gated_s3):
    storage = Storage(gated_s3.uri + "/w", retry=RetryPolicy(attempts=40, base_seconds=0.02, max_seconds=0.5))
    storage.put_atomic("before.bin", b"1" * 1000)
    assert storage.create_exclusive("commits/00.json", b"{}")
    gated_s3.gate.down()
    results = {}
    writer = threading.Thread(
        target=lambda: results.update(put=storage.put_atomic("during.bin", b"2"), listed=storage.list(""))
    )
    writer.start()
    wait_for(lambda: gated_s3.gate.refused >= 1, what="the client to meet the outage")
    gated_s3.moto.crash_and_restart()
    gated_s3.gate.open(gated_s3.moto.port)
    writer.join(60)
    assert results["listed"] == ["before.bin", "commits/00.json", "during.bin"]
    assert storage.read("before.bin") == b"1" * 1000
    assert storage.create_exclusive("commits/00.json", b"{}") is False  # the restarted server still has it


def test_a_killed_writers_debris_is_cleaned(gated_s3, tmp_path):
    """Invisible leftovers: an S3 multipart upload never completed; local temp files of a dead process."""
    s3 = boto3.client("s3", endpoint_url=gated_s3.gate.url)
    s3.create_multipart_upload(Bucket=gated_s3.bucket, Key="w/data/p0/00000003-g1-abc.safetensors")
    s3.create_multipart_upload(Bucket=gated_s3.bucket, Key="w/data/p1/00000000-g1-abc.safetensors")
    storage = Storage(gated_s3.uri + "/w", retry=FAST)
    assert storage.clean_incomplete("data/p0") == ["data/p0/00000003-g1-abc.safetensors"]
    left = [u["Key"] for u in s3.list_multipart_uploads(Bucket=gated_s3.bucket).get("Uploads", [])]
    assert left == ["w/data/p1/00000000-g1-abc.safetensors"]  # another rank's: not ours to touch

    local = Storage(str(tmp_path / "local"))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    writer = lambda pid: f".00000001.safetensors.vt-tmp-{os.uname().nodename.replace('-', '_')}-{pid}-0123"
    folder = tmp_path / "local" / "data" / "p0"
    folder.mkdir(parents=True)
    for pid in (dead.pid, os.getpid()):
        (folder / writer(pid)).write_bytes(b"half a shard")
    assert local.list("") == []  # temp files are never listed
    assert local.clean_incomplete("data/p0") == [f"data/p0/{writer(dead.pid)}"]
    assert sorted(p.name for p in folder.iterdir()) == [writer(os.getpid())]  # a live writer's file stays


def test_the_retry_budget_is_the_wall_time_it_says(gated_s3, monkeypatch):
    low, high = RetryPolicy().wait_range()  # the defaults, as docs/window.md gives them
    assert (round(low, 1), round(high, 1)) == (10.7, 21.3)
    monkeypatch.setenv("VT_STORAGE_RETRY_SECONDS", "0.4")
    policy = RetryPolicy.from_env()
    assert policy.seconds == 0.4
    storage = Storage(gated_s3.uri + "/w", retry=RetryPolicy(base_seconds=0.02, max_seconds=0.1, seconds=1.5))
    gated_s3.gate.down()
    started = time.monotonic()
    with pytest.raises(StorageUnavailable, match=r"retry budget \(1.5 s \(VT_STORAGE_RETRY_SECONDS\)\)"):
        storage.read("a.bin")
    # It gives up once the next wait would pass the budget: at 1.4 s at the earliest (the longest wait is 0.1 s),
    # after as many tries as fit, however slowly a loaded machine answers them.
    assert time.monotonic() - started > 1.4 and gated_s3.gate.refused >= 2
    monkeypatch.setenv("VT_STORAGE_RETRY_SECONDS", "soon")
    with pytest.raises(ValueError, match="VT_STORAGE_RETRY_SECONDS='soon'"):
        RetryPolicy.from_env()


def test_a_lost_connection_no_request_awaited_is_no_traceback(gated_s3, caplog):
    """aiohttp leaves a connection task's error unretrieved when the request it served failed (and was retried
    by Storage): asyncio would print "Task exception was never retrieved" with a traceback after an outage
    the retries rode out. On fsspec's loop such an error is logged at debug level; any other still shows."""
    import asyncio
    import gc

    import aiohttp
    from fsspec.asyn import get_loop

    Storage(gated_s3.uri + "/w")  # an S3 store: its backend quiets fsspec's loop

    async def failing(err: BaseException):
        raise err

    async def start_and_forget():
        for err in (aiohttp.ClientConnectionResetError("Cannot write to closing transport"), ValueError("a bug")):
            asyncio.get_running_loop().create_task(failing(err))
        await asyncio.sleep(0.01)

    with caplog.at_level(logging.DEBUG), caplog.at_level(logging.DEBUG, logger="vt.storage"):
        asyncio.run_coroutine_threadsafe(start_and_forget(), get_loop()).result(timeout=10)
        gc.collect()
        wait_for(
            lambda: any("never retrieved" in r.getMessage() for r in caplog.records if r.name == "asyncio"),
            timeout=10,
            what="the unretrieved ValueError's report",
        )
    shown = [r for r in caplog.records if r.name == "asyncio"]
    assert len(shown) == 1 and "a bug" in repr(shown[0].exc_info or shown[0].getMessage())
    assert any("no request awaited" in r.getMessage() for r in caplog.records if r.name == "vt.storage")
