"""The trainer's read-ahead (train/read_ahead.py) on storage that delays every read, as object storage
does: while a step computes, the next batches are read, so a step takes about max(compute, read), not
their sum; the bytes held ahead stay within the budget; and the batches are the synchronous reader's.

The delays are sleeps on purpose: they stand for a store's latency and a GPU's step, which is what is
measured, and a sleeping thread needs no core, so the figures hold on a loaded machine."""

from __future__ import annotations

import time
from statistics import median

import pytest
import torch

from vt.shared.shards import encode_shard
from vt.shared.window import Window
from vt.train.data import BatchReader
from vt.train.read_ahead import ReadAhead

SHARDS, ROWS = 8, 2  # one shard a batch
READ_S = 0.03  # per request: a shard's rows are a header and a range per tensor, ~4 requests
COMPUTE_S = 0.12  # per step


@pytest.fixture(scope="module")
def window_uri(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("read-ahead") / "window")
    window = Window(uri, size="keep")
    window.register_producer(0, 1)
    for seq in range(SHARDS):
        keys = [f"s{seq}-{row}" for row in range(ROWS)]
        tensors = {"latents": torch.full((ROWS, 4, 2, 8, 8), float(seq)), "prompt_embeds": torch.ones(ROWS, 16, 32)}
        window.commit(0, seq, 0, encode_shard(tensors, keys, {"bucket": "9x64x64"}), "9x64x64", keys, "fp")
    window.finish_producer(0, SHARDS)
    return uri


def slow_window(uri: str) -> Window:
    window = Window(uri, size="keep")
    read_ranges = window.storage.read_ranges

    def delayed(rel, ranges):
        time.sleep(READ_S)
        return read_ranges(rel, ranges)

    window.storage.read_ranges = delayed
    return window


def step_times(uri: str, max_bytes: int) -> tuple[list[float], list[list[str]], ReadAhead]:
    """Seconds of each step of a loop over the window's batches with `max_bytes` of read-ahead (0: none)."""
    ahead = ReadAhead(BatchReader(slow_window(uri), ROWS, on_read=lambda p: None), max_bytes)
    times, keys = [], []
    started = time.perf_counter()
    for batch in ahead:
        ahead.top_up()  # as the trainer does, once it holds the step's batches
        time.sleep(COMPUTE_S)  # the model's step
        keys.append(batch.keys)
        now = time.perf_counter()
        times.append(now - started)
        started = now
    return times, keys, ahead


def test_a_step_takes_about_the_longer_of_compute_and_read_not_their_sum(window_uri):
    serial, serial_keys, _ = step_times(window_uri, 0)
    ahead, ahead_keys, reader = step_times(window_uri, 64 * 2**20)
    assert ahead_keys == serial_keys and len(serial_keys) == SHARDS
    read = median(serial[1:]) - COMPUTE_S  # what reading one batch costs on this storage
    assert read > 2 * READ_S, f"the delayed storage should cost several requests a batch, measured {read:.3f}s"
    steady = median(ahead[2:])
    assert steady < COMPUTE_S + 0.35 * read, (f"with read-ahead a step took {steady:.3f}s: compute {COMPUTE_S}s, "
                                              f"read {read:.3f}s, their sum {median(serial[1:]):.3f}s")
    assert reader.peak_held > 0


def test_the_bytes_held_ahead_stay_within_the_budget(window_uri):
    one = ReadAhead(BatchReader(Window(window_uri, size="keep"), ROWS, on_read=lambda p: None), 1)
    batches = list(one)  # a budget below one batch: one batch ahead at a time, never two
    assert len(batches) == SHARDS
    per_batch = one.peak_held
    assert per_batch > 0
    budget = int(2.5 * per_batch)
    _, _, ahead = step_times(window_uri, budget)
    assert per_batch < ahead.peak_held <= budget, (ahead.peak_held, budget)
