"""Conditional creates (`If-None-Match: *`) as AWS answers them, and a store that ignores them.

AWS answers a conditional create that races another for the same key with 409 ConditionalRequestConflict
and documents a retry; moto never does, so the gate (tests/helpers/s3_gate.py) answers the first conditional creates of
lease keys so. Both producers taking lanes of one window at once retry and finish, every sample committed
once. A store that ignores the condition would let two takers win one lane and overwrite commit records:
the window's first write refuses it, naming the store.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from vt.shared import lease
from vt.shared.errors import UserError
from vt.shared.shards import CommitRecord
from vt.shared.storage import RetryPolicy, Storage
from vt.shared.window import open_writer

from helpers.cli_runs import finish, raw_keys, run_forked, start, write_config
from helpers.curation import EVERY_PROCESSOR, scene_keys

FAST = RetryPolicy(attempts=8, base_seconds=0.02, max_seconds=0.2)


def test_a_conditional_create_answered_409_is_retried_then_412_is_an_answer(gated_s3, caplog):
    storage = Storage(gated_s3.uri + "/w", retry=FAST)
    gated_s3.gate.conflicts, gated_s3.gate.conflict_keys = 2, "/w/leases/"
    with caplog.at_level(logging.WARNING, logger="vt.storage"):
        assert storage.create_exclusive("leases/p0/00000001.json", b"ours")
    assert gated_s3.gate.conflicted == 2
    assert sum("ConditionalRequestConflict" in r.message for r in caplog.records) == 2

    gated_s3.gate.conflicts = 1  # a second taker: its race is answered 409, its retry 412 (the lane is taken)
    assert storage.create_exclusive("leases/p0/00000001.json", b"theirs") is False
    assert gated_s3.gate.conflicted == 3 and storage.read("leases/p0/00000001.json") == b"ours"


def test_two_producers_whose_racing_lease_creates_get_409_both_finish(
    tmp_path, raw_shards, tiny_model_factory, gated_s3
):
    uri = gated_s3.uri + "/window"
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run",
        uri,
        window={"size": "keep", "poll_seconds": 0.05, "timeout_seconds": 300.0},
        precompute={"workers": 0, "lanes": 2, "processors": EVERY_PROCESSOR},
    )
    gated_s3.gate.conflicts, gated_s3.gate.conflict_keys = 4, "/window/leases/"
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    producers = [start("precompute", config, log=log) for log in logs]
    try:
        for proc, log in zip(producers, logs):
            finish(proc, log)
    finally:
        for proc in producers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    assert gated_s3.gate.conflicted == 4
    assert sum(log.read_text().count("ConditionalRequestConflict") for log in logs) == 4  # each retried once
    storage = Storage(uri)
    records = [CommitRecord.from_json(storage.read(rel)) for rel in storage.list("commits")]
    committed = Counter(key for record in records for key in record.keys)
    assert set(committed) == scene_keys(raw_keys(raw_shards)) and set(committed.values()) == {1}
    assert sorted(storage.list("done")) == ["done/p0", "done/p1"]
    for lane in (0, 1):  # one holder each: a 409 never let two takers win, nor lost a lane
        assert lease.newest_generation(storage, lane) == 1


def test_a_store_that_ignores_if_none_match_is_refused_at_the_windows_first_write(
    tmp_path, raw_shards, tiny_model_factory, gated_s3
):
    gated_s3.gate.ignore_conditions = True
    uri = gated_s3.uri + "/window"
    config = write_config(
        tmp_path / "run.toml",
        tiny_model_factory("ltx-video"),
        raw_shards,
        tmp_path / "run",
        uri,
        window={"size": "keep"},
        precompute={"workers": 0},
    )
    # a real producer process, forked from the warm interpreter (its start-up is not what is tested)
    code, output = run_forked("vt-precompute", "run", str(config), log=tmp_path / "producer.log", timeout=300)
    assert code == 1, f"a store that overwrites a conditional create was used:\n{output[-3000:]}"
    assert gated_s3.gate.unconditioned >= 2
    message = output[output.index("error:") :]
    assert uri in message and gated_s3.gate.url in message and "If-None-Match" in message, message
    storage = Storage(uri)
    assert not storage.exists("lanes.json") and not storage.list("commits")  # nothing written that others trust
    with pytest.raises(UserError, match="ignores conditional writes"):  # every producer's start refuses it
        open_writer(uri).lanes(1, 4)
