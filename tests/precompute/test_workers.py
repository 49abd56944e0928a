"""A decode worker that dies on one clip costs that clip, not the run (and never hangs it)."""

from __future__ import annotations

import os
import signal

from vt.precompute.workers import DecodePool

POISON = 5


def square_or_die(item: int) -> int:
    """Runs in a worker process: SIGKILLs its own process on the poison item, like a codec segfault."""
    if item == POISON:
        os.kill(os.getpid(), signal.SIGKILL)
    return item * item


def test_a_worker_killed_by_one_item_costs_that_item_only():
    pool = DecodePool(workers=2)
    try:
        results = list(pool.map(square_or_die, range(10), inflight=4, on_crash=lambda item: ("crashed", item)))
    finally:
        pool.close()
    assert results == [i * i for i in range(POISON)] + [("crashed", POISON)] + [i * i for i in range(POISON + 1, 10)]
    assert pool.crashes == 1


def test_results_keep_input_order_without_crashes():
    pool = DecodePool(workers=2)
    try:
        assert list(pool.map(abs, range(-20, 0), inflight=3, on_crash=lambda item: None)) == list(range(20, 0, -1))
    finally:
        pool.close()
