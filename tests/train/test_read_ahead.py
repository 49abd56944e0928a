"""The trainer's read-ahead (train/read_ahead.py): while a step computes, the next batch is read, so a step
takes max(compute, read), not their sum; the bytes held ahead stay within the budget; and the batches are
the synchronous reader's.

No clock: every storage read is counted, and the test's "step" waits (on that count, with a timeout) until
the next batch's reads are done, without asking the reader for anything. Only reads running beside the
step can end that wait; the synchronous reader, which reads inside `next()`, reads nothing during a step.
"""

from __future__ import annotations

import threading

import pytest
import torch

from vt.shared.shards import encode_shard
from vt.shared.window import open_reader, open_writer
from vt.train.data import BatchReader
from vt.train.read_ahead import ReadAhead

SHARDS, ROWS = 8, 2  # one shard a batch


@pytest.fixture(scope="module")
def window_uri(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("read-ahead") / "window")
    window = open_writer(uri, size="keep")
    window.register_producer(0, 1)
    for seq in range(SHARDS):
        keys = [f"s{seq}-{row}" for row in range(ROWS)]
        tensors = {"latents": torch.full((ROWS, 4, 2, 8, 8), float(seq)), "prompt_embeds": torch.ones(ROWS, 16, 32)}
        window.commit(0, seq, 0, encode_shard(tensors, keys, {"bucket": "9x64x64"}), "9x64x64", keys, "fp")
    window.finish_producer(0, SHARDS)
    return uri


class CountedReads:
    """A window whose storage requests are counted; a test can wait for the count to reach a number."""

    def __init__(self, uri: str):
        self.window = open_reader(uri)
        self.count = 0
        self._changed = threading.Condition()
        read_ranges = self.window.storage.read_ranges

        def counted(rel, ranges):
            data = read_ranges(rel, ranges)
            with self._changed:
                self.count += 1
                self._changed.notify_all()
            return data

        self.window.storage.read_ranges = counted

    def reach(self, count: int, timeout: float = 30.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= count, timeout=timeout)


def run(uri: str, max_bytes: int, step=None) -> tuple[list[int], list[list[str]], ReadAhead]:
    """Loop over the window's batches with `max_bytes` of read-ahead (0: none); `step(reads, index)` is the
    model's step of batch `index`. Returns the reads made by each batch's hand-over, the keys, the read-ahead."""
    reads = CountedReads(uri)
    ahead = ReadAhead(BatchReader(reads.window, ROWS, on_read=lambda p: None), max_bytes)
    handed, keys = [], []
    for index, batch in enumerate(ahead):
        handed.append(reads.count)
        keys.append(batch.keys)
        ahead.top_up()  # as the trainer does, once it holds the step's batches
        if step is not None:
            step(reads, index)
    return handed, keys, ahead


def test_the_next_batch_is_read_while_a_step_computes(window_uri):
    serial, serial_keys, _ = run(window_uri, 0)
    assert len(serial_keys) == SHARDS and serial == sorted(serial) and serial[1] > serial[0] > 0

    def serial_step(reads, index):  # the synchronous reader reads only inside next(): nothing during a step
        assert reads.count == serial[index]

    run(window_uri, 0, serial_step)

    def step(reads, index):  # ends once the next batch's reads are done, with the reader left alone
        if index + 1 < SHARDS:
            assert reads.reach(serial[index + 1]), f"batch {index + 1} was not read during step {index}"

    handed, keys, ahead = run(window_uri, 64 * 2**20, step)
    assert keys == serial_keys
    assert all(h >= s for h, s in zip(handed, serial)) and ahead.peak_held > 0


def test_the_bytes_held_ahead_stay_within_the_budget(window_uri):
    _, keys, one = run(window_uri, 1)  # a budget below one batch: one batch ahead at a time, never two
    assert len(keys) == SHARDS
    per_batch = one.peak_held
    assert per_batch > 0
    budget = int(2.5 * per_batch)
    _, _, ahead = run(window_uri, budget)
    assert per_batch < ahead.peak_held <= budget, (ahead.peak_held, budget)
