"""Storage semantics on every backend: a local folder, memory:// and a real moto S3 server."""

from __future__ import annotations

import threading

import pytest

from vt.shared.storage import Storage


@pytest.fixture(params=["local", "memory", "s3"])
def uri(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "root")
    if request.param == "memory":
        return f"memory://vt-test-{tmp_path.name}/root"
    return request.getfixturevalue("s3_bucket") + "/root"


def test_put_read_list_delete(uri):
    s = Storage(uri)
    assert s.list("") == []
    s.put_atomic("b/2.json", b"two")
    s.put_atomic("a/1.json", b"one")
    s.put_atomic("a/deep/3.bin", b"three")
    assert s.read("a/1.json") == b"one"
    assert s.size("a/deep/3.bin") == 5
    assert s.list("") == ["a/1.json", "a/deep/3.bin", "b/2.json"]
    assert s.list("a") == ["a/1.json", "a/deep/3.bin"]
    assert s.list("missing") == []
    assert s.exists("a/1.json") and not s.exists("a/nope.json")
    s.put_atomic("a/1.json", b"replaced")  # overwrite is allowed for put_atomic
    assert s.read("a/1.json") == b"replaced"
    s.delete("a/1.json")
    s.delete("a/1.json")  # missing is fine
    assert s.list("a") == ["a/deep/3.bin"]
    with pytest.raises(FileNotFoundError):
        s.read("a/1.json")
    with pytest.raises(FileNotFoundError):
        s.size("a/1.json")


def test_create_exclusive(uri):
    s = Storage(uri)
    assert s.create_exclusive("c/x.json", b"first") is True
    assert s.create_exclusive("c/x.json", b"second") is False
    assert s.read("c/x.json") == b"first"
    assert s.list("c") == ["c/x.json"]  # no temp files left behind or listed


def test_create_exclusive_race_has_one_winner(uri):
    s = Storage(uri)
    barrier = threading.Barrier(6)
    wins = []

    def racer(i):
        barrier.wait()
        wins.append((i, s.create_exclusive("race.json", f"writer {i}".encode())))

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, won in wins if won]
    assert len(winners) == 1
    assert s.read("race.json") == f"writer {winners[0]}".encode()


def test_listing_sees_writes_from_another_client(s3_bucket, s3_server):
    """No stale listing cache: an object written behind our back appears on the next list()."""
    import boto3

    s = Storage(s3_bucket + "/w")
    s.put_atomic("commits/p0/00000000.json", b"{}")
    assert s.list("commits/p0") == ["commits/p0/00000000.json"]
    assert not s.exists("commits/p0/00000001.json")
    bucket = s3_bucket.removeprefix("s3://")
    boto3.client("s3", endpoint_url=s3_server).put_object(Bucket=bucket, Key="w/commits/p0/00000001.json", Body=b"{}")
    assert s.list("commits/p0") == ["commits/p0/00000000.json", "commits/p0/00000001.json"]
    assert s.exists("commits/p0/00000001.json")
    assert Storage(s3_bucket + "/w").sizes("commits") == {"commits/p0/00000000.json": 2, "commits/p0/00000001.json": 2}


def test_local_uri_forms_and_bad_input(tmp_path):
    Storage(str(tmp_path / "a")).put_atomic("x.bin", b"1")
    assert Storage(f"file://{tmp_path}/a").read("x.bin") == b"1"
    with pytest.raises(ValueError, match="unsupported storage URI"):
        Storage("gopher://host/x")
    with pytest.raises(ValueError, match="no bucket"):
        Storage("s3://")
    with pytest.raises(ValueError, match="'..'"):
        Storage(str(tmp_path)).read("../escape")
